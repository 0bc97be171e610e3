"""``ridge``: the cross-model mapper (seed 004). The producer maps its K/V into the consumer's space
with the pair's closed-form per-head ridge maps (from the top-k most predictive producer layers,
keys pre-RoPE) and sends the mapped K/V in fp16; the consumer uses them as they are. The maps are
the pair's profile (``scd calibrate --method ridge``), needed on the producer only.

With ``budget`` below 1 the mapped K/V cross at SpectrumKV's per-token precision (``spectrum``'s
own encoder and decoder: fp16 / int8 / int4 by the attention each token receives, within that
share of fp16's bytes): the map corrects the drift, the tiers cut the bytes. ``bits`` 8, 6 or 4
instead quantize every mapped token alike (per token over groups of channels, fp16 scale and zero
point): no attention scores to compute, so the encode costs little more than the map itself."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from shared.codecs.base import DecodeSession, MethodConfig, TransferMethod, kv_spec
from shared.codecs.quant import dequantize_groups, pack_codes, packed_size, quantize_groups, unpack_codes
from shared.codecs.spectrum import SpectrumKV
from shared.domain import TensorSpec
from shared.errors import ConfigError, InvalidPayload
from shared.model.hf_adapter import from_rows, to_rows


class RidgeSession(DecodeSession):
    method: "RidgeMap"

    def decode_layer(self, layer, tensors):
        m = self.method
        if m.tiers is not None:
            return m.tiers.decode_tensors(layer, tensors, self.job.n_transfer)
        if m.cfg.bits < 16:
            return m.decode_uniform(layer, tensors, self.job.n_transfer)
        return tensors["k"], tensors["v"]  # names, dtypes and shapes checked against the schema


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
        bits: Literal[16, 8, 6, 4] = 16
        """Precision of every mapped token when ``budget`` is 1: 16 sends fp16; 8, 6 or 4 bits per
        value (bytes relative to fp16, scales included, at group_size 32: 0.56, 0.44, 0.31)."""
        group_size: int = Field(32, gt=0)
        """Channels per quantization group (per token) for ``bits`` below 16."""

        @model_validator(mode="after")
        def _one_precision_rule(self):
            if self.bits < 16 and self.budget < 1:
                raise ValueError("set either budget (per-token tiers) or bits (one precision for every token), "
                                 "not both")
            return self

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
        width = ctx.model.kv_dim
        if cfg.bits < 16 and (width % cfg.group_size or width % {8: 1, 6: 4, 4: 2}[cfg.bits]):
            raise ConfigError(f"ridge bits={cfg.bits}: K/V width {width} must be a multiple of group_size "
                              f"{cfg.group_size} (and of 4 for 6-bit codes)")

    def hidden_layers(self) -> tuple[int, ...]:
        return self.tiers.hidden_layers() if self.tiers else ()  # the queries that rank the tokens

    def encode_layer(self, state, layer, start):
        k, v = apply(self.maps, state.keys, state.values, layer, start, self.ctx.model.head_dim)
        if self.tiers:
            return self.tiers.encode_kv(k, v, self.tiers.importance(state, layer)[start:], start)
        if self.cfg.bits < 16:
            return self.encode_uniform(k, v)
        return {"k": k.half(), "v": v.half()}

    def encode_uniform(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        bits, g = self.cfg.bits, self.cfg.group_size
        out = {}
        for name, x in (("k", keys), ("v", values)):
            q, scale, zero = quantize_groups(to_rows(x).float().cpu(), bits, g, 1)
            out[f"{name}.q"], out[f"{name}.s"], out[f"{name}.z"] = pack_codes(q, bits), scale, zero
        return out

    def decode_uniform(self, layer: int, tensors: dict[str, torch.Tensor], n: int):
        m, bits, g = self.ctx.model, self.cfg.bits, self.cfg.group_size
        out = []
        for name in ("k", "v"):  # sizes and dtypes were checked against the schema
            q = unpack_codes(tensors[f"{name}.q"], bits, n * m.kv_dim).reshape(n, m.kv_dim)
            try:
                x = dequantize_groups(q, tensors[f"{name}.s"], tensors[f"{name}.z"], g, 1)
            except RuntimeError as e:
                raise InvalidPayload(f"ridge layer {layer} {name}: scales do not fit the codes ({e})") from None
            out.append(from_rows(x, m.n_kv_heads, m.head_dim))
        return out[0], out[1]

    def schema(self, layer, job):
        if self.tiers:
            return self.tiers.schema(layer, job)
        if self.cfg.bits < 16:
            n, width, g = job.n_transfer, self.ctx.model.kv_dim, self.cfg.group_size
            codes = TensorSpec(torch.uint8, (packed_size(n * width, self.cfg.bits),))
            groups = TensorSpec(torch.float16, (n, width // g, 1))
            return {f"{name}.{p}": spec for name in ("k", "v") for p, spec in (("q", codes), ("s", groups),
                                                                                 ("z", groups))}
        spec = kv_spec(self.ctx.model, job.n_transfer)
        return {"k": spec, "v": spec}

    def error_bound(self) -> float:
        if self.tiers:
            return self.tiers.error_bound()
        return {16: super().error_bound(), 8: 0.01, 6: 0.04, 4: 0.15}[self.cfg.bits]


def apply(tensors: dict[str, torch.Tensor], keys, values, layer: int, start: int, head_dim: int):
    """The mapped pre-RoPE K/V [1, H, T-start, D] of ``layer`` from the producer's K/V of every layer."""
    src = tensors[f"src.{layer}"].tolist()
    x = torch.cat([torch.cat([keys[s][0, :, start:], values[s][0, :, start:]], -1) for s in src], -1).float()
    w, b = tensors[f"w.{layer}"], tensors[f"b.{layer}"]
    y = torch.baddbmm(b.to(x.device).unsqueeze(1), x, w.to(x.device, torch.float32))  # [H, T, 2D]
    return y[..., :head_dim].unsqueeze(0), y[..., head_dim:].unsqueeze(0)
