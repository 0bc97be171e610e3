"""Reading and writing one request's K/V in vLLM's paged cache (the CPU attention backend).

The CPU backend's layer cache is ``[num_blocks, H, block_size, 2 * D]``, viewed by its kernels as
``[num_blocks, H, 2 * block_size, D]``: the first half of each block holds keys, the second values.
Values are row-major per token; keys are laid out as the kernel of the chosen ISA wants them (on the
``vec`` kernels, transposed: ``[D, block_size]`` per block and head). Writing goes through vLLM's own
``cpu_attn_reshape_and_cache``, so it is whatever the kernel expects; reading is checked once per
cache against that writer (``check_layout``), and a layout this reader does not know is refused
with a clear error rather than read wrongly. Other backends (GPU) are refused the same way.
"""

from __future__ import annotations

import torch

from shared.errors import ConfigError


def _split(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    nb, h, bs, c2 = kv_layer.shape
    view = kv_layer.view(nb, h, 2 * bs, c2 // 2)
    key_cache, value_cache = view.chunk(2, dim=2)
    return key_cache, value_cache, bs


def write(kv_layer: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, isa: str) -> None:
    """Write rotated keys and values [T, H, D] into the cache slots ``slots`` [T] (int64)."""
    from vllm import _custom_ops as ops

    key_cache, value_cache, _ = _split(kv_layer)
    ops.cpu_attn_reshape_and_cache(keys.to(kv_layer.dtype).contiguous(), values.to(kv_layer.dtype).contiguous(),
                                   key_cache, value_cache, slots.to(torch.int64), isa)


def read(kv_layer: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated keys and values [T, H, D] held at cache slots ``slots`` [T] (the ``vec`` layout)."""
    key_cache, value_cache, bs = _split(kv_layer)
    nb, h, _, d = key_cache.shape
    blocks, offsets = slots // bs, slots % bs
    uniq, inv = torch.unique(blocks, return_inverse=True)
    k_blocks = key_cache[uniq].reshape(len(uniq), h, d, bs)  # [nB, H, D, bs]: keys transposed per block
    keys = k_blocks[inv, :, :, offsets]  # [T, H, D]
    values = value_cache[blocks, :, offsets]  # [T, H, D]
    return keys, values


def check_layout(kv_layer: torch.Tensor, isa: str) -> None:
    """Write known K/V into the cache's first block through vLLM's writer, read them back, restore the
    block. ``ConfigError`` when this reader does not understand the layout (another ISA or backend)."""
    if kv_layer.dim() != 4:
        raise ConfigError(f"the SCD connector reads the CPU attention backend's paged cache [blocks, heads, "
                          f"block_size, 2 x head_dim]; this engine's cache has shape {tuple(kv_layer.shape)}: "
                          "run the connector on the CPU backend (GPU layouts are not supported yet)")
    _, h, bs, c2 = kv_layer.shape
    saved = kv_layer[0].clone()
    g = torch.Generator().manual_seed(0)
    k = torch.randn(bs, h, c2 // 2, generator=g).to(kv_layer.dtype)
    v = torch.randn(bs, h, c2 // 2, generator=g).to(kv_layer.dtype)
    slots = torch.arange(bs, dtype=torch.int64)
    try:
        write(kv_layer, k, v, slots, isa)
        rk, rv = read(kv_layer, slots)
        ok = torch.equal(rk, k) and torch.equal(rv, v)
    finally:
        kv_layer[0].copy_(saved)
    if not ok:
        raise ConfigError(f"the paged-cache layout of the CPU attention kernel {isa!r} is not one the SCD connector "
                          "can read (it knows the 'vec' layout); run the engine with dtype float32, or extend "
                          "integrations/vllm_connector/paged.py")
