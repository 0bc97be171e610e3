"""Loading an operator's model folders: a Hugging Face folder (``config.json`` + safetensors
weights + tokenizer), optionally with a LoRA adapter folder merged into it at load (peft).

Every check happens before a weight is read, and every refusal names the folder and what to do:
a missing folder, an unsupported family, pickle-only weights (never unpickled: ``use_safetensors``),
an adapter without safetensors weights or that is not LoRA, a config or weights file that does not
parse, and a config whose weights are not all stored or not of its shapes (from the safetensors
headers against the model built on the meta device). The weights fingerprint is computed from the stored
tensors, so it does not depend on the dtype or device a service loads them in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from contextlib import contextmanager
from pathlib import Path

import torch

from shared.errors import ConfigError
from shared.model.hf_adapter import check_supported

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# adapter_config.json fields that say where the adapter came from, not what it computes
_ADAPTER_META_KEYS = {"base_model_name_or_path", "revision", "inference_mode", "peft_version", "auto_mapping",
                      "task_type"}


_HARMLESS_EXTRA = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")  # buffers older saves stored


class ModelFolderError(ConfigError):
    """A model or adapter folder that cannot be loaded as given (the message says why and what to do)."""


def _hint(path: Path) -> str:
    from shared.paths import models_dir

    try:
        path.resolve().relative_to(models_dir().resolve())
        return "; run `scd assets` to prepare the built-in models"
    except ValueError:
        return ""


def _safetensors(path: Path, stem: str) -> list[Path]:
    return sorted(p for p in path.glob("*.safetensors") if p.name.startswith(stem))


def weight_files(path: str | Path, what: str = "model") -> list[Path]:
    """The safetensors files transformers loads from a model folder: ``model.safetensors``, or else the
    shards that ``model.safetensors.index.json`` names ([] when neither is there). A folder that holds
    both (transformers would load ``model.safetensors`` and ignore the shards) or whose index names a
    file that is not there is a ModelFolderError naming it."""
    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if not index.exists():
        return [single] if single.exists() else []
    if single.exists():
        raise ModelFolderError(f"{what} folder {path} holds both model.safetensors and the shards of "
                               "model.safetensors.index.json; transformers would load model.safetensors and ignore "
                               "the shards. Remove whichever is stale")
    weight_map = read_json(index, "weights index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelFolderError(f"weights index {index} has no weight_map of tensor names to shard files; save the "
                               "model again")
    names = sorted(set(weight_map.values()))
    outside = [n for n in names if Path(n).name != n or not n.endswith(".safetensors")]
    if outside:
        raise ModelFolderError(f"weights index {index} names {outside[0]!r}: a shard is a .safetensors file in the "
                               "same folder; save the model again")
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise ModelFolderError(f"{what} folder {path}: {len(missing)} of the {len(names)} shards its "
                               f"model.safetensors.index.json names are not there ({', '.join(missing[:3])}); copy "
                               "the whole folder again")
    return [path / n for n in names]


def read_json(path: Path, what: str) -> dict:
    """A JSON object from ``path`` (a model's or adapter's config); ModelFolderError if it does not parse."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFolderError(f"{what} {path} is not valid JSON ({e}); fix it or save the folder again") from None
    if not isinstance(obj, dict):
        raise ModelFolderError(f"{what} {path} must hold a JSON object, not {type(obj).__name__}")
    return obj


@contextmanager
def open_safetensors(path: Path):
    """``safe_open`` of a weights file; a file whose header does not parse (truncated, corrupt, not
    safetensors) is a ModelFolderError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        sf = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ModelFolderError(f"weights file {path} is not a readable safetensors file ({e}); copy or save it "
                               "again") from None
    with sf:
        yield sf


def tensor_shapes(files: list[Path]) -> dict[str, list[int]]:
    """Every stored tensor's name and shape, from the safetensors headers (nothing is loaded)."""
    out: dict[str, list[int]] = {}
    for f in files:
        with open_safetensors(f) as sf:
            out.update({k: list(sf.get_slice(k).get_shape()) for k in sf.keys()})
    return out


