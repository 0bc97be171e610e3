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


class OperatingPoint(BaseModel):
    """One method and setting of a pair, measured on its validation prompts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str
    """``method`` or ``method:key=value,...``: how eval, bench and the reason name it."""
    method: str
    params: dict[str, str] = {}
    pin: str = ""
    """What the method read of the pair's store when measured (``TransferMethod.calibration`` on the
    producer's side: its artifacts' or profile's pin, ridge's maps): a point whose method now reads
    other artifacts is stale and not chosen (``shared.auto.can_serve``)."""
    kl: float = Field(ge=0)
    kl_by_kind: dict[str, float] = {}
    bytes_per_token: float = Field(ge=0)
    encode_ms_per_token: float = Field(ge=0)
    reconstruct_ms_per_token: float = Field(ge=0)


class AutoProfile(Profile):
    """The pair's operating table (``scd calibrate --method auto``): what ``auto`` chooses from."""

    kind: Literal["auto"] = "auto"
    points: list[OperatingPoint] = Field(min_length=1)
    raw_kl: float = Field(ge=0)
    """Raw fp16 transfer's validation KL: the quality bound is relative to it."""
    prefill_ms_per_token: float = Field(0.0, ge=0)
    """The consumer's own prefill, per token, measured in the same run (for the report)."""


PROFILES: dict[str, type[Profile]] = {"droidspeak": DroidSpeakProfile, "spectrum": SpectrumProfile,
                                      "ridge": RidgeProfile, "auto": AutoProfile}
