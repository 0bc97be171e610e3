"""Where large generated assets live: outside git, under ``SCD_HOME``."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
ADAPTERS_DIR = REPO_ROOT / "artifacts" / "adapters"  # committed LoRA adapters (small, fp16)
STORE_DIR = REPO_ROOT / "artifacts" / "store"  # committed calibration artifacts for the default pairs


def scd_home() -> Path:
    """``$SCD_HOME``, else ``$XDG_CACHE_HOME/scd``, else ``~/.cache/scd``."""
    if os.environ.get("SCD_HOME"):
        return Path(os.environ["SCD_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "scd"


def profile_path(store_dir: str | Path, pair: str, kind: str) -> Path:
    """Where pair ``pair``'s ``kind`` profile lives: ``<store>/<pair>.<kind>.json``, beside its folder."""
    return Path(store_dir) / f"{pair}.{kind}.json"


def models_dir() -> Path:
    return scd_home() / "models"


def data_dir() -> Path:
    return scd_home() / "data"


def downloads_dir() -> Path:
    return scd_home() / "downloads"
