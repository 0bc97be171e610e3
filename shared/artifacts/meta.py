"""The JSON manifest of a pair's calibration artifacts."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FORMAT_VERSION = 1


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
    center: bool
    patch_layers: list[int]
    patch_blocks: list[tuple[int, int]] = []
    """PATCH blocks [a, b) (end exclusive): the producer sends its residual-stream state at layer a
    (int8 per token), the consumer runs its own layers a..b-1 over the prompt and keeps their K/V."""
    block_exit_kv: bool = False
    """The K/V of the layer right after each PATCH block come from the block's output state with
    the consumer's own projections (nothing crosses for that layer)."""
    fallback_layers: list[int] = []
    """REUSE layers where the code hurt on validation: ``scd`` sends the producer's own K/V there
    (int8 per token, ``quant``'s form) instead of the code, as raw transfer would."""
    reuse_fallback_layers: list[int] = []
    """The same for ``scd-reuse`` (REUSE at every layer, no PATCH), chosen separately."""
    aligner_hidden: int
    calibration: dict[str, Any] = {}
    """Data hash, prompt and token counts, settings."""
    versions: dict[str, str] = {}
    report: dict[str, Any] = {}
    """Per-layer variance explained and errors, sensitivity curve, greedy path, ablations, stage times."""
    files: dict[str, str] = {}
    """File name -> sha256 of every tensor file of the artifact set."""
