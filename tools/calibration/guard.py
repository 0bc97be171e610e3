"""The token-sparse block's guard: the threshold of ``SCD.unlike_calibration`` above which the
producer serves a prompt the whole block (``block_guard`` in the artifacts), from the validation
prompts' own values: a margin over the highest."""

from __future__ import annotations

from collections.abc import Iterable

from shared.artifacts.meta import ArtifactMeta
from shared.codecs import CodecContext
from shared.codecs.scd import SCD, PairArtifacts
from shared.model.hf_adapter import ModelAdapter, PrefillState


def fit_guard(producer: ModelAdapter, meta: ArtifactMeta, tensors: dict, states: Iterable[tuple[PrefillState, int]],
              margin: float) -> tuple[float, dict]:
    """(threshold, report) for artifacts ``meta`` with the producer's ``tensors``, from validation
    prefill states with their native prefix lengths. No block, or ``margin`` 0: (0, why)."""
    if not meta.patch_blocks or margin <= 0:
        return 0.0, {"threshold": 0.0, "why": "no PATCH block" if not meta.patch_blocks else "guard_margin 0"}
    cfg = SCD.Config(block_tokens=0.5, block_select="producer", block_guard="none")
    method = SCD(cfg, CodecContext(producer, PairArtifacts(meta, tensors, "producer")))
    values = sorted(method.unlike_calibration(state, start) for state, start in states)
    if not values:
        raise ValueError("the block guard needs validation prompts")
    threshold = margin * values[-1]
    return threshold, {"threshold": threshold, "margin": margin, "n_prompts": len(values), "highest": values[-1],
                       "median": values[len(values) // 2], "lowest": values[0]}
