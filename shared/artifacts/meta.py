"""The JSON manifest of a pair's calibration artifacts."""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

FORMAT_VERSION = 1
NOT_SERVED = {"calibration", "versions", "report"}
"""Manifest fields that describe how the artifacts were made, not what they serve: outside the pin."""
CODE_KINDS = ("z", "u", "r", "qkv")
"""Kinds of SCD code: REUSE codes, PATCH codes, block entry states, fallback K/V."""


class ArtifactMeta(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format_version: int = FORMAT_VERSION
    method_version: int = 1
    pair: str
    producer_fingerprint: str
    consumer_fingerprint: str
    n_layers: int = Field(..., gt=0)
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    r_k: int
    r_v: int
    reuse_code: Literal["separate", "joint"] = "separate"
    """``separate``: K and V codes of ranks r_k, r_v; ``joint``: one [K | V] code of rank r_kv."""
    r_kv: int = 0
    layer_ranks: dict[int, int] = {}
    """Joint code only: layers whose code has another rank than ``r_kv`` (calibration lowers the
    rank where the drift does not matter, e.g. before a PATCH block)."""
    r_h: int
    code_bits: Literal[8, 16]
    code_levels: dict[str, int] = {}
    """int8 codes only: the levels each kind of code is quantized to, as bits (``z``: REUSE codes,
    ``u``: PATCH codes, ``r``: block entry states, ``qkv``: fallback K/V; absent: 8). Fewer levels
    cost no wire format change: the int8 values cluster near 0 and the wire's zstd entropy-codes
    them (calibration lowers them, cheapest KL per byte first, to a bytes target)."""
    code_channel: list[str] = []
    """Kinds of int8 code divided by a per-channel scale (this prompt's, sent as fp16 beside the
    code) before the per-token absmax quantization: residual states and K/V have a few channels tens
    of times larger than the rest, which would otherwise set every token's step."""
    center: bool
    patch_layers: list[int]
    patch_blocks: list[tuple[int, int]] = []
    """PATCH blocks [a, b) (end exclusive): the producer sends its residual-stream state at layer a
    (int8 per token), the consumer runs its own layers a..b-1 over the prompt and keeps their K/V."""
    block_exit_kv: bool = False
    """The K/V of the layer right after each PATCH block come from the block's output state with
    the consumer's own projections (nothing crosses for that layer)."""
    block_entry_map: bool = False
    """The consumer maps each PATCH block's entry state toward its own residual stream (a ridge map
    fitted by calibration, consumer-side tensors ``entry.{w,mu_p,mu_c}.{a}``) before the block."""
    fallback_layers: list[int] = []
    """REUSE layers where the code hurt on validation: ``scd`` sends the producer's own K/V there
    (int8 per token, ``quant``'s form) instead of the code, as raw transfer would."""
    reuse_fallback_layers: list[int] = []
    """The same for ``scd-reuse`` (REUSE at every layer, no PATCH), chosen separately."""
    block_guard: float = Field(0.0, ge=0)
    """A token-sparse block's guard (0: none): the most of its layers' K/V a validation prompt had
    outside what the REUSE codes carry (``SCD.unlike_calibration``), times calibration's margin. A
    prompt above it is unlike the calibration text (another language, another domain), where the
    codes the sparse block keeps carry little; the producer serves it the whole block. A run-time
    run-time policy: it changes what a prompt is served, so the artifacts' pin covers it."""
    layer_guard: dict[int, float] = {}
    """Per layer, the share of a prompt's centred K/V energy outside its REUSE code's span above which
    the layer crosses as the producer's fp16 K/V for that prompt (``SCD.layer_shares``; calibration:
    a margin over the validation prompts' highest). Empty: no layer guard. Part of the pin."""
    aligner_hidden: int
    calibration: dict[str, Any] = {}
    """Data hash, prompt and token counts, settings."""
    versions: dict[str, str] = {}
    report: dict[str, Any] = {}
    """Per-layer variance explained and errors, sensitivity curve, greedy path, ablations, stage times."""
    @field_validator("code_levels")
    @classmethod
    def _levels(cls, v: dict[str, int]) -> dict[str, int]:
        bad = {k: b for k, b in v.items() if k not in CODE_KINDS or not 2 <= b <= 8}
        if bad:
            raise ValueError(f"code_levels {bad}: kinds are {list(CODE_KINDS)}, bits 2 to 8")
        return v

    @field_validator("code_channel")
    @classmethod
    def _channel(cls, v: list[str]) -> list[str]:
        if set(v) - set(CODE_KINDS):
            raise ValueError(f"code_channel {sorted(set(v) - set(CODE_KINDS))}: kinds are {list(CODE_KINDS)}")
        return v

    files: dict[str, str] = {}
    """File name -> sha256 of every tensor file of the artifact set."""

    @property
    def pin(self) -> str:
        """The content hash of what these artifacts serve: every field but ``NOT_SERVED`` (what
        calibration reports, its data and settings, the library versions), the tensor files' hashes
        included. A stream header carries it; an operating table's point measured with other
        artifacts is stale. Rewriting the report (a later calibration stage does) keeps it."""
        return hashlib.sha256(self.model_dump_json(exclude=NOT_SERVED).encode()).hexdigest()[:16]

    @model_validator(mode="after")
    def _layers_in_range(self) -> "ArtifactMeta":
        """Every layer named is one of the model's, every block a non-empty run of them, every width
        positive: a manifest edited by hand (it is not under a hash itself) fails at load, not per
        request."""
        n = self.n_layers
        for name in ("patch_layers", "fallback_layers", "reuse_fallback_layers"):
            bad = [i for i in getattr(self, name) if not 0 <= i < n]
            if bad:
                raise ValueError(f"{name} {bad}: layers are 0..{n - 1}")
        bad_guard = {i: t for i, t in self.layer_guard.items() if not 0 <= i < n or not t >= 0}
        if bad_guard:
            raise ValueError(f"layer_guard {bad_guard}: layers are 0..{n - 1}, thresholds non-negative")
        bad_ranks = {i: r for i, r in self.layer_ranks.items() if not 0 <= i < n or r <= 0}
        if bad_ranks:
            raise ValueError(f"layer_ranks {bad_ranks}: layers are 0..{n - 1}, ranks positive")
        bad_blocks = [list(b) for b in self.patch_blocks if not 0 <= b[0] < b[1] <= n]
        if bad_blocks:
            raise ValueError(f"patch_blocks {bad_blocks}: each [a, b) needs 0 <= a < b <= {n}")
        widths = {k: getattr(self, k) for k in ("n_kv_heads", "head_dim", "hidden_size", "r_k", "r_v", "r_h")}
        if any(v <= 0 for v in widths.values()) or self.r_kv < 0:
            raise ValueError(f"widths and ranks must be positive: {widths}, r_kv {self.r_kv}")
        return self
