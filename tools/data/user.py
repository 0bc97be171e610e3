"""An operator's own prompts, from a JSONL file, for calibration, profiling and evaluation.

One prompt per line::

    {"prompt": "Summarize: ...", "answer": "...", "continuation": "..."}
    {"prompt": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}]}
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    a plain text line is a prompt too

``prompt`` is text (a user message, wrapped in the pair's own chat template when its tokenizer has
one) or a list of chat messages; ``messages`` is a chat as a fine-tuning file holds it (OpenAI's
format: a final assistant message is the answer, the messages before it the prompt); ``answer``
(optional) is a gold answer, scored as task F1; ``continuation`` (optional) is held-out text that
follows the prompt, scored teacher-forced (without one, the Oracle's own greedy answer is the
teacher-forced target); ``id`` (optional) names the row in reports. Any other field (a source, a
category) is the row's metadata: ignored for scoring (one warning names them), kept beside the row's
scores by ``scd eval --rows-json`` so that results can be grouped by it. Each prompt falls into the
calibration, validation or test split by a seeded hash of its content, so a line keeps its split
when lines are added, removed or reordered, and the splits never share a prompt.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
from pathlib import Path

from shared.errors import InvalidRequest
from shared.model.prompt import PromptFormat, check_messages
from tools.data import SPLITS, Item, Split

SPLIT_FRACTIONS = {"calibration": 0.6, "validation": 0.2, "test": 0.2}
SPLIT_SEED = 20261130
FEW = {"calibration": 32, "validation": 16, "test": 16}
"""Below these a split still works but says it is small: calibration fits the codes on its prompts,
validation chooses layers, ranks and fallbacks on its own, and test is what ``scd eval`` averages.
The built-in pairs use 64, 24-64 and 48."""
SPLIT_ROLE = {"calibration": "the codes are fitted on them",
              "validation": "layers, ranks and fallbacks are chosen on them", "test": "the scores average over them"}


FIELDS = ("prompt", "answer", "continuation", "id")
"""The fields a row's prompt is made of; any other is the row's metadata (``Item.meta``)."""
_WARNED: set[str] = set()
log = logging.getLogger("scd.data")


class DataFileError(ValueError):
    """A data file that cannot be used (the message names the file, the line and what to fix)."""


def _records(path: Path) -> list[tuple[int, dict]]:
    if path.is_dir():
        raise DataFileError(f"data path {path} is a folder; give a JSONL or text file")
    if not path.is_file():
        raise DataFileError(f"data file {path} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataFileError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); save the "
                            "file as UTF-8 JSONL or plain text") from None
    if text.startswith("\ufeff"):  # a byte-order mark, as some editors save UTF-8
        text = text[1:]
    out = []
    extras: dict[str, object] = {}
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = line if not line.lstrip().startswith("{") else None
            if obj is None:
                raise DataFileError(f"{path}:{i + 1}: looks like JSON but does not parse; fix it or give a plain "
                                    "text line") from None
        if obj is None or isinstance(obj, (bool, int, float)):  # a text line that happens to parse ("42", "null")
            obj = line.strip()
        if isinstance(obj, str):
            obj = {"prompt": obj}
        if isinstance(obj, dict) and "messages" in obj:
            obj = _from_chat(obj, f"{path}:{i + 1}")
        if not isinstance(obj, dict) or "prompt" not in obj:
            near = difflib.get_close_matches("prompt", list(obj), n=1, cutoff=0.6) if isinstance(obj, dict) else []
            near += difflib.get_close_matches("messages", list(obj), n=1, cutoff=0.6) if isinstance(obj, dict) else []
            raise DataFileError(f"{path}:{i + 1}: expected a JSON object with a \"prompt\" (text or a list of chat "
                                "messages) or \"messages\" (a chat, as fine-tuning files hold it), a JSON string, or "
                                "a plain text line" + (f"; it has {near[0]!r}: did you mean \"prompt\" or "
                                                       "\"messages\"?" if near else ""))
        extra = {k: obj.pop(k) for k in list(obj) if k not in FIELDS}
        if extra:  # a metadata column (a source, a category): kept beside the item, for --rows-json
            obj["meta"] = {k: v if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(v)
                           for k, v in extra.items()}
            extras.update(extra)
        p = obj["prompt"]
        if isinstance(p, str):
            if not p.strip():
                raise DataFileError(f"{path}:{i + 1}: empty prompt")
        elif isinstance(p, list):
            obj["prompt"] = p = _as_chat_api_reads(p, f"{path}:{i + 1}")
            try:
                check_messages(p)
            except InvalidRequest as e:
                raise DataFileError(f"{path}:{i + 1}: {e}") from None
        else:
            raise DataFileError(f"{path}:{i + 1}: \"prompt\" must be text or a list of chat messages "
                                f"({{\"role\", \"content\"}} objects), not {_json_type(p)}")
        for k in ("answer", "continuation", "id"):
            if k in obj and obj[k] is None:  # null: not given
                del obj[k]
            elif k == "id" and type(obj.get(k)) is int:  # numbered records
                obj[k] = str(obj[k])
            elif k in obj and not isinstance(obj[k], str):
                want = "text or a whole number" if k == "id" else "text"
                raise DataFileError(f"{path}:{i + 1}: \"{k}\" must be {want}, not {_json_type(obj[k])}")
        out.append((i, obj))
    if not out:
        raise DataFileError(f"{path}: no prompts found")
    if extras and str(path) not in _WARNED:
        _WARNED.add(str(path))
        log.warning("%s: fields %s are not prompt, answer, continuation or id: kept as each row's metadata (scd eval "
                    "--rows-json writes them beside its scores), not used", path, sorted(extras))
    return out


def _as_chat_api_reads(messages: list, where: str) -> list:
    """Messages as the producer's chat API reads them: content given as a list of text parts is
    their text, joined; null content is empty; the ``developer`` role is ``system`` (OpenAI's
    newer name for it). A part of another type (an image) is refused: prompts are text."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict):
            m = dict(m)
            content = m.get("content")
            if content is None and "content" in m:
                m["content"] = ""
            elif isinstance(content, list):
                for j, part in enumerate(content):
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind != "text" or not isinstance(part.get("text"), str):
                        what = f"a {kind!r} part" if kind and kind != "text" else "not a text part"
                        raise DataFileError(f"{where}: message {i} content part {j} is {what}; prompts are text "
                                            "(parts of {\"type\": \"text\", \"text\": ...})")
                m["content"] = "".join(part["text"] for part in content)
            if m.get("role") == "developer":
                m["role"] = "system"
        out.append(m)
    return out


