"""``spectrum``: SpectrumKV's per-token precision. The producer ranks the transferred tokens of each
layer by the attention they receive from the prompt's last ``window`` queries (SnapKV-style
observation window, summed over heads); attention sinks and the most attended tokens cross in
fp16, the next in int8, the rest in int4, within a normalized KV budget ``b`` (bytes relative to
fp16 K/V, scales included). int8/int4 are asymmetric per token over groups of channels, 4-bit codes
packed two per byte. A deployment-time probe (``scd calibrate --method spectrum``) decides whether
the pair can take int4 at all; a pair that fails it gets the two-tier fp16 + int8 policy."""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from shared.codecs.base import MethodConfig, PerLayerSession, TransferMethod, check_group_size
from shared.codecs.quant import dequantize_groups, pack4, quantize_groups, unpack4
from shared.domain import TensorSpec
from shared.errors import ConfigError, InvalidPayload
from shared.model.hf_adapter import from_rows, to_rows

FP16, INT8, INT4 = 0, 1, 2


def tier_costs(group: int) -> tuple[float, float, float]:
    """Bytes per element relative to fp16 for each tier, the fp16 scale and zero of each group included."""
    over = 4 / group / 2
    return 1.0, 0.5 + over, 0.25 + over


def allocate(importance: torch.Tensor, protected: int, budget: float, int4: bool, group: int,
             fp16_share: float) -> torch.Tensor:
    """Tier of each token (FP16/INT8/INT4) from its importance [n]; the first ``protected`` tokens
    (attention sinks) are fp16 whatever their score. The budget above the cheapest tier is spent
    ``fp16_share`` on fp16 upgrades and the rest on int8 upgrades, most important tokens first. A
    budget below the cheapest tier's cost sends every token in that tier."""
    n = importance.numel()
    c16, c8, c4 = tier_costs(group)
    floor = c4 if int4 else c8
    extra = max(0.0, budget - floor) * n
    order = importance.clone().float()
    order[:protected] = math.inf
    rank = torch.argsort(order, descending=True, stable=True)
    if int4:
        n16 = int(fp16_share * extra / (c16 - c4))
        n8 = int((extra - n16 * (c16 - c4)) / (c8 - c4))
    else:
        n16, n8 = int(extra / (c16 - c8)), n
    if n16 + n8 > n:  # every token is at least int8: the rest of the budget goes to fp16
        n16 = max(n16, int((budget - c8) * n / (c16 - c8)))
        n8 = n
    n16 = min(n, max(n16, min(protected, n)))
    tiers = torch.full((n,), INT4 if int4 else INT8, dtype=torch.uint8)
    tiers[rank[n16:n16 + n8]] = INT8
    tiers[rank[:n16]] = FP16
    return tiers


