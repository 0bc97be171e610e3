"""Calibration settings (``scd calibrate --set KEY=VALUE``): one typed model, validated before any
model is loaded, recorded in the artifacts' metadata."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.config import Checked


class CalibrationSettings(Checked):

    pair: str
    n_prompts: int = Field(64, ge=2)
    """Calibration prompts (paired traces)."""
    max_prompt_tokens: int = Field(1024, ge=16)
    reuse_code: Literal["joint", "separate"] = "joint"
    """``separate``: the paper's REUSE, one code for K and one for V (ranks r_k, r_v); ``joint``: one
    code of [K | V] per layer (rank r_kv), which measured better at the same bytes."""
    r_k: int = Field(96, ge=1)
    r_v: int = Field(128, ge=1)
    r_kv: int = Field(224, ge=1)
    r_h: int = Field(128, ge=1)
    code_bits: Literal[8, 16] = 8
    code_channel: list[Literal["z", "u", "r", "qkv"]] = ["r", "qkv"]
    """Kinds of int8 code sent with a per-channel scale (see ``ArtifactMeta.code_channel``): by
    default the block entry states and the fallback K/V, whose few huge channels would otherwise
    set every token's quantization step (on ``strong``: validation KL 0.101 -> 0.089, at 8 bits)."""
    bytes_target: float | None = Field(0.125, gt=0)
    """Last stage: the int8 codes' levels are lowered, one bit at a time, the kind of code with the
    least validation KL per byte saved first, until SCD's wire bytes are at most this share of raw
    fp16 K/V (``tools.calibration.levels``). None: 256 levels everywhere."""
    levels_tolerance: float = Field(0.1, ge=0)
    """The code levels stage lowers no level that takes validation KL above (1 + this) times its KL
    at 256 levels: a bytes target out of reach is reported, not bought with quality."""
    code_levels_min: int = Field(4, ge=2, le=8)
    """The fewest bits the code levels stage goes down to, on any kind of code."""
    center: bool = True
    ridge: float = Field(1e-3, ge=0)
    """Ridge strength relative to the mean input variance."""
    budget_k: int = Field(6, ge=0)
    """Patch budget: at most this many PATCH layers."""
    pool: int = Field(8, ge=1)
    """Candidate pool size kept after restore-one."""
    n_val: int = Field(24, ge=1)
    """Validation prompts for selection and ablations."""
    val_tokens: int = Field(32, ge=1)
    """Teacher-forced tokens per validation prompt (the Oracle's greedy continuation)."""
    aligner_hidden: int = Field(256, ge=1)
    aligner_steps: int = Field(300, ge=1)
    aligner_rows: int = Field(4096, ge=64)
    block_layers: int = Field(12, ge=0)
    """PATCH block length: the consumer may recompute this many consecutive layers from the
    producer's residual-stream state at the block's entry (0: no block, the paper's SCD)."""
    block_exit_kv: Literal["auto", "on", "off"] = "auto"
    """The layer after the PATCH block from the block's output state (no bytes, two projections):
    ``auto`` keeps it when validation KL does not rise by more than ``tolerance``."""
    entry_map: bool = True
    """Fit a ridge map from the producer's residual-stream state at the PATCH block's entry to the
    consumer's own (on the calibration prompts); kept when it lowers validation KL. The block then
    starts from a state nearer the consumer's (on ``strong``: validation KL -11% on QA, -17% on LM)."""
    entry_map_ridge: float = Field(1e-2, gt=0)
    """The entry map's ridge penalty, relative to the mean variance of the producer's state."""
    guard_margin: float = Field(1.03, ge=0)
    """The token-sparse block's guard (``block_guard`` in the artifacts): this margin over the highest
    ``SCD.unlike_calibration`` of the validation prompts; 0: no guard. 1.03 on ``strong`` kept every
    test prompt of the built-in data under it and put every French and Spanish one over it
    (docs/scd-speed.md, eighteenth round)."""
    layer_guard_margin: float = Field(1.0, ge=0)
    """The layer guard (``layer_guard`` in the artifacts): per layer, this margin over the highest
    ``SCD.layer_shares`` of the validation prompts; a prompt above it at a layer that carries a REUSE
    code gets that layer as fp16 K/V. 0: no layer guard. See docs/calibration.md (issue 57)."""
    pre_block_ranks: list[int] = [32, 64, 96, 128]
    """Joint-code ranks tried on the REUSE layers before the PATCH block (where drift matters
    little); the smallest whose validation KL is within ``tolerance`` of the full rank's is kept.
    Empty: every layer at ``r_kv``."""
    block_min_layers: int = Field(8, ge=1)
    """The PATCH block is shortened (two layers at a time, down to this length) while its validation
    KL stays within ``tolerance`` of the ``block_layers``-long block's: less consumer compute."""
    tolerance: float = Field(0.05, ge=0)
    """Relative rise of validation KL accepted for fewer bytes or less compute (exit layer, block
    length, pre-block ranks)."""
    fallback: bool = True
    """Check each REUSE layer's code on validation: where the producer's own K/V (int8 per token,
    as ``quant`` sends them) do better, the layer falls back to them (for ``scd`` and, chosen
    separately, ``scd-reuse``), so neither is worse than raw transfer on the layers it codes."""
    fallback_gain: float = Field(0.02, ge=0)
    """A layer falls back only when that alone lowers validation KL by more than this share (the
    fallback costs ~2-4x the code's bytes on that layer)."""
    fallback_bound: float | None = Field(0.9, gt=0)
    """After the best fallback set, each kind of validation text (QA, LM) must score at most this
    share of raw transfer's KL on that kind; layers fall back one at a time (the most helpful to the
    kind furthest over) until it holds, up to every REUSE layer. None: no bound. The margin below 1
    is for text that calibration never sees."""
    patch_compute_cost: float = Field(0.25, ge=0)
    """Consumer compute of a PATCH layer, in units of one REUSE layer's bytes, for gain per cost."""
    ablations: bool = True
    """Sweep patch budget k and r_K, r_V on the validation split (adds minutes)."""
    spill_dir: str | None = None
    """Where validation states and memoized K/V are spilled (default: ``$SCD_HOME/spill``); removed
    when calibration ends."""
    seed: int = 0
    search: Literal["auto", "full", "fast"] = "auto"
    """``full``: every stage above (tens of minutes on 2 cores). ``fast``: the search for a new
    consumer of an already-calibrated producer (``tools.calibration.fast``): the producer's side comes
    from its cache, the consumer fits its own side on ``fast_prompts`` prompts, the block is screened
    on a few validation prompts, no PATCH layers, fallback layers ranked from the traces (minutes).
    ``auto``: ``fast`` when the producer's cache for these prompts exists, else ``full``."""
    fast_prompts: int = Field(12, ge=2)
    """Calibration prompts of the fast search (and of the producer cache)."""
    fast_val: int = Field(8, ge=2)
    """Validation prompts of the fast search (QA and LM interleaved)."""
    fast_screen: int = Field(4, ge=1)
    """Validation prompts on which the fast search screens the block's placements."""
    fast_stride: int = Field(3, ge=1)
    """Layers between the block placements the fast search screens."""


