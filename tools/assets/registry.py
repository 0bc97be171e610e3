"""The pair registry: which producer and consumer folders make each named pair.

One small typed JSON file, ``$SCD_HOME/pairs.json`` (``SCD_PAIRS`` names another file, e.g. a
mounted one in a container). A pair is a producer folder and a consumer given either as a folder
or as a LoRA adapter folder merged into the producer at load. Registration checks, before any
weight is loaded, that both sides are the same architecture (family, layers, heads, widths), that
their tokenizers share one vocabulary, that the family is supported and that the weights are
safetensors; it then records both weights fingerprints, so a later change of a folder is noticed.
The built-in pairs (``strong``, ``mild``) are ordinary entries that ``scd assets`` registers.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import re
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.config import field_errors
from shared.errors import ConfigError, NotFound
from shared.paths import STORE_DIR, profile_path, scd_home

FORMAT_VERSION = 1
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
# what must be equal on both sides of a pair, as (config attribute, what to call it)
LAYOUT_FIELDS = (("num_hidden_layers", "layer count"), ("num_attention_heads", "attention heads"),
                 ("num_key_value_heads", "KV heads"), ("head_dim", "head dim"), ("hidden_size", "hidden size"),
                 ("vocab_size", "vocabulary size"))


class RegistryError(ConfigError):
    """A registration that cannot be accepted; the message names the field or folder at fault."""


class UsersPair(RegistryError):
    """A pair the user registered under a built-in pair's name (`scd assets` leaves it as it is)."""


class PairEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    producer: str
    """The producer's (base model's) folder, absolute."""
    consumer: str | None = None
    """The consumer's folder, absolute; None when the consumer is ``consumer_adapter`` on the producer."""
    consumer_adapter: str | None = None
    """A LoRA adapter folder merged into the producer's weights at load."""
    tokenizer: str
    """The folder whose tokenizer and chat template format this pair's prompts (the consumer's when it
    has one: it is the model that answers)."""
    store: str | None = None
    """The artifact store this pair's calibration artifacts and profiles are written to and read from;
    None (the built-in pairs): the committed store of the running checkout, wherever it is cloned."""
    builtin: bool = False
    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    dtype: str
    """The dtype the weights are stored in (config.json); services load in the dtype their settings say."""
    producer_fingerprint: str
    consumer_fingerprint: str
    weights_stat: dict[str, list[int]] = {}
    """size and mtime of every weight file when fingerprinted: a changed file is fingerprinted again."""
    registered_at: str = ""

    def store_dir(self) -> Path:
        return Path(self.store) if self.store else default_store(builtin=True)

    def consumer_model(self) -> tuple[str, str | None]:
        """(folder, adapter) to load the consumer from."""
        return (self.consumer, None) if self.consumer else (self.producer, self.consumer_adapter)


class Registry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format_version: int = FORMAT_VERSION
    pairs: dict[str, PairEntry] = Field(default_factory=dict)


def registry_path() -> Path:
    return Path(os.environ["SCD_PAIRS"]).expanduser() if os.environ.get("SCD_PAIRS") else scd_home() / "pairs.json"


def default_store(builtin: bool = False) -> Path:
    """``SCD_STORE`` if set; else the repository's committed store for the built-in pairs and
    ``$SCD_HOME/store`` for pairs an operator registers."""
    if os.environ.get("SCD_STORE"):
        return Path(os.environ["SCD_STORE"]).expanduser()
    return STORE_DIR if builtin else scd_home() / "store"


def _store_setting(store: str | Path | None, builtin: bool) -> str | None:
    if store:
        path = Path(store).expanduser().resolve()
    elif builtin and not os.environ.get("SCD_STORE"):
        return None  # resolved at use: the checkout's committed store
    else:
        path = default_store(builtin)
    above = next(p for p in (path, *path.parents) if p.exists())  # the store is made at its first save
    if not above.is_dir():
        raise RegistryError(f"the artifact store {path} {'is' if above == path else f'is under {above},'} a file; "
                            "it names a folder (--store or SCD_STORE)")
    return str(path)