def model_shapes(path: str | Path) -> dict[str, list[int]]:
    """``tensor_shapes`` of a model folder's weight files (those transformers loads)."""
    return tensor_shapes(weight_files(path))


def check_model_folder(path: str | Path, what: str = "model") -> Path:
    """A folder that holds a supported model as safetensors; raises ModelFolderError otherwise."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelFolderError(f"{what} folder {path} does not exist{_hint(path)}")
    if not path.is_dir():
        raise ModelFolderError(f"{what} path {path} is not a folder; give a Hugging Face model folder")
    if not (path / "config.json").exists():
        raise ModelFolderError(f"{what} folder {path} has no config.json; give a Hugging Face model folder "
                               "(save_pretrained)" + _hint(path))
    if not weight_files(path, what):
        others = _safetensors(path, "model")
        if others:
            shards = any(re.fullmatch(r"model-\d+-of-\d+\.safetensors", p.name) for p in others)
            raise ModelFolderError(
                f"{what} folder {path} has {', '.join(p.name for p in others[:3])} but "
                + ("no model.safetensors.index.json, which says which shard holds which weight; copy it from where "
                   "the model was saved" if shards else "no model.safetensors (or model.safetensors.index.json), "
                   "the names transformers loads; rename the file or save the model again"))
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ModelFolderError(
                f"{what} folder {path} holds only pickled weights ({', '.join(pickles[:3])}); they are never "
                "unpickled here. Convert them once to safetensors, e.g. `AutoModelForCausalLM.from_pretrained(dir)"
                ".save_pretrained(new_dir)` in a trusted environment")
        raise ModelFolderError(f"{what} folder {path} has no model*.safetensors weights")
    return path


def read_config(path: str | Path, what: str = "model"):
    """The folder's transformers config, after checking the folder and that its family is supported."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    path = check_model_folder(path, what)
    raw = read_json(path / "config.json", f"{what} config")
    model_type = raw.get("model_type")
    if not model_type or not isinstance(model_type, str):
        raise ModelFolderError(f"{what} folder {path}: config.json has no model_type")
    check_supported(model_type)
    try:
        return AutoConfig.from_pretrained(path)
    except (StrictDataclassError, ValueError, TypeError, KeyError, OSError) as e:  # transformers validates configs
        cause = e.__cause__ if isinstance(e, StrictDataclassError) and e.__cause__ else e
        raise ModelFolderError(f"{what} folder {path}: config.json is not a valid {model_type} config ({cause}); fix "
                               "it or save the folder again") from None