def _from_chat(obj: dict, where: str) -> dict:
    """A record of a chat fine-tuning file (``{"messages": [...]}``, OpenAI's format): the messages
    before the last assistant message are the prompt, and that message is its answer; a chat that
    does not end with the assistant is all prompt."""
    if "prompt" in obj:
        raise DataFileError(f"{where}: give \"prompt\" or \"messages\", not both")
    msgs = obj.pop("messages")
    if not isinstance(msgs, list) or not msgs:
        raise DataFileError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    msgs = _as_chat_api_reads(msgs, where)
    last = msgs[-1]
    if isinstance(last, dict) and last.get("role") == "assistant":
        if "answer" in obj:
            raise DataFileError(f"{where}: the chat ends with the assistant's message, which is the answer; leave "
                                "\"answer\" out or end the chat with the user's message")
        if not isinstance(last.get("content"), str):
            raise DataFileError(f"{where}: message {len(msgs) - 1} (the assistant's answer) must have string "
                                "\"content\"")
        obj["answer"], msgs = last["content"], msgs[:-1]
        if not msgs:
            raise DataFileError(f"{where}: the chat is only the assistant's answer; it needs a message before it")
    obj["prompt"] = msgs
    return obj


def _json_type(value) -> str:
    """How a JSON value reads in a message: 'a number', 'an object'..."""
    for types, name in ((bool, "true or false"), ((int, float), "a number"), (dict, "an object"), (list, "a list"),
                        (str, "text")):
        if isinstance(value, types):
            return name
    return "null"


def _content(obj: dict) -> str:
    return json.dumps([obj["prompt"], obj.get("answer", ""), obj.get("continuation", "")], sort_keys=True)


def split_of(obj: dict, seed: int = SPLIT_SEED) -> Split:
    """The split a prompt falls into: a seeded hash of its content (prompt, answer, continuation)."""
    u = int.from_bytes(hashlib.sha256(f"{seed}:{_content(obj)}".encode()).digest()[:8], "big") / 2**64
    edge = 0.0
    for split in SPLITS:
        edge += SPLIT_FRACTIONS[split]
        if u < edge:
            return split
    return SPLITS[-1]