class DroidSpeakSettings(Checked):
    """``scd calibrate --method droidspeak --set ...`` (``tools.calibration.droidspeak.profile``)."""

    budget_layers: int = Field(12, ge=1)
    """Layers the consumer may recompute, over all blocks."""
    block_len: int = Field(12, ge=1)
    """Layers of each candidate block."""
    n_val: int = Field(24, ge=1)


class SpectrumSettings(Checked):
    """``scd calibrate --method spectrum --set ...`` (``tools.calibration.spectrum.probe``)."""

    budget: float = Field(0.3, gt=0, le=1)
    trials: int = Field(3, ge=1)
    min_top1: float = Field(0.9, ge=0, le=1)
    """int4 is allowed when the three-tier transfer agrees with raw on at least this share of tokens."""
    n_new: int = Field(32, ge=1)
    n_val: int = Field(24, ge=1)


class RidgeSettings(Checked):
    """``scd calibrate --method ridge --set ...`` (``tools.calibration.ridge.calibrate``)."""

    top_ks: tuple[int, ...] = Field((1, 2, 3), min_length=1)
    """Grid: how many of the producer's layers around each layer its map reads."""
    alphas: tuple[float, ...] = Field((1e-3, 1e-2, 1e-1), min_length=1)
    """Grid: ridge penalties."""
    n_val: int = Field(8, ge=1)
    """Validation prompts the grid is scored on (8 unless given; the command loads up to 24)."""
    n_prompts: int = Field(64, ge=1)


BASELINE_SETTINGS: dict[str, type[Checked]] = {"droidspeak": DroidSpeakSettings, "spectrum": SpectrumSettings,
                                                "ridge": RidgeSettings}
"""The ``--set`` keys each baseline's calibration takes, typed; validated before any model loads."""