def load() -> Registry:
    path = registry_path()
    if not path.exists():
        return Registry()
    if path.is_dir():
        raise RegistryError(f"pair registry {path} is a folder; SCD_PAIRS names the registry's file (e.g. "
                            f"{path / 'pairs.json'})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RegistryError(f"pair registry {path} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    try:
        reg = Registry.model_validate_json(text)
    except ValidationError as e:
        said = "; ".join(field_errors(e))
        said = said if len(said) <= 300 else said[:300] + "..."
        raise RegistryError(f"pair registry {path} cannot be read ({said}); fix or delete it "
                            "(then `scd assets` and `scd pair add` register the pairs again)") from None
    if reg.format_version != FORMAT_VERSION:
        raise RegistryError(f"pair registry {path} has format {reg.format_version}; this build reads {FORMAT_VERSION}")
    return reg


@contextlib.contextmanager
def _locked():
    """Read-modify-write under an exclusive lock; the file is replaced atomically."""
    path = registry_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "w")
    except OSError as e:
        raise RegistryError(f"cannot write the pair registry {path}: {e.strerror or e}; set SCD_HOME (or SCD_PAIRS) "
                            "to a writable place") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        reg = load()
        yield reg
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(reg.model_dump_json(indent=2) + "\n")
        os.replace(tmp, path)


def get(name: str) -> PairEntry:
    from tools.assets.models import PAIRS

    reg = load()
    if name not in reg.pairs:
        known = sorted(reg.pairs)
        hint = f"run `scd assets --pair {name}` (or `scd assets`: all built-in pairs)" if name in PAIRS else \
            "register it with `scd pair add NAME --producer DIR --consumer DIR` (or --consumer-adapter DIR)"
        raise NotFound(f"unknown pair {name!r} (registered: {known or 'none'}; registry {registry_path()}): {hint}")
    return reg.pairs[name]


def names() -> list[str]:
    return sorted(load().pairs)


def remove(name: str) -> PairEntry:
    with _locked() as reg:
        if name not in reg.pairs:
            raise NotFound(f"unknown pair {name!r}; registered: {sorted(reg.pairs) or 'none'}")
        return reg.pairs.pop(name)


# ---------------------------------------------------------------------------------- validation
def _layout(cfg) -> dict[str, int]:
    out = {}
    for key, _ in LAYOUT_FIELDS:
        v = getattr(cfg, key, None)
        if key == "head_dim" and not v:
            v = cfg.hidden_size // cfg.num_attention_heads
        out[key] = int(v)
    return out


def _check_adapter_fits(adapter: Path, producer: Path) -> None:
    """Every LoRA tensor targets a weight the producer has, with matching widths, and there is at
    least one (read from the safetensors headers: nothing is loaded)."""
    from shared.model.loading import model_shapes, tensor_shapes

    base = model_shapes(producer)
    lora, targets, ranks = 0, [], {}
    for k, shape in tensor_shapes([adapter / "adapter_model.safetensors"]).items():
        m = re.match(r"^(?:base_model\.model\.)?(.*)\.lora_([AB])(?:\.[^.]+)?\.weight$", k)
        if not m:
            continue
        lora += 1
        targets.append(m.group(1))
        ranks.setdefault(m.group(1), {})[m.group(2)] = shape[0] if m.group(2) == "A" else shape[-1]
        target = m.group(1) + ".weight"
        if target not in base:
            raise RegistryError(f"adapter {adapter} targets {m.group(1)!r}, which the producer in {producer} does "
                                "not have: the adapter was trained on another base model")
        out_f, in_f = base[target][0], base[target][-1]
        if (m.group(2) == "A" and shape[-1] != in_f) or (m.group(2) == "B" and shape[0] != out_f):
            raise RegistryError(f"adapter {adapter} tensor {k} has shape {shape}, which does not fit "
                                f"{target} {base[target]} of the producer: another base model")
    if not lora:
        raise RegistryError(f"adapter {adapter} holds no LoRA tensors (names ending in lora_A/lora_B.weight): "
                            "give a peft LoRA adapter saved with PeftModel.save_pretrained")
    _check_adapter_ranks(adapter, ranks)
    _check_adapter_layers(adapter, base, targets)


def _check_adapter_ranks(adapter: Path, ranks: dict[str, dict[str, int]]) -> None:
    """Each module's lora_A and lora_B share the config's rank ``r`` (unless a ``rank_pattern`` gives its own), and
    ``r``, ``lora_alpha`` are numbers: peft refuses anything else at every load, dumping each mismatched tensor."""
    from shared.model.loading import read_json

    cfg = read_json(adapter / "adapter_config.json", "adapter config")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if type(r) is not int or r < 1:
        raise RegistryError(f"adapter {adapter}: adapter_config.json r={r!r}; LoRA's rank is a positive integer")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))):
        raise RegistryError(f"adapter {adapter}: adapter_config.json lora_alpha={alpha!r}; it must be a number")
    for module, ab in sorted(ranks.items()):
        if set(ab) != {"A", "B"} or ab["A"] != ab["B"]:
            raise RegistryError(f"adapter {adapter}: {module} has lora_A of rank {ab.get('A', 'none')} and lora_B of "
                                f"rank {ab.get('B', 'none')}; they must be one rank: the adapter's files are damaged "
                                "or mixed from two adapters")
        if not cfg.get("rank_pattern") and ab["A"] != r:
            raise RegistryError(f"adapter {adapter}: {module} has rank {ab['A']} but adapter_config.json says r={r}; "
                                "the config and the weights are from different adapters")


