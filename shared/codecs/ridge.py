"""``ridge``: the cross-model mapper (seed 004). The producer maps its K/V into the consumer's space
with the pair's closed-form per-head ridge maps (from the top-k most predictive producer layers,
keys pre-RoPE) and sends the mapped K/V in fp16; the consumer uses them as they are. The maps are
the pair's profile (``scd calibrate --method ridge``), needed on the producer only."""

from __future__ import annotations

from typing import Literal

import torch

from shared.codecs.base import MethodConfig, TransferMethod, kv_spec
from shared.codecs.raw import RawSession
from shared.errors import ConfigError


class RidgeMap(TransferMethod, kind="ridge", cross_model=True, requires={"profile"}):
    """K/V mapped into the consumer's space on the producer; the consumer uses them as they come."""

    class Config(MethodConfig):
        """No settings: the maps are the pair's profile, applied as calibrated."""

        kind: Literal["ridge"] = "ridge"

    Session = RawSession

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        prof = ctx.profiles.get("ridge")
        if prof is None or "tensors" not in prof:
            raise ConfigError("ridge needs the pair's maps: run `scd calibrate --pair NAME --method ridge`")
        self.maps = prof["tensors"]
        n = ctx.model.n_layers
        if any(f"w.{l}" not in self.maps for l in range(n)):
            raise ConfigError(f"the ridge profile does not cover the model's {n} layers: recalibrate the pair")

    def encode_layer(self, state, layer, start):
        k, v = apply(self.maps, state.keys, state.values, layer, start, self.ctx.model.head_dim)
        return {"k": k.half(), "v": v.half()}

    def schema(self, layer, job):
        spec = kv_spec(self.ctx.model, job.n_transfer)
        return {"k": spec, "v": spec}


def apply(tensors: dict[str, torch.Tensor], keys, values, layer: int, start: int, head_dim: int):
    """The mapped pre-RoPE K/V [1, H, T-start, D] of ``layer`` from the producer's K/V of every layer."""
    src = tensors[f"src.{layer}"].tolist()
    x = torch.cat([torch.cat([keys[s][0, :, start:], values[s][0, :, start:]], -1) for s in src], -1).float()
    w, b = tensors[f"w.{layer}"], tensors[f"b.{layer}"]
    y = torch.baddbmm(b.to(x.device).unsqueeze(1), x, w.to(x.device, torch.float32))  # [H, T, 2D]
    return y[..., :head_dim].unsqueeze(0), y[..., head_dim:].unsqueeze(0)
