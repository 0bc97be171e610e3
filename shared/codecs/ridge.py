"""``ridge``: the cross-model mapper (seed 004). The producer maps its K/V into the consumer's space
with the pair's closed-form per-head ridge maps (from the top-k most predictive producer layers,
keys pre-RoPE) and sends the mapped K/V in fp16; the consumer uses them as they are. The maps are
the pair's profile (``scd calibrate --method ridge``), needed on the producer only.

With ``budget`` below 1 the mapped K/V cross at SpectrumKV's per-token precision (``spectrum``'s
own encoder and decoder: fp16 / int8 / int4 by the attention each token receives, within that
share of fp16's bytes): the map corrects the drift, the tiers cut the bytes. ``k_bits`` and ``v_bits`` (8, 6
or 4) instead quantize every mapped token alike, keys per channel over the transferred tokens
(KIVI's finding: keys have outlier channels; the attention sinks stay fp16) and values per token
over groups of channels: no attention scores to compute, so the encode costs little more than the
map itself."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from shared.codecs.base import DecodeSession, MethodConfig, TransferMethod, check_group_size, kv_spec
from shared.codecs.quant import (
    dequantize_columns,
    dequantize_groups,
    pack_codes,
    packed_size,
    quantize_columns,
    quantize_groups,
    unpack_codes,
)
from shared.codecs.spectrum import SpectrumKV
from shared.domain import TensorSpec
from shared.errors import ConfigError, InvalidPayload
from shared.model.hf_adapter import from_rows, to_rows


class RidgeSession(DecodeSession):
    method: "RidgeMap"

    def decode_layer(self, layer, tensors):
        m, n = self.method, self.job.n_transfer
        if m.tiers is not None:
            return m.tiers.decode_tensors(layer, tensors, n)
        if m.quantized:
            return m.decode_uniform(layer, tensors, n, self.job.start)
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
        k_bits: Literal[16, 8, 6, 4] = 16
        """Precision of every mapped key when ``budget`` is 1: 16 sends fp16; 8, 6 or 4 bits per
        value, per channel over the transferred tokens (an fp16 scale and zero per channel)."""
        v_bits: Literal[16, 8, 6, 4] = 16
        """Precision of every mapped value, per token over groups of ``group_size`` channels (bytes
        relative to fp16 at 32, scales included: 8 bits 0.56, 6 bits 0.44, 4 bits 0.31)."""
        group_size: int = Field(32, gt=0)
        """Channels per value quantization group (per token)."""
        sinks: int = Field(4, ge=0)
        """Leading prompt positions whose keys stay fp16 (attention sinks: outliers that would
        stretch every channel's range)."""

        @model_validator(mode="after")
        def _one_precision_rule(self):
            if (self.k_bits < 16 or self.v_bits < 16) and self.budget < 1:
                raise ValueError("set either budget (per-token tiers) or k_bits/v_bits (one precision for every "
                                 "token), not both")
            return self

    Session = RidgeSession
    cfg: Config

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        prof = ctx.profiles.get("ridge")
        if prof is None or "tensors" not in prof:
            raise ConfigError("ridge needs the pair's maps: run `scd calibrate --pair NAME --method ridge`")
        self.maps, self._maps_sha = prof["tensors"], str(prof.get("pin", ""))
        n = ctx.model.n_layers
        if any(f"w.{l}" not in self.maps for l in range(n)):
            raise ConfigError(f"the ridge profile does not cover the model's {n} layers: recalibrate the pair")
        self.tiers: SpectrumKV | None = None
        if cfg.budget < 1:
            self.tiers = SpectrumKV(SpectrumKV.Config(budget=cfg.budget, int4=cfg.int4, fp16_share=cfg.fp16_share),
                                    ctx)
        self.quantized = cfg.k_bits < 16 or cfg.v_bits < 16
        width = ctx.model.kv_dim
        if self.quantized:
            check_group_size(width, cfg.group_size, " (k_bits or v_bits below 16 group K/V channels)")
            if width % 4:
                raise ConfigError(f"ridge k_bits/v_bits below 16 need a K/V width that is a multiple of 4, not {width}")

    def calibration(self) -> str:  # the maps: the producer's only (pin() stays "": the consumer reads none)
        return self._maps_sha

    def hidden_layers(self) -> tuple[int, ...]:
        return self.tiers.hidden_layers() if self.tiers else ()  # the queries that rank the tokens

    def encode_layer(self, state, layer, start):
        k, v = apply(self.maps, state.keys, state.values, layer, start, self.ctx.model.head_dim)
        if self.tiers:
            return self.tiers.encode_kv(k, v, self.tiers.importance(state, layer)[start:], start)
        if self.quantized:
            return self.encode_uniform(k, v, start)
        return {"k": k.half(), "v": v.half()}

    def _protected(self, n: int, start: int) -> int:
        return min(n, max(0, self.cfg.sinks - start))

    def encode_uniform(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
        c = self.cfg
        k, v = to_rows(keys).float().cpu(), to_rows(values).float().cpu()
        out = {}
        if c.k_bits == 16:
            out["k"] = k.half()
        else:
            p = self._protected(k.shape[0], start)
            q, out["k.s"], out["k.z"] = quantize_columns(k[p:], c.k_bits)
            out["k.q"], out["k.f16"] = pack_codes(q, c.k_bits), k[:p].half()
        if c.v_bits == 16:
            out["v"] = v.half()
        else:
            q, out["v.s"], out["v.z"] = quantize_groups(v, c.v_bits, c.group_size, 1)
            out["v.q"] = pack_codes(q, c.v_bits)
        return out

    def decode_uniform(self, layer: int, tensors: dict[str, torch.Tensor], n: int, start: int):
        m, c, w = self.ctx.model, self.cfg, self.ctx.model.kv_dim
        try:  # sizes and dtypes were checked against the schema
            if c.k_bits == 16:
                k = tensors["k"].float()
            else:
                p = self._protected(n, start)
                q = unpack_codes(tensors["k.q"], c.k_bits, (n - p) * w).reshape(n - p, w)
                k = torch.cat([tensors["k.f16"].float(), dequantize_columns(q, tensors["k.s"], tensors["k.z"])])
            if c.v_bits == 16:
                v = tensors["v"].float()
            else:
                q = unpack_codes(tensors["v.q"], c.v_bits, n * w).reshape(n, w)
                v = dequantize_groups(q, tensors["v.s"], tensors["v.z"], c.group_size, 1)
        except RuntimeError as e:
            raise InvalidPayload(f"ridge layer {layer}: scales do not fit the codes ({e})") from None
        return from_rows(k, m.n_kv_heads, m.head_dim), from_rows(v, m.n_kv_heads, m.head_dim)

    def schema(self, layer, job):
        if self.tiers:
            return self.tiers.schema(layer, job)
        if not self.quantized:
            spec = kv_spec(self.ctx.model, job.n_transfer)
            return {"k": spec, "v": spec}
        c, n, w = self.cfg, job.n_transfer, self.ctx.model.kv_dim
        out = {}
        if c.k_bits == 16:
            out["k"] = TensorSpec(torch.float16, (n, w))
        else:
            p = self._protected(n, job.start)
            per_channel = TensorSpec(torch.float16, (1, w))
            out.update({"k.q": TensorSpec(torch.uint8, (packed_size((n - p) * w, c.k_bits),)),
                        "k.f16": TensorSpec(torch.float16, (p, w)), "k.s": per_channel, "k.z": per_channel})
        if c.v_bits == 16:
            out["v"] = TensorSpec(torch.float16, (n, w))
        else:
            groups = TensorSpec(torch.float16, (n, w // c.group_size, 1))
            out.update({"v.q": TensorSpec(torch.uint8, (packed_size(n * w, c.v_bits),)), "v.s": groups,
                        "v.z": groups})
        return out

    def error_bound(self) -> float:
        if self.tiers:
            return self.tiers.error_bound()
        if self.quantized:
            return {16: 0.0, 8: 0.01, 6: 0.04, 4: 0.15}[min(self.cfg.k_bits, self.cfg.v_bits)]
        return super().error_bound()


def apply(tensors: dict[str, torch.Tensor], keys, values, layer: int, start: int, head_dim: int):
    """The mapped pre-RoPE K/V [1, H, T-start, D] of ``layer`` from the producer's K/V of every layer."""
    src = tensors[f"src.{layer}"].tolist()
    x = torch.cat([torch.cat([keys[s][0, :, start:], values[s][0, :, start:]], -1) for s in src], -1).float()
    w, b = tensors[f"w.{layer}"], tensors[f"b.{layer}"]
    y = torch.baddbmm(b.to(x.device).unsqueeze(1), x, w.to(x.device, torch.float32))  # [H, T, 2D]
    return y[..., :head_dim].unsqueeze(0), y[..., head_dim:].unsqueeze(0)
