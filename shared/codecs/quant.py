"""Pure quantization primitives (no wire, no model): symmetric per-row int8/int4 with fp16 scales."""

from __future__ import annotations

import torch


def quantize_rows(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization of each row of x [..., n] -> (int8 codes, fp16 scale [..., 1])."""
    qmax = 2 ** (bits - 1) - 1
    scale = (x.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-8).to(torch.float16)
    q = torch.round(x / scale.float()).clamp(-qmax, qmax).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()