class SpectrumKV(TransferMethod, kind="spectrum", compressive=True, requires={"profile"}):
    """Per-token precision (fp16 / int8 / int4) by the attention each token receives."""

    class Config(MethodConfig):
        kind: Literal["spectrum"] = "spectrum"
        budget: float = Field(0.5, gt=0.0, le=1.0)
        """Normalized KV budget b: bytes relative to fp16 K/V (SpectrumKV's headline point is 0.5)."""
        int4: Literal["auto", "on", "off"] = "auto"
        """``auto``: the pair's deployment-time probe decides; ``on``/``off`` override it."""
        sinks: int = Field(4, ge=0)
        """Leading prompt positions always kept in fp16 (attention sinks)."""
        window: int = Field(32, ge=1)
        """Observation window: the last prompt positions whose attention ranks the tokens."""
        fp16_share: float = Field(0.5, ge=0.0, le=1.0)
        """Share of the budget above the cheapest tier spent on fp16 (the rest upgrades to int8)."""
        group_size: int = Field(32, gt=0)
        """Channels per quantization group (per token)."""

    Session = PerLayerSession
    cfg: Config

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        if cfg.int4 == "auto":
            prof = ctx.profiles.get("spectrum")
            if prof is None:
                raise ConfigError("spectrum int4=auto needs the pair's probe result (scd calibrate --method spectrum) "
                                  "or an explicit int4=on|off setting")
            self.int4 = bool(prof["int4"])
            self._pin = str(prof.get("pin", ""))
        else:
            self.int4 = cfg.int4 == "on"
            self._pin = ""
        check_group_size(ctx.model.kv_dim, cfg.group_size)

    def pin(self) -> str:
        return self._pin

    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(range(self.ctx.model.n_layers))  # queries for the importance scores

    def importance(self, state, layer: int) -> torch.Tensor:
        """Attention mass each position [0, T) receives from the last ``window`` queries."""
        m = self.ctx.model
        h = state.hidden[layer]
        t = h.shape[1]
        w = min(self.cfg.window, t)
        q = m.apply_rope(m.queries(layer, h[:, t - w:]).float(), t - w)
        k = m.apply_rope(state.keys[layer].float(), 0)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = q @ k.transpose(-1, -2) / math.sqrt(m.head_dim)  # [1, Hq, w, T]
        pos_q = torch.arange(t - w, t, device=s.device).unsqueeze(1)
        s = s.masked_fill(torch.arange(t, device=s.device).unsqueeze(0) > pos_q, float("-inf"))
        return s.softmax(-1).sum((0, 1, 2)).cpu()

    def encode_layer(self, state, layer, start):
        return self.encode_kv(state.keys[layer][:, :, start:], state.values[layer][:, :, start:],
                              self.importance(state, layer)[start:], start)

    def encode_kv(self, keys: torch.Tensor, values: torch.Tensor, imp: torch.Tensor, start: int) -> dict:
        """The transferred positions' K and V [1, H, n, D] at the tiers their importance [n] earns
        (positions before ``start`` are not sent; the sinks among the first are protected)."""
        c = self.cfg
        tiers = allocate(imp, max(0, c.sinks - start), c.budget, self.int4, c.group_size, c.fp16_share)
        out = {"tier": tiers}
        for name, x in (("k", keys), ("v", values)):
            x = to_rows(x).float().cpu()
            out[f"{name}.f16"] = x[tiers == FP16].to(torch.float16)
            for bits, tier in ((8, INT8), (4, INT4)):
                q, s, z = quantize_groups(x[tiers == tier], bits, c.group_size, 1)
                out[f"{name}.q{bits}"] = pack4(q) if bits == 4 else q
                out[f"{name}.s{bits}"], out[f"{name}.z{bits}"] = s, z
        return out

    def schema(self, layer, job):
        n, width, g = job.n_transfer, self.ctx.model.kv_dim, self.cfg.group_size
        groups = TensorSpec(torch.float16, (n, width // g, 1), exact=False)  # token counts per tier vary
        out = {"tier": TensorSpec(torch.uint8, (n,))}
        for name in ("k", "v"):
            out.update({f"{name}.f16": TensorSpec(torch.float16, (n, width), exact=False),
                        f"{name}.q8": TensorSpec(torch.uint8, (n, width), exact=False),
                        f"{name}.q4": TensorSpec(torch.uint8, (n * width // 2,), exact=False)})
            out.update({f"{name}.{p}{bits}": groups for p in ("s", "z") for bits in (8, 4)})
        return out

    def decode_tensors(self, layer, tensors, n):
        m, g = self.ctx.model, self.cfg.group_size
        width = m.kv_dim
        tiers = tensors.get("tier")
        if tiers is None or tiers.dtype != torch.uint8 or tiers.shape != (n,) or bool((tiers > INT4).any()):
            raise InvalidPayload(f"spectrum layer {layer}: 'tier' must be {n} uint8 values in 0..2")
        counts = [int((tiers == t).sum()) for t in (FP16, INT8, INT4)]
        out = []
        for name in ("k", "v"):
            try:
                f16 = tensors[f"{name}.f16"]
                parts = {bits: (tensors[f"{name}.q{bits}"], tensors[f"{name}.s{bits}"], tensors[f"{name}.z{bits}"])
                         for bits in (8, 4)}
            except KeyError as e:
                raise InvalidPayload(f"spectrum layer {layer} lacks tensor {e.args[0]!r}") from None
            if f16.shape != (counts[FP16], width):
                raise InvalidPayload(f"spectrum layer {layer} {name}.f16 has shape {tuple(f16.shape)}; "
                                     f"expected {(counts[FP16], width)}")
            x = torch.empty(n, width)
            x[tiers == FP16] = f16.float()
            for bits, tier in ((8, INT8), (4, INT4)):
                q, s, z = parts[bits]
                cnt = counts[tier]
                want = cnt * width // 2 if bits == 4 else cnt * width
                if q.dtype != torch.uint8 or q.numel() != want or s.shape != (cnt, width // g, 1) or s.shape != z.shape:
                    raise InvalidPayload(f"spectrum layer {layer} {name} int{bits}: sizes do not match {cnt} tokens")
                q = (unpack4(q, want * 2) if bits == 4 else q).reshape(cnt, width)
                x[tiers == tier] = dequantize_groups(q, s, z, g, 1)
            out.append(from_rows(x, m.n_kv_heads, m.head_dim))
        return out[0], out[1]

    def error_bound(self) -> float:
        return 0.15 if self.int4 else 0.01
