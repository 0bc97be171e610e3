"""``ridge``: the cross-model mapper (seed 004). The producer maps its K/V into the consumer's space
with the pair's closed-form per-head ridge maps (from the top-k most predictive producer layers,
keys pre-RoPE) and sends the mapped K/V in fp16; the consumer uses them as they are. The maps are
the pair's profile (``scd calibrate --method ridge``), needed on the producer only.

With ``budget`` below 1 the mapped K/V cross at SpectrumKV's per-token precision (``spectrum``'s
own encoder and decoder: fp16 / int8 / int4 by the attention each token receives, within that
share of fp16's bytes): the map corrects the drift, the tiers cut the bytes."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from shared.codecs.base import DecodeSession, MethodConfig, TransferMethod, kv_spec
from shared.codecs.spectrum import SpectrumKV
from shared.errors import ConfigError


class RidgeSession(DecodeSession):
    method: "RidgeMap"

    def decode_layer(self, layer, tensors):
        tiers = self.method.tiers
        if tiers is None:
            return tensors["k"], tensors["v"]  # names, dtypes and shapes checked against the schema
        return tiers.decode_tensors(layer, tensors, self.job.n_transfer)


class RidgeMap(TransferMethod, kind="ridge", cross_model=True, requires={"profile"}):
    """K/V mapped into the consumer's space on the producer; the consumer uses them as they come."""

    class Config(MethodConfig):
        """The maps are the pair's profile, applied as calibrated; the settings say how the mapped
        K/V cross."""

        kind: Literal["ridge"] = "ridge"
        budget: float = Field(1.0, gt=0.0, le=1.0)
        """Bytes of the mapped K/V relative to fp16: 1 sends fp16; below 1, per-token tiers as
        ``spectrum`` (scales included)."""
        int4: Literal["on", "off"] = "on"
        """Whether the cheapest tier is int4 (below 1 only; without it the floor is int8, ~0.56)."""
        fp16_share: float = Field(0.5, ge=0.0, le=1.0)
        """Share of the budget above the cheapest tier spent on fp16 tokens (the rest on int8)."""

    Session = RidgeSession
    cfg: Config

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        prof = ctx.profiles.get("ridge")
        if prof is None or "tensors" not in prof:
            raise ConfigError("ridge needs the pair's maps: run `scd calibrate --pair NAME --method ridge`")
        self.maps = prof["tensors"]
        n = ctx.model.n_layers
        if any(f"w.{l}" not in self.maps for l in range(n)):
            raise ConfigError(f"the ridge profile does not cover the model's {n} layers: recalibrate the pair")
        self.tiers: SpectrumKV | None = None
        if cfg.budget < 1:
            self.tiers = SpectrumKV(SpectrumKV.Config(budget=cfg.budget, int4=cfg.int4, fp16_share=cfg.fp16_share),
                                    ctx)

    def hidden_layers(self) -> tuple[int, ...]:
        return self.tiers.hidden_layers() if self.tiers else ()  # the queries that rank the tokens

    def encode_layer(self, state, layer, start):
        k, v = apply(self.maps, state.keys, state.values, layer, start, self.ctx.model.head_dim)
        if self.tiers:
            return self.tiers.encode_kv(k, v, self.tiers.importance(state, layer)[start:], start)
        return {"k": k.half(), "v": v.half()}

    def schema(self, layer, job):
        if self.tiers:
            return self.tiers.schema(layer, job)
        spec = kv_spec(self.ctx.model, job.n_transfer)
        return {"k": spec, "v": spec}

    def error_bound(self) -> float:
        return self.tiers.error_bound() if self.tiers else super().error_bound()


def apply(tensors: dict[str, torch.Tensor], keys, values, layer: int, start: int, head_dim: int):
    """The mapped pre-RoPE K/V [1, H, T-start, D] of ``layer`` from the producer's K/V of every layer."""
    src = tensors[f"src.{layer}"].tolist()
    x = torch.cat([torch.cat([keys[s][0, :, start:], values[s][0, :, start:]], -1) for s in src], -1).float()
    w, b = tensors[f"w.{layer}"], tensors[f"b.{layer}"]
    y = torch.baddbmm(b.to(x.device).unsqueeze(1), x, w.to(x.device, torch.float32))  # [H, T, 2D]
    return y[..., :head_dim].unsqueeze(0), y[..., head_dim:].unsqueeze(0)
