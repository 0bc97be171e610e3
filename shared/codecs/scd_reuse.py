"""``scd-reuse``: SCD's REUSE codes at every layer, no PATCH (the ablation that shows what PATCH earns),
with a guard: a prompt its codes do not carry is served the producer's own K/V, as ``raw`` sends them."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from shared.codecs.base import MethodConfig, parse_int_list
from shared.codecs.scd import SCD


class SCDReuse(SCD, kind="scd-reuse", version=2):
    """REUSE at every layer, no PATCH."""

    # version 2: ``fallback=raw`` (the guard's answer) sends fp16 K/V, which a version 1 consumer cannot read

    class Config(MethodConfig):
        kind: Literal["scd-reuse"] = "scd-reuse"
        fallback: Literal["auto", "none", "raw"] = "auto"
        """``auto``: the producer's own K/V (int8 per token) on the layers where calibration found
        REUSE-only's code worse; ``none``: the code on every layer; ``raw``: the producer's own K/V
        in fp16 on every layer, what ``raw`` sends (the guard's answer to a prompt the codes do not carry)."""
        codes: Literal["auto", "int8"] = "auto"
        """``auto``: the artifacts' per-channel scales (their levels are ``scd``'s); ``int8``: a
        per-token scale only."""
        layer_guard: Literal["auto", "none"] = "auto"
        """``auto``: a prompt whose K/V lie further outside a code layer's span than any validation
        prompt's did (the artifacts' ``layer_guard``) is served ``fallback=raw``: on held-out text
        (news, stdlib docstrings) REUSE-only with those layers alone raw was still 1.01x raw's KL on
        news, and no test prompt of the built-in data crosses it (docs/calibration.md, issue 57).
        ``none``: the codes."""
        raw_layers: Literal["none"] | list[int] = "none"
        """Layers that cross as the producer's own fp16 K/V instead of their code (the layer guard's answer)."""
        guard: Literal["auto", "none"] = "auto"
        """``auto``: after its prefill the producer serves ``fallback=raw`` to a prompt unlike the
        calibration text: its K/V further outside what the codes carry than any validation prompt's, by
        the artifacts' ``block_guard``, over their PATCH block's layers (the same test as ``scd``'s
        ``block_guard``; none if the artifacts hold no guard or no block). On French text the codes were
        1.37x raw's KL (docs/scd-speed.md, seventeenth and twentieth rounds). ``none``: the codes for
        every prompt. The vLLM connector sends its header before the prefill, so it serves the codes."""

        @field_validator("raw_layers", mode="before")
        @classmethod
        def _layers(cls, v):
            return parse_int_list(v)

    uses_levels = False  # the levels were chosen for scd, with its block; REUSE-only keeps 256 levels

    guarded_settings = {"fallback": "raw"}

    def layer_guarded_settings(self, flagged: set[int]) -> dict[str, str]:
        """REUSE-only has no block to lean on: text whose K/V leave the codes' span at any layer gets
        raw's K/V at every layer (per-layer raw alone still lost to raw on news)."""
        return dict(self.guarded_settings)

    def _guarded(self, cfg) -> bool:
        return cfg.guard == "auto" and cfg.fallback != "raw" and bool(self.meta.patch_blocks)

    def _fallback_layers(self) -> list[int]:
        return self.meta.reuse_fallback_layers

    def _patch_set(self, spec: str | list[int]) -> frozenset[int]:
        return frozenset()
