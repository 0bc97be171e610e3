"""``quant``: the producer's K/V quantized KIVI-style (keys per channel over groups of tokens,
values per token over groups of channels, fp16 scales and zero points), 4-bit codes packed two
per byte on the wire, and the most recent ``residual`` tokens kept in fp16."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from shared.codecs.base import MethodConfig, PerLayerSession, TransferMethod, check_group_size
from shared.codecs.quant import dequantize_groups, pack4, quantize_groups, unpack4
from shared.domain import TensorSpec
from shared.errors import InvalidPayload
from shared.model.hf_adapter import from_rows, to_rows


class QuantKV(TransferMethod, kind="quant", compressive=True):

    class Config(MethodConfig):
        kind: Literal["quant"] = "quant"
        bits: Literal[4, 8] = 4
        """Code width; 4-bit codes are packed two per byte."""
        group_size: int = Field(32, gt=0)
        """Tokens per key group (per channel) and channels per value group (per token)."""
        residual: int = Field(32, ge=0)
        """The most recent tokens sent in fp16 (KIVI's full-precision window)."""

    Session = PerLayerSession
    cfg: Config

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        check_group_size(ctx.model.kv_dim, cfg.group_size)  # value groups are of channels

    def _split(self, n: int) -> int:
        """How many leading tokens are quantized: a multiple of the group, the rest stay fp16."""
        g = self.cfg.group_size
        return max(0, (n - self.cfg.residual) // g * g)

    def encode_layer(self, state, layer, start):
        out = {}
        g, bits = self.cfg.group_size, self.cfg.bits
        for name, x, axis in (("k", state.keys[layer], 0), ("v", state.values[layer], 1)):
            x = to_rows(x[:, :, start:]).float()
            nq = self._split(x.shape[0])
            q, s, z = quantize_groups(x[:nq], bits, g, axis)
            out[f"{name}.q"] = pack4(q) if bits == 4 else q.reshape(-1)
            out[f"{name}.scale"], out[f"{name}.zero"] = s, z
            out[f"{name}.res"] = x[nq:].to(torch.float16)
        return out

    def schema(self, layer, job):
        n, width, g = job.n_transfer, self.ctx.model.kv_dim, self.cfg.group_size
        nq = self._split(n)
        codes = TensorSpec(torch.uint8, (nq * width // 2 if self.cfg.bits == 4 else nq * width,))
        res = TensorSpec(torch.float16, (n - nq, width))
        out = {}
        for name, group_shape in (("k", (nq // g, 1, width)), ("v", (nq, width // g, 1))):
            sz = TensorSpec(torch.float16, group_shape)
            out.update({f"{name}.q": codes, f"{name}.scale": sz, f"{name}.zero": sz, f"{name}.res": res})
        return out

    def decode_tensors(self, layer, tensors, n):
        m = self.ctx.model
        width, g = m.kv_dim, self.cfg.group_size
        nq = self._split(n)
        out = []
        for name, axis in (("k", 0), ("v", 1)):
            try:
                packed, s, z, res = (tensors[f"{name}.{p}"] for p in ("q", "scale", "zero", "res"))
            except KeyError as e:
                raise InvalidPayload(f"quant layer {layer} lacks tensor {e.args[0]!r}") from None
            count = nq * width
            want = count // 2 if self.cfg.bits == 4 else count
            if packed.numel() != want or packed.dtype != torch.uint8 or res.shape != (n - nq, width):
                raise InvalidPayload(f"quant layer {layer} {name}: sizes do not match {n} tokens of width {width}")
            q = (unpack4(packed, count) if self.cfg.bits == 4 else packed).reshape(nq, width)
            try:
                x = torch.cat([dequantize_groups(q, s, z, g, axis), res.float()], 0)
            except RuntimeError as e:
                raise InvalidPayload(f"quant layer {layer} {name}: scales do not fit the codes ({e})") from None
            out.append(from_rows(x, m.n_kv_heads, m.head_dim))
        return out[0], out[1]

    def error_bound(self) -> float:
        return {8: 0.01, 4: 0.15}[self.cfg.bits]
