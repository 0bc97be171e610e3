"""``raw``: the producer's own pre-RoPE K/V, as is (fp16 by default; fp32 is lossless)."""

from __future__ import annotations

from typing import Literal

import torch

from shared.codecs.base import DecodeSession, MethodConfig, TransferMethod, kv_spec

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class RawSession(DecodeSession):
    def decode_layer(self, layer, tensors):
        return tensors["k"], tensors["v"]  # names, dtypes and shapes checked against the schema


class RawKV(TransferMethod, kind="raw"):

    class Config(MethodConfig):
        kind: Literal["raw"] = "raw"
        dtype: Literal["float16", "bfloat16", "float32"] = "float16"
        """Wire dtype of K and V; ``float32`` makes the transfer lossless for fp32 models."""

    Session = RawSession
    cfg: Config

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        return self.cfg.dtype == "float32"

    def encode_layer(self, state, layer, start):
        dt = _DTYPES[self.cfg.dtype]
        return {"k": state.keys[layer][:, :, start:].to(dt), "v": state.values[layer][:, :, start:].to(dt)}

    def schema(self, layer, job):
        spec = kv_spec(self.ctx.model, job.n_transfer, _DTYPES[self.cfg.dtype])
        return {"k": spec, "v": spec}

    def error_bound(self) -> float:
        return {"float32": 0.0, "float16": 1e-3, "bfloat16": 8e-3}[self.cfg.dtype]
