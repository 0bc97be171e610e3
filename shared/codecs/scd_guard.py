"""SCD's guards: whether a prompt's K/V are like those its codes were fitted on, read from the
producer's prefill after it (so both guards change a request's settings then, and the stream
header, which carries them, goes after the prefill). A mixin of ``SCD``; see docs/calibration.md.

* the token-sparse block's guard (``block_guard``): a prompt unlike the calibration text gets the
  whole block (``unlike_calibration``, over the block's layers);
* the layer guard (``layer_guard``): per layer that carries a REUSE code, the share of this prompt's
  K/V outside the code's span (``layer_shares``) against calibration's threshold."""

from __future__ import annotations

import json
from typing import Any

import torch

from shared.artifacts.meta import ArtifactMeta
from shared.model.hf_adapter import to_rows

GUARD_POSITIONS = 256
"""The positions ``SCD.unlike_calibration`` looks at, evenly spaced: a mean over the prompt, which
every position need not enter (all of a prompt's 1,000 cost the sparse block 11% of its TTFT)."""


class Guards:
    """The guards of ``SCD`` (it sets ``guard``, ``layer_guard``, ``raw_layers``, ``meta``, ``art``,
    ``blocks``, ``sends_positions`` and ``cfg``)."""

    cfg: Any
    meta: ArtifactMeta
    art: Any  # PairArtifacts
    guard: float
    layer_guard: dict[int, float]
    raw_layers: frozenset[int]
    sends_positions: bool
    blocks: list[tuple[int, int]]

    @property
    def decides_after_prefill(self) -> bool:
        return self.guard > 0 or bool(self.layer_guard)

    guarded_settings = {"block_tokens": "1"}
    """What a prompt ``unlike_calibration`` is served instead: the whole block."""

    def _guarded(self, cfg) -> bool:
        """Whether these settings check each prompt against the calibration text (``block_guard=auto``, a
        token-sparse block whose positions the producer chooses)."""
        return getattr(cfg, "block_guard", "none") == "auto" and self.sends_positions and bool(self.blocks)

    def settings_for(self, state, start: int) -> dict[str, str] | None:
        """These settings with ``guarded_settings`` for a prompt ``unlike_calibration`` (above the
        guard), and with ``raw_layers`` for the code layers whose K/V lie outside what their code
        carries (above the layer guard); None when neither guard fires."""
        out = {}
        if self.guard and self.unlike_calibration(state, start) > self.guard:
            out.update(self.guarded_settings)
            if out.get("fallback") == "raw":  # every layer crosses raw already
                return {**self.cfg.wire_params(), **out}
        if self.layer_guard:
            shares = self.layer_shares(state, start, sorted(self.layer_guard))
            flagged = {l for l, x in shares.items() if x > self.layer_guard[l]}
            if flagged:
                out.update(self.layer_guarded_settings(flagged))
        return {**self.cfg.wire_params(), **out} if out else None

    def layer_guarded_settings(self, flagged: set[int]) -> dict[str, str]:
        """What a prompt whose K/V lie outside the codes' span at the code layers ``flagged`` is
        served: those layers as the producer's fp16 K/V."""
        return {"raw_layers": json.dumps(sorted(self.raw_layers | flagged))}

    def unlike_calibration(self, state, start: int) -> float:
        """How unlike the calibration text a prompt is, from the producer's prefill: the share of its
        centred K/V energy (positions ``start``.. of ``state``, ``GUARD_POSITIONS`` of them evenly
        spaced at most) outside the span of the REUSE encoder, averaged over the first calibrated block's layers
        (what no code can carry; validation prompts of the built-in data 0.092-0.099 on ``strong``,
        French and Spanish text 0.104-0.110)."""
        a, b = self.meta.patch_blocks[0]
        shares = self.layer_shares(state, start, range(a, b))
        return sum(shares.values()) / len(shares) if shares else 0.0

    def layer_shares(self, state, start: int, layers) -> dict[int, float]:
        """Per layer, the mean over positions ``start``.. (``GUARD_POSITIONS`` of them evenly spaced at
        most) of the share of each position's centred K/V energy outside the span of the layer's
        REUSE encoder (what no code carries; K and V averaged for separate codes). {} for no position."""
        layers = list(layers)
        if not layers:
            return {}
        n = state.keys[layers[0]].shape[2] - start
        if n <= 0:
            return {}
        dev = state.keys[layers[0]].device
        pos = start + torch.linspace(0, n - 1, min(n, GUARD_POSITIONS), device=dev).round().long()
        parts = ("kv",) if self.meta.reuse_code == "joint" else ("k", "v")
        out = {}
        for layer in layers:
            k, v = (to_rows(x[:, :, pos]).float() for x in (state.keys[layer], state.values[layer]))
            shares = []
            for part in parts:
                q, mu = self.art.span(part, layer, k.device)
                x = (torch.cat([k, v], 1) if part == "kv" else k if part == "k" else v) - mu
                total = x.pow(2).sum(1).clamp_min(1e-12)  # ||x - Q Q'x||^2 = ||x||^2 - ||Q'x||^2 (Q orthonormal)
                shares.append(((total - (x @ q).pow(2).sum(1)).clamp_min(0) / total).mean())
            out[layer] = float(torch.stack(shares).mean())
        return out