def file_hash(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load(path: str | Path, fmt: PromptFormat, split: Split | None = None, n: int | None = None,
         max_tokens: int | None = None, seed: int = SPLIT_SEED) -> list[Item]:
    """The file's prompts of ``split`` (all with None), encoded with the pair's prompt format, in
    file order. Prompts longer than ``max_tokens`` are refused with their line number."""
    path = Path(path)
    items = []
    for i, obj in _records(path):
        if split is not None and split_of(obj, seed) != split:
            continue
        ids, pre = _encode(path, i, obj, fmt, max_tokens)
        cont = obj.get("continuation", "")
        items.append(Item(id=obj.get("id") or f"{path.stem}-{i + 1:05d}", kind="user", prompt_ids=ids, prefix_len=pre,
                          answer=obj.get("answer", ""), prompt=obj["prompt"], continuation=cont,
                          continuation_ids=fmt._ids(cont) if cont else [], meta=obj.get("meta", {})))
        if n is not None and len(items) >= n:
            break
    if not items:
        raise empty_split(path, split, counts(path, seed))  # type: ignore[arg-type]  # all: the file has a record
    return items


def _encode(path: Path, i: int, obj: dict, fmt: PromptFormat, max_tokens: int | None) -> tuple[list[int], int]:
    """Line ``i``'s prompt encoded with the pair's prompt format; what the format refuses (its chat
    template: "Conversation roles must alternate", "System role not supported"), too few tokens or
    too many, a ``DataFileError`` naming the file and line."""
    try:
        ids, pre = fmt.encode(obj["prompt"])
    except InvalidRequest as e:
        raise DataFileError(f"{path}:{i + 1}: {e}") from None
    if len(ids) < 2:
        raise DataFileError(f"{path}:{i + 1}: the prompt encodes to {len(ids)} token(s); at least 2 are needed")
    if max_tokens is not None and len(ids) > max_tokens:
        raise DataFileError(f"{path}:{i + 1}: the prompt has {len(ids)} tokens; the limit is {max_tokens} (the "
                            "model's context); shorten it")
    return ids, pre


def counts(path: str | Path, seed: int = SPLIT_SEED, fmt: PromptFormat | None = None,
           max_tokens: int | None = None) -> dict[str, int]:
    """How many prompts each split of the file holds. With the pair's prompt format ``fmt`` (its
    tokenizer loads in a moment, before the models), every line is also encoded as ``load`` will
    encode it, whatever its split: a line the chat template refuses, or one too long for
    ``max_tokens``, fails here with its line number, not after the models load."""
    path = Path(path)
    out = {s: 0 for s in SPLITS}
    for i, obj in _records(path):
        if fmt is not None:
            _encode(path, i, obj, fmt, max_tokens)
        out[split_of(obj, seed)] += 1
    return out


def _repeats(path: str | Path) -> str:
    """What a split's size message adds when lines repeat: copies of a prompt all fall in its split."""
    seen: set[str] = set()
    n = 0
    for _, obj in _records(Path(path)):
        key = _content(obj)
        n += key in seen
        seen.add(key)
    return (f"; {n} of its lines repeat an earlier line, and a prompt's copies all fall in the same split: "
            "they add no prompt to another split") if n else ""


def empty_split(path: str | Path, split: Split, split_counts: dict[str, int]) -> DataFileError:
    return DataFileError(f"{path}: no prompts in the {split} split (splits: {split_counts}); the split takes about "
                         f"{SPLIT_FRACTIONS[split]:.0%} of the lines by a hash of each prompt: add prompts"
                         + _repeats(path))


def few_prompts(path: str | Path, split_counts: dict[str, int], needed: tuple[str, ...]) -> str | None:
    """A warning when a split a command uses holds fewer prompts than ``FEW`` asks (it still runs)."""
    small = [s for s in needed if 0 < split_counts[s] < FEW[s]]
    if not small:
        return None
    said = "; ".join(f"{split_counts[s]} in the {s} split ({SPLIT_ROLE[s]}; {FEW[s]}+ recommended)" for s in small)
    shares = ", ".join(f"{k} {v:.0%}" for k, v in SPLIT_FRACTIONS.items())
    return (f"warning: {path} has few prompts: {said}. The results will be noisy: add prompts (of the lines, {shares})"
            + _repeats(path))
