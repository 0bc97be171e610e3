"""The typed JSON profiles of the baselines (``<store>/<pair>.<kind>.json``): what each one must hold.
``store.load_profile`` validates a profile against its kind's model and refuses another format."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PROFILE_FORMAT_VERSION = 1


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    pair: str
    kind: str
    format_version: int = PROFILE_FORMAT_VERSION
    producer_fingerprint: str
    consumer_fingerprint: str
    report: dict[str, Any] = {}
    """What profiling measured (validation KL, the search path...): for people, not for serving."""
    data: str | None = None
    """The operator's data file it was profiled on (path and sha256), when not the built-in data."""


class DroidSpeakProfile(Profile):
    kind: Literal["droidspeak"] = "droidspeak"
    blocks: list[tuple[int, int]]
    """The recompute blocks [a, b) (end exclusive) both sides use."""
    budget_layers: int = Field(0, ge=0)
    block_len: int = Field(0, ge=0)


class SpectrumProfile(Profile):
    kind: Literal["spectrum"] = "spectrum"
    int4: bool
    """The deployment-time probe's verdict: may the cheapest tier be int4."""


class RidgeProfile(Profile):
    kind: Literal["ridge"] = "ridge"
    top_k: int = Field(1, ge=1)
    alpha: float = Field(0.0, ge=0)
    sources: dict[str, list[int]] = {}
    tensors_sha256: str
    """sha256 of ``<pair>.ridge.safetensors``, the maps."""


PROFILES: dict[str, type[Profile]] = {"droidspeak": DroidSpeakProfile, "spectrum": SpectrumProfile,
                                      "ridge": RidgeProfile}