def check_weights(path: str | Path, config, what: str = "model") -> None:
    """The folder's safetensors hold every parameter its config calls for, each of the shape the
    config gives (a model built on the meta device, against the files' headers: nothing is
    loaded). Otherwise transformers would refuse the load with a report, or initialise missing
    weights at random and serve them."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    stored = model_shapes(path)
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(config)
    prefix = f"{empty.base_model_prefix}."
    if stored and not any(k.startswith(prefix) for k in stored):  # saved from the bare model: no head, no prefix
        stored = {k if k.startswith("lm_head.") else prefix + k: v for k, v in stored.items()}
    missing, wrong = [], []
    params = dict(empty.named_parameters())  # tied weights once, under the name that is stored
    for name, p in params.items():
        if name not in stored:
            missing.append(name)
        elif list(p.shape) != stored[name]:
            wrong.append(f"{name} is {stored[name]}, the config gives {list(p.shape)}")
    every = set(empty.state_dict()) | {n for n, _ in empty.named_buffers()}  # tied names too
    extra = sorted(n for n in stored if n not in every and not n.endswith(_HARMLESS_EXTRA))
    if extra:  # e.g. a config that says fewer layers than were saved: a different model, same files
        raise ModelFolderError(f"{what} folder {path}: {len(extra)} stored weight(s) are not part of the model its "
                               f"config.json describes (e.g. {extra[0]}); the config and the weights must come from "
                               "the same save_pretrained")
    if wrong:
        raise ModelFolderError(f"{what} folder {path}: {len(wrong)} stored weight(s) do not have the shape its "
                               f"config.json gives (e.g. {wrong[0]}); the config and the weights must come from the "
                               "same save_pretrained")
    if missing:
        raise ModelFolderError(f"{what} folder {path}: {len(missing)} weight(s) its config.json calls for are not in "
                               f"its safetensors files (e.g. {missing[0]}); the config and the weights must come from "
                               "the same save_pretrained")


def check_adapter_folder(path: str | Path) -> Path:
    """A peft LoRA adapter folder with safetensors weights; raises ModelFolderError otherwise."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ModelFolderError(f"adapter folder {path} does not exist")
    if not (path / "adapter_config.json").exists():
        raise ModelFolderError(f"adapter folder {path} has no adapter_config.json; give a peft adapter folder "
                               "(PeftModel.save_pretrained)")
    if not (path / "adapter_model.safetensors").exists():
        if any((path / f"adapter_model{s}").exists() for s in PICKLE_SUFFIXES):
            raise ModelFolderError(f"adapter folder {path} holds only a pickled adapter_model.bin; it is never "
                                   "unpickled here. Save it again with safetensors (peft's default)")
        raise ModelFolderError(f"adapter folder {path} has no adapter_model.safetensors")
    cfg = read_json(path / "adapter_config.json", "adapter config")
    kind = cfg.get("peft_type")
    if not isinstance(kind, str) or kind.upper() != "LORA":
        got = "no peft_type" if kind is None else f"peft_type {kind!r}"
        raise ModelFolderError(f"adapter folder {path}: adapter_config.json has {got}; a consumer adapter must be a "
                               "peft LoRA adapter (peft_type \"LORA\", as LoraConfig saves it)")
    tensor_shapes([path / "adapter_model.safetensors"])  # its header parses
    return path


def _hash_tensors(h, files: list[Path]) -> None:
    from safetensors import SafetensorError

    named = []
    for f in files:
        with open_safetensors(f) as sf:
            named += [(k, f) for k in sf.keys()]
    for name, f in sorted(named):
        with open_safetensors(f) as sf:
            try:
                t = sf.get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise ModelFolderError(f"weights file {f}: tensor {name} does not read ({e}); copy or save the file "
                                       "again") from None
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def folder_fingerprint(path: str | Path, adapter: str | Path | None = None) -> str:
    """sha256 (16 hex digits) over the folder's stored weight tensors, name-sorted (and, for a
    consumer given as an adapter, over the adapter's tensors and settings too). Independent of the
    dtype and device the weights are later loaded in, and of how the weights are sharded."""
    h = hashlib.sha256()
    _hash_tensors(h, weight_files(path))
    if adapter is not None:
        adapter = Path(adapter)
        cfg = read_json(adapter / "adapter_config.json", "adapter config")
        h.update(b"|adapter|")
        h.update(json.dumps({k: v for k, v in cfg.items() if k not in _ADAPTER_META_KEYS}, sort_keys=True).encode())
        _hash_tensors(h, [adapter / "adapter_model.safetensors"])
    return h.hexdigest()[:16]


