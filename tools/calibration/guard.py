"""The guards, from the validation prompts' own values, a margin over the highest:

* the token-sparse block's guard: the threshold of ``SCD.unlike_calibration`` above which the
  producer serves a prompt the whole block (``block_guard`` in the artifacts);
* the layer guard: per layer, the threshold of ``SCD.layer_shares`` above which that layer of a
  prompt crosses as the producer's fp16 K/V instead of its REUSE code (``layer_guard``).

Both read the producer's prefill only, so the producer decides per prompt before encoding."""

from __future__ import annotations

from collections.abc import Iterable

from shared.artifacts.meta import ArtifactMeta
from shared.codecs import CodecContext
from shared.codecs.scd import SCD, PairArtifacts
from shared.model.hf_adapter import ModelAdapter, PrefillState


def fit_guards(producer: ModelAdapter, meta: ArtifactMeta, tensors: dict, states: Iterable[tuple[PrefillState, int]],
               margin: float, layer_margin: float) -> tuple[float, dict[int, float], dict]:
    """(block threshold, per-layer thresholds, report) for artifacts ``meta`` with the producer's
    ``tensors``, from validation prefill states with their native prefix lengths (read once each). No
    block, or ``margin`` 0: no block guard; ``layer_margin`` 0: no layer guard."""
    method = SCD(SCD.Config(block_guard="none", layer_guard="none"),
                 CodecContext(producer, PairArtifacts(meta, tensors, "producer")))
    blocked = bool(meta.patch_blocks) and margin > 0
    block_values: list[float] = []
    layers: dict[int, list[float]] = {}
    for state, start in states:
        if blocked:
            block_values.append(method.unlike_calibration(state, start))
        if layer_margin > 0:
            for layer, share in method.layer_shares(state, start, range(meta.n_layers)).items():
                layers.setdefault(layer, []).append(share)
    if (blocked and not block_values) or (layer_margin > 0 and not layers):
        raise ValueError("the guards need validation prompts")
    report: dict = {}
    block = 0.0
    if blocked:
        v = sorted(block_values)
        block = margin * v[-1]
        report["block_guard"] = {"threshold": block, "margin": margin, "n_prompts": len(v), "highest": v[-1],
                                 "median": v[len(v) // 2], "lowest": v[0]}
    else:
        report["block_guard"] = {"threshold": 0.0,
                                 "why": "no PATCH block" if not meta.patch_blocks else "guard_margin 0"}
    per_layer = {layer: layer_margin * max(v) for layer, v in layers.items()}
    report["layer_guard"] = ({"margin": layer_margin, "n_prompts": len(next(iter(layers.values()))),
                              "highest": {layer: max(v) for layer, v in layers.items()},
                              "median": {layer: sorted(v)[len(v) // 2] for layer, v in layers.items()}}
                             if per_layer else {"why": "layer_guard_margin 0"})
    return block, per_layer, report