def _check_adapter_layers(adapter: Path, base: dict[str, list[int]], targets: list[str]) -> None:
    """An adapter adapts each module it targets in every layer of the base (or in those its
    ``layers_to_transform`` names): one trained on a shallower base fits a deeper one tensor by tensor,
    and peft would leave the layers it lacks as they are, without a word."""
    from shared.model.loading import read_json

    cfg = read_json(adapter / "adapter_config.json", "adapter config")
    if cfg.get("exclude_modules") or isinstance(cfg.get("target_modules"), str):
        return  # modules chosen by a pattern: which layers they cover is the adapter's choice
    chosen = cfg.get("layers_to_transform")
    if isinstance(chosen, int) and not isinstance(chosen, bool):
        chosen = [chosen]
    if chosen is not None and not (isinstance(chosen, list) and all(type(i) is int for i in chosen)):
        return  # peft refuses it itself at load
    layer = re.compile(r"^(.*\.layers\.)(\d+)(\..*)$")
    have: dict[tuple[str, str], set[int]] = {}
    for t in targets:
        if m := layer.match(t):
            have.setdefault((m.group(1), m.group(3)), set()).add(int(m.group(2)))
    for (head, tail), layers in sorted(have.items()):
        if chosen is not None:
            want = set(chosen)
            if layers != want:
                raise RegistryError(f"adapter {adapter} adapts {tail[1:]} in layers {sorted(layers)}, but its "
                                    f"adapter_config.json's layers_to_transform names {sorted(want)}: save the "
                                    "adapter again")
            continue
        want = {int(m.group(2)) for name in base if name.endswith(".weight")
                and (m := layer.match(name[:-len(".weight")])) and (m.group(1), m.group(3)) == (head, tail)}
        if layers != want:
            raise RegistryError(f"adapter {adapter} adapts {tail[1:]} in {len(layers)} of the producer's {len(want)} "
                                f"layers (not layer {min(want - layers)}), and its adapter_config.json limits no "
                                "layers_to_transform: it was trained on a base model with fewer layers, not this "
                                "producer")


def _check_weights_match(producer: Path, consumer: Path, tied: bool) -> None:
    """The consumer's stored weights have the producer's tensors, each of the same shape (headers
    only): a config that agrees over weights that do not (pruned, resized, another model) is
    refused here, not at load."""
    from shared.model.loading import model_shapes

    p, c = model_shapes(producer), model_shapes(consumer)
    for name, shape in sorted(p.items()):
        if name not in c:
            if tied and name == "lm_head.weight":  # stored once, in the embedding, by either side
                continue
            raise RegistryError(f"consumer weights in {consumer} have no tensor {name!r}, which the producer's "
                                "have: a pair is a base model and a full fine-tune of it (or give --consumer-adapter)")
        if c[name] != shape:
            raise RegistryError(f"consumer tensor {name!r} has shape {c[name]}, the producer's {shape}: a pair must "
                                "share the architecture")


def _vocab_difference(a, b) -> str | None:
    va, vb = a.get_vocab(), b.get_vocab()
    if va == vb:
        return None
    only_a, only_b = set(va) - set(vb), set(vb) - set(va)
    moved = [t for t in set(va) & set(vb) if va[t] != vb[t]]
    parts = []
    if only_a or only_b:
        parts.append(f"{len(only_a)} tokens only in the producer's, {len(only_b)} only in the consumer's")
    if moved:
        t = sorted(moved)[0]
        parts.append(f"{len(moved)} tokens with other ids (e.g. {t!r}: {va[t]} vs {vb[t]})")
    return "; ".join(parts)


