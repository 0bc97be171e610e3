"""Pure quantization primitives (no wire, no model): symmetric per-row int8/int4 with fp16 scales."""

from __future__ import annotations

import sys

import torch


def quantize_rows(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization of each row of x [..., n] -> (int8 codes, fp16 scale [..., 1])."""
    qmax = 2 ** (bits - 1) - 1
    scale = (x.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-8).to(torch.float16)
    q = torch.round(x / scale.float()).clamp(-qmax, qmax).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()


def pack4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes (0..15) per byte; the input's element count must be even."""
    flat = q.reshape(-1).to(torch.uint8)
    return (flat[0::2] | (flat[1::2] << 4)).contiguous()


def unpack4(p: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.empty(p.numel() * 2, dtype=torch.uint8, device=p.device)
    out[0::2], out[1::2] = p & 0x0F, p >> 4
    return out[:n]


def pack6(q: torch.Tensor) -> torch.Tensor:
    """Four 6-bit codes (0..63) in three bytes; the input's element count must be a multiple of 4.
    On a little-endian host the four codes are read as one int32 and shifted together (fewer passes
    over memory than four byte columns)."""
    if sys.byteorder != "little":
        a, b, c, d = q.reshape(-1, 4).to(torch.uint8).unbind(1)
        return torch.stack([a | (b << 6), (b >> 2) | (c << 4), (c >> 4) | (d << 2)], 1).reshape(-1).contiguous()
    w = q.reshape(-1, 4).to(torch.uint8).contiguous().view(torch.int32).reshape(-1)
    y = (w & 0x3F) | ((w >> 2) & 0xFC0) | ((w >> 4) & 0x3F000) | ((w >> 6) & 0xFC0000)
    return y.view(torch.uint8).reshape(-1, 4)[:, :3].reshape(-1)


def unpack6(p: torch.Tensor, n: int) -> torch.Tensor:
    if sys.byteorder != "little":
        x, y, z = p.reshape(-1, 3).unbind(1)
        out = torch.stack([x & 0x3F, (x >> 6) | ((y & 0x0F) << 2), (y >> 4) | ((z & 0x03) << 4), z >> 2], 1)
        return out.reshape(-1)[:n]
    b = torch.zeros(p.numel() // 3, 4, dtype=torch.uint8, device=p.device)
    b[:, :3] = p.reshape(-1, 3)
    y = b.view(torch.int32).reshape(-1)
    w = (y & 0x3F) | ((y << 2) & 0x3F00) | ((y << 4) & 0x3F0000) | ((y << 6) & 0x3F000000)
    return w.view(torch.uint8)[:n]


def packed_size(count: int, bits: int) -> int:
    """Bytes of ``count`` codes of ``bits`` (8, 6 or 4) as ``pack_codes`` lays them out."""
    return count * bits // 8


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``bits`` (8, 6 or 4) packed into bytes; 6-bit needs a multiple of 4 codes, 4-bit of 2."""
    return {8: lambda x: x.reshape(-1).contiguous(), 6: pack6, 4: pack4}[bits](q)


def unpack_codes(p: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    return {8: lambda x, m: x.reshape(-1)[:m], 6: unpack6, 4: unpack4}[bits](p, n)


def quantize_groups(x: torch.Tensor, bits: int, group: int,
                    axis: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of x [T, C] in groups of ``group`` along ``axis`` (0: groups
    of tokens per channel, KIVI's keys; 1: groups of channels per token, KIVI's values).

    Returns (codes uint8 [T, C] in 0..2^bits-1, scale fp16, zero fp16), scale/zero broadcastable
    over the grouped layout. T (axis 0) or C (axis 1) must be a multiple of ``group``."""
    t, c = x.shape
    xg = x.reshape(t // group, group, c) if axis == 0 else x.reshape(t, c // group, group)
    red = 1 if axis == 0 else 2
    lo, hi = xg.amin(red, keepdim=True), xg.amax(red, keepdim=True)
    levels = 2**bits - 1
    scale = ((hi - lo) / levels).clamp_min(1e-8).to(torch.float16)
    zero = lo.to(torch.float16)
    q = torch.round((xg - zero.float()) / scale.float()).clamp(0, levels).to(torch.uint8)
    return q.reshape(t, c), scale, zero


def quantize_columns(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of each column of x [T, C] over all its T rows (keys per
    channel over the tokens) -> (codes uint8 [T, C], scale fp16 [1, C], zero fp16 [1, C]); T may be 0."""
    if x.shape[0] == 0:
        zeros = torch.zeros(1, x.shape[1], dtype=torch.float16)
        return torch.zeros(0, x.shape[1], dtype=torch.uint8), zeros + 1, zeros
    q, scale, zero = quantize_groups(x, bits, x.shape[0], 0)
    return q, scale.reshape(1, -1), zero.reshape(1, -1)


def dequantize_columns(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float() + zero.float()


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, axis: int) -> torch.Tensor:
    t, c = q.shape
    qg = q.reshape(t // group, group, c) if axis == 0 else q.reshape(t, c // group, group)
    return (qg.float() * scale.float() + zero.float()).reshape(t, c)
