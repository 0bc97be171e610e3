"""Loading an operator's model folders: a Hugging Face folder (``config.json`` + safetensors
weights + tokenizer), optionally with a LoRA adapter folder merged into it at load (peft).

Every check happens before a weight is read, and every refusal names the folder and what to do:
a missing folder, an unsupported family, pickle-only weights (never unpickled: ``use_safetensors``),
an adapter without safetensors weights. The weights fingerprint is computed from the stored
tensors, so it does not depend on the dtype or device a service loads them in.
"""

from __future__ import annotations

import hashlib
import json
import logging
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
    if not _safetensors(path, "model"):
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
    from transformers import AutoConfig

    path = check_model_folder(path, what)
    raw = json.loads((path / "config.json").read_text())
    model_type = raw.get("model_type")
    if not model_type:
        raise ModelFolderError(f"{what} folder {path}: config.json has no model_type")
    check_supported(model_type)
    return AutoConfig.from_pretrained(path)


def check_adapter_folder(path: str | Path) -> Path:
    """A peft adapter folder with safetensors weights; raises ModelFolderError otherwise."""
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
    return path


def _hash_tensors(h, files: list[Path]) -> None:
    from safetensors import safe_open

    named = []
    for f in files:
        with safe_open(f, framework="pt") as sf:
            named += [(k, f) for k in sf.keys()]
    for name, f in sorted(named):
        with safe_open(f, framework="pt") as sf:
            t = sf.get_tensor(name)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def folder_fingerprint(path: str | Path, adapter: str | Path | None = None) -> str:
    """sha256 (16 hex digits) over the folder's stored weight tensors, name-sorted (and, for a
    consumer given as an adapter, over the adapter's tensors and settings too). Independent of the
    dtype and device the weights are later loaded in, and of how the weights are sharded."""
    h = hashlib.sha256()
    _hash_tensors(h, _safetensors(Path(path), "model"))
    if adapter is not None:
        adapter = Path(adapter)
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        h.update(b"|adapter|")
        h.update(json.dumps({k: v for k, v in cfg.items() if k not in _ADAPTER_META_KEYS}, sort_keys=True).encode())
        _hash_tensors(h, [adapter / "adapter_model.safetensors"])
    return h.hexdigest()[:16]


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
    ``model.scd_fingerprint`` (see ``shared.model.fingerprint``)."""
    from transformers import AutoModelForCausalLM

    path = Path(path).expanduser()
    dev = check_device(device)
    read_config(path)
    if adapter is not None:
        adapter = check_adapter_folder(adapter)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
    if adapter is not None:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, adapter, use_safetensors=True).merge_and_unload()
        except (ValueError, KeyError, RuntimeError) as e:
            raise ModelFolderError(f"adapter {adapter} does not fit the model in {path}: {e}") from None
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
    return AutoTokenizer.from_pretrained(path)
