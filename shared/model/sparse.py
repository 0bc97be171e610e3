"""Token-sparse decoder-layer runs (CacheBlend-style selective recompute), part of the model adapter:
``SparseLayers`` runs a layer for some positions only over the other positions' given K/V, and the
attention implementation (``CHUNKED_SDPA``) that lets such a run attend in chunks of positions."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from shared.model.hf_adapter import rotate_half

if TYPE_CHECKING:
    from shared.model.hf_adapter import ModelAdapter

CHUNKED_SDPA = "scd_sdpa"
"""The attention implementation a ``ModelAdapter`` sets on a model that uses ``sdpa``: transformers' own
``sdpa`` for every call, except a token-sparse layer run's (``SparseLayers``), which passes its query
chunks and gets each chunk attended over only the keys up to its last position."""


def _sdpa_by_query_chunks(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                          scd_query_chunks=None, **kwargs):
    """``sdpa`` attention; with ``scd_query_chunks`` (``[(first, end, n_keys, mask), ...]`` over the
    query rows, from ``SparseLayers``), each chunk of queries attends to the first ``n_keys`` keys only
    under its own slice of the mask. The recomputed positions are sorted, so a chunk's queries
    never attend past its last position: with the full mask, the keys after it would only be masked
    out (half the work at a third of the positions)."""
    if scd_query_chunks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)  # grouped-query attention: sdpa's own head layout
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = torch.cat([F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, :n], value[:, :, :n], attn_mask=mask,
                                                    dropout_p=dropout, scale=scaling)
                     for a, b, n, mask in scd_query_chunks], dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(CHUNKED_SDPA, _sdpa_by_query_chunks)
AttentionMaskInterface.register(CHUNKED_SDPA, sdpa_mask)  # the same masks as sdpa


class _ScatterCache:
    """Stands in for a transformers ``Cache`` inside a token-sparse layer run (``SparseLayers``): a
    layer's update takes the given pre-RoPE K/V of every position, lets ``correct`` adjust them from
    the recomputed positions' native K/V (captured before RoPE), writes those native K/V at their
    positions and returns the rotated keys and the values of every position."""

    def __init__(self, run: "SparseLayers"):
        self.run = run
        self.keys: torch.Tensor | None = None  # the given K/V of the layer being run, pre-RoPE [1, H, T, D]
        self.values: torch.Tensor | None = None
        self.native_k: torch.Tensor | None = None  # the recomputed positions' own pre-RoPE keys [1, H, S, D]
        self.correct = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        run, pos = self.run, self.run.positions
        k, v = self.keys, self.values
        assert k is not None and v is not None and self.native_k is not None
        if self.correct is not None:  # new tensors
            k, v = self.correct(k, v, self.native_k, value_states)
        else:
            k, v = k.clone(), v.clone()
        k[:, :, pos] = self.native_k.to(k.dtype)
        v[:, :, pos] = value_states.to(v.dtype)
        self.keys, self.values = k, v  # pre-RoPE, what the layer run returns
        rotated = k * run.cos + rotate_half(k) * run.sin
        rotated[:, :, pos] = key_states.to(k.dtype)
        return rotated, v


class SparseLayers:
    """Decoder layers run for some positions only (CacheBlend-style selective recompute), one layer
    at a time, so that a consumer can run each layer as its codes arrive. ``positions`` [S] (sorted,
    unique) are recomputed from their residual-stream states; every other position's pre-RoPE K/V
    are given per layer. The recomputed positions attend to every position up to their own (the
    given K/V elsewhere, their own new K/V). The masks, RoPE tables and position embeddings are
    built once for the run. With the adapter's ``CHUNKED_SDPA`` attention the queries attend in
    ``query_chunks`` chunks of consecutive positions, each over the keys up to its last position."""

    query_chunks = 4
    """Chunks of the recomputed positions for attention, at most. Four measured best at ~350 of 1,000
    positions on a CPU: 13.2 ms per layer in one, 9.3 in four, 10.5 in eight."""
    min_chunk_positions = 64
    """Fewer recomputed positions per chunk than this are not worth another kernel call."""

    def __init__(self, adapter: "ModelAdapter", positions: torch.Tensor, n_tokens: int):
        self.adapter = adapter
        dev, dt = adapter.device, adapter.dtype
        self.positions = positions.to(dev)
        pos = self.positions.view(1, -1)
        self._pos = pos
        self.cos, self.sin = adapter.rope_tables(n_tokens)  # [1, 1, T, D]
        self.pe = (self.cos[:, 0, self.positions], self.sin[:, 0, self.positions])
        kpos = torch.arange(n_tokens, device=dev)
        allowed = kpos.view(1, -1) <= pos.view(-1, 1)  # [S, T] causal by position
        masks = {"full_attention": allowed}
        window = getattr(adapter.config, "sliding_window", None)
        if window:
            masks["sliding_attention"] = allowed & (kpos.view(1, -1) > pos.view(-1, 1) - window)
        neg = torch.finfo(dt).min
        self.masks = {kind: torch.zeros(m.shape, dtype=dt, device=dev).masked_fill(~m, neg)[None, None]
                      for kind, m in masks.items()}
        s = len(self.positions)
        c = max(1, min(self.query_chunks, s // self.min_chunk_positions))
        bounds = [i * s // c for i in range(c + 1)]
        ends = (self.positions[[b - 1 for b in bounds[1:]]] + 1).tolist()
        self.chunks = {kind: [(a, b, n, m[..., a:b, :n].contiguous()) for a, b, n in zip(bounds, bounds[1:], ends)]
                       for kind, m in self.masks.items()}
        self._cache = _ScatterCache(self)

    @torch.inference_mode()
    def step(self, x: torch.Tensor, layer: int, keys: torch.Tensor, values: torch.Tensor, correct=None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run ``layer`` for the recomputed positions: ``x`` [1, S, d] their residual-stream input,
        ``keys``/``values`` [1, H, T, D] every position's given pre-RoPE K/V. ``correct(k, v,
        native_k, native_v)``, if given, returns every position's K/V adjusted from the recomputed
        positions' own (pre-RoPE, [1, H, S, D]) before they are attended to. Returns the positions'
        residual output and the layer's K/V, the recomputed positions' replaced by their own."""
        a = self.adapter
        dev, dt = a.device, a.dtype
        c = self._cache
        c.keys, c.values, c.correct = keys.to(dev, dt), values.to(dev, dt), correct
        with a._capture_keys(layer, c):
            kind = a.layer_type(layer)
            out = a.layers[layer](x.to(dev, dt), attention_mask=self.masks[kind], position_ids=self._pos,
                                  position_embeddings=self.pe, scd_query_chunks=self.chunks[kind],
                                  **{a._layer_cache_kw: c})
        k, v = c.keys, c.values
        c.keys = c.values = c.native_k = c.correct = None
        return out, k, v