def check_pair(producer: str | Path, consumer: str | Path | None = None,
               adapter: str | Path | None = None) -> dict:
    """Check a would-be pair without loading weights. Returns the layout and the tokenizer folder;
    raises RegistryError (or ModelFolderError/UnsupportedModel) naming the first problem."""
    from shared.model.loading import check_adapter_folder, check_weights, has_tokenizer, load_tokenizer, read_config

    if (consumer is None) == (adapter is None):
        raise RegistryError("give the consumer as exactly one of --consumer DIR or --consumer-adapter DIR")
    producer = Path(producer).expanduser().resolve()
    pcfg = read_config(producer, "producer")
    check_weights(producer, pcfg, "producer")
    if consumer is not None:
        consumer = Path(consumer).expanduser().resolve()
        ccfg = read_config(consumer, "consumer")
        check_weights(consumer, ccfg, "consumer")
        if ccfg.model_type != pcfg.model_type:
            raise RegistryError(f"architecture family differs: producer {pcfg.model_type!r}, consumer "
                                f"{ccfg.model_type!r}; a pair is a base model and a fine-tune of it")
        pl, cl = _layout(pcfg), _layout(ccfg)
        for key, label in LAYOUT_FIELDS:
            if pl[key] != cl[key]:
                raise RegistryError(f"{label} differs: producer {pl[key]}, consumer {cl[key]} (config.json {key}); a "
                                    "pair must share the architecture")
        _check_weights_match(producer, consumer, bool(getattr(ccfg, "tie_word_embeddings", False)))
    else:
        adapter = check_adapter_folder(Path(adapter).expanduser().resolve())
        _check_adapter_fits(adapter, producer)
    if not has_tokenizer(producer):
        raise RegistryError(f"producer folder {producer} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    side = consumer if consumer is not None else adapter
    tok_dir = side if has_tokenizer(side) else producer
    from shared.model.prompt import PromptFormat

    tok = load_tokenizer(tok_dir)  # a damaged tokenizer or chat template is refused now, not at every later command
    PromptFormat(tok)
    if tok_dir != producer:
        diff = _vocab_difference(load_tokenizer(producer), tok)
        if diff:
            raise RegistryError(f"tokenizer vocabularies differ ({diff}): the consumer must read the producer's token "
                                "ids")
    return {"layout": _layout(pcfg), "model_type": pcfg.model_type, "tokenizer": str(tok_dir),
            "dtype": str(getattr(pcfg, "dtype", None) or getattr(pcfg, "torch_dtype", None) or "float32")
            .replace("torch.", ""), "producer": str(producer), "consumer": str(consumer) if consumer else None,
            "adapter": str(adapter) if adapter else None}


def _stat(*folders: str | None) -> dict[str, list[int]]:
    out = {}
    for folder in filter(None, folders):
        for f in sorted(Path(folder).glob("*.safetensors")):
            st = f.stat()
            out[str(f)] = [st.st_size, st.st_mtime_ns]
    return out


def _check_builtin_name(name: str, builtin: bool, old: PairEntry | None) -> None:
    """The built-in pairs' names are theirs: `scd assets` (which `make demo` and `make test` run)
    registers them again, and replaced a pair of the user's of the same name without a word; it
    now leaves such a pair (registered before names were reserved) as it is and says so."""
    from tools.assets.models import PAIRS

    if name not in PAIRS:
        return
    if not builtin:
        raise RegistryError(f"pair name {name!r} is a built-in pair's (`scd assets` registers {', '.join(PAIRS)}); "
                            "choose another name")
    if old is not None and not old.builtin:
        raise UsersPair(f"pair {name!r} in {registry_path()} is one you registered ({old.producer} -> "
                            f"{old.consumer or old.consumer_adapter}), not the built-in pair, and was left as it is; "
                            f"register yours under another name (`scd pair remove {name}`, then `scd pair add "
                            f"NEW ...`) and run `scd assets` again")


def add(name: str, producer: str | Path, consumer: str | Path | None = None, adapter: str | Path | None = None,
        store: str | Path | None = None, builtin: bool = False, replace: bool = False) -> PairEntry:
    """Validate and register a pair (``replace`` overwrites an entry of the same name). Weights are
    fingerprinted from their files; an unchanged re-registration reuses the recorded fingerprints."""
    from shared.model.loading import folder_fingerprint

    if not NAME_RE.match(name):
        raise RegistryError(f"pair name {name!r} must be 1-63 characters of a-z, 0-9, '.', '_', '-', starting with a "
                            "letter or digit (it names folders and the consumer)")
    old = load().pairs.get(name)
    _check_builtin_name(name, builtin, old)
    info = check_pair(producer, consumer, adapter)
    stat = _stat(info["producer"], info["consumer"], info["adapter"])
    same = old is not None and (old.producer, old.consumer, old.consumer_adapter) == \
        (info["producer"], info["consumer"], info["adapter"])
    if old is not None and not replace and not same:
        raise RegistryError(f"pair {name!r} is already registered ({old.producer} -> "
                            f"{old.consumer or old.consumer_adapter}); remove it first or pass --replace")
    if same and old.weights_stat == stat:
        pfp, cfp = old.producer_fingerprint, old.consumer_fingerprint
    else:
        pfp = folder_fingerprint(info["producer"])
        cfp = folder_fingerprint(info["consumer"]) if info["consumer"] else folder_fingerprint(info["producer"],
                                                                                              info["adapter"])
    lay = info["layout"]
    entry = PairEntry(
        name=name, producer=info["producer"], consumer=info["consumer"], consumer_adapter=info["adapter"],
        tokenizer=info["tokenizer"], store=_store_setting(store, builtin),
        builtin=builtin, model_type=info["model_type"], n_layers=lay["num_hidden_layers"],
        n_heads=lay["num_attention_heads"], n_kv_heads=lay["num_key_value_heads"], head_dim=lay["head_dim"],
        hidden_size=lay["hidden_size"], vocab_size=lay["vocab_size"], dtype=info["dtype"],
        producer_fingerprint=pfp, consumer_fingerprint=cfp, weights_stat=stat,
        registered_at=old.registered_at if same and old.registered_at else
        dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    with _locked() as reg:
        reg.pairs[name] = entry
    return entry


def json_object(path: Path) -> dict | None:
    """A stored JSON object, or None when the file does not read as one (to report, not to fail on)."""
    try:
        body = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


PROFILE_KINDS = ("spectrum", "droidspeak", "ridge", "auto")
"""The profiles a pair may have beside its SCD artifacts (``<store>/<pair>.<kind>.json``): the
baselines' and ``auto``'s operating table; ``shared.engine.PROFILE_KINDS``, without importing the
models' code (``scd pair list`` stays quick)."""


def profile_files(store: str | Path, name: str) -> dict[str, Path]:
    """The profiles the store holds for pair ``name``, by kind (in kind order): only
    ``<store>/<name>.<kind>.json`` of a known kind, never another pair's whose name starts with
    ``<name>.`` (a glob of ``<name>.*.json`` took pair ``a.b``'s ``a.b.spectrum.json`` for pair ``a``'s)."""
    store = Path(store)
    paths = {kind: profile_path(store, name, kind) for kind in sorted(PROFILE_KINDS)}
    return {kind: p for kind, p in paths.items() if p.exists()}


def stored(entry: PairEntry, store: str | Path | None = None) -> dict:
    """What the store holds for the pair: SCD artifacts and each baseline's profile, and whether
    each is pinned to the registered weights."""
    store = Path(store) if store else entry.store_dir()
    out: dict = {}
    meta = store / entry.name / "meta.json"
    if meta.exists():
        m = json_object(meta)
        out["scd"] = {"path": str(meta.parent), "pinned": False, "unreadable": True} if m is None else {
            "path": str(meta.parent), "patch_layers": m.get("patch_layers"), "patch_blocks": m.get("patch_blocks"),
            "pinned": m.get("producer_fingerprint") == entry.producer_fingerprint and
            m.get("consumer_fingerprint") == entry.consumer_fingerprint}
    for kind, f in profile_files(store, entry.name).items():
        body = json_object(f)
        if body is None:
            out[kind] = {"path": str(f), "pinned": False, "unreadable": True}
            continue
        out[kind] = {"path": str(f), "pinned": body.get("producer_fingerprint") == entry.producer_fingerprint and
                     body.get("consumer_fingerprint") == entry.consumer_fingerprint}
    return out


def calibrate_hint(name: str = "NAME") -> str:
    """The commands that make a pair's SCD artifacts and each profile."""
    return (f"run `scd calibrate --pair {name}` (scd, scd-reuse) or with `--method KIND` (droidspeak, ridge, "
            "spectrum, auto)")


def uncalibrated(kinds, store: str | Path, name: str) -> list[str]:
    """Those of the method ``kinds`` whose SCD artifacts (``<store>/<name>/meta.json``) or profile
    (``<store>/<name>.<kind>.json``; ``auto``'s operating table too) the store lacks for pair ``name``."""
    from shared.codecs import requires

    folder = Path(store) / name

    def has(kind: str) -> bool:
        needs = requires(kind)
        return (("artifacts" not in needs or (folder / "meta.json").exists())
                and ("profile" not in needs or profile_path(folder.parent, name, kind).exists()))

    return [k for k in kinds if not has(k)]


def calibration_missing(kinds, store: str | Path, name: str) -> str | None:
    """What to tell of the ``--methods`` whose calibration the store lacks for pair ``name`` (the
    commands check before any model loads or service starts); None when it has all of them."""
    missing = uncalibrated(kinds, store, name)
    if not missing:
        return None
    return (f"--methods: {', '.join(missing)} need(s) the pair's calibration, which {store} lacks for {name!r}: "
            f"{calibrate_hint(name)}, or leave them out of --methods")