def _last_line(e: BaseException) -> str:
    """transformers' errors end with the sentence that says what failed (a report comes before it)."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else type(e).__name__


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device this process can use: ``cpu``, ``cuda`` or ``cuda:N``; anything else,
    or CUDA where this torch build or machine has none, is refused with what to set instead."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device {str(device)!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"device {str(device)!r}: only cpu and cuda devices are supported")
    if not torch.cuda.is_available():
        cuda = torch.version.cuda
        build = "a CPU-only build" if cuda is None else f"built for CUDA {cuda}, but no GPU is visible"
        raise ConfigError(f"device {str(device)!r}: this torch ({torch.__version__}) is {build}; use device cpu")
    n = torch.cuda.device_count()
    if dev.index is not None and dev.index >= n:
        raise ConfigError(f"device {str(device)!r}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return dev


def load_model(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
               adapter: str | Path | None = None, fingerprint: bool = True):
    """``from_pretrained`` of a checked folder (safetensors only), with ``adapter`` (a LoRA folder)
    merged into it, in eval mode on ``device``. The weights fingerprint is kept as
    ``model.scd_fingerprint`` (see ``shared.model.fingerprint``). A built-in model's folder that does
    not load (a weights file cut short, a config removed) says that `scd assets` makes it again."""
    path = Path(path).expanduser()
    try:
        return _load_model(path, device, dtype, adapter, fingerprint)
    except ModelFolderError as e:
        hint = _hint(path)
        if not hint or hint in str(e) or str(e).startswith("adapter "):  # the adapter, not the built-in model
            raise
        raise ModelFolderError(f"{e}{hint}") from None


def _load_model(path: Path, device: str, dtype: torch.dtype, adapter: str | Path | None, fingerprint: bool):
    from transformers import AutoModelForCausalLM

    dev = check_device(device)
    check_weights(path, read_config(path))
    if adapter is not None:
        adapter = check_adapter_folder(adapter)
    from safetensors import SafetensorError

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
    except (SafetensorError, OSError) as e:  # a weights file that changed since it was checked
        raise ModelFolderError(f"model folder {path}: the weights do not load ({e}); copy or save them again") from None
    except RuntimeError as e:  # transformers refuses weights whose shapes the config does not give
        raise ModelFolderError(f"model folder {path}: its weights do not match its config.json ({_last_line(e)}); "
                               "the config and the weights must come from the same save_pretrained") from None
    if adapter is not None:
        import warnings

        from peft import PeftModel

        try:
            with warnings.catch_warnings():  # every adapter load printed a FutureWarning of peft's use of
                # transformers (`is_gradient_checkpointing` is deprecated), nothing a user can act on
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
                model = PeftModel.from_pretrained(model, adapter, use_safetensors=True).merge_and_unload()
        except (SafetensorError, OSError) as e:
            raise ModelFolderError(f"adapter {adapter}: its weights do not load ({e}); copy or save them "
                                   "again") from None
        except (ValueError, KeyError, RuntimeError) as e:  # peft lists every mismatched tensor: the first two
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            more = f" (and {len(lines) - 2} more lines)" if len(lines) > 2 else ""
            raise ModelFolderError(f"adapter {adapter} does not fit the model in {path}: {' '.join(lines[:2])}{more}; "
                                   "it was trained on another base model, or its files are damaged") from None
    model = model.to(dev).eval()  # type: ignore[arg-type]  # transformers' typed wrapper
    if fingerprint:
        model.scd_fingerprint = folder_fingerprint(path, adapter)
    return model


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / f).exists() for f in TOKENIZER_FILES)


def load_tokenizer(path: str | Path, required: bool = True):
    """The folder's tokenizer; with ``required=False`` a folder without one (e.g. a saved tiny test
    model) gives None, and its service takes token ids only."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    if not has_tokenizer(path):
        if required:
            raise ModelFolderError(f"folder {path} has no tokenizer (tokenizer.json or tokenizer_config.json)")
        log.info("no tokenizer in %s: serving token ids only", path)
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - a damaged file surfaces as whatever its parser raises
        raise ModelFolderError(f"the tokenizer in {path} cannot be loaded ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:200] if str(e) else 'no message'}); restore its tokenizer "
                               "files (tokenizer.json, tokenizer_config.json) from the model's release") from None
