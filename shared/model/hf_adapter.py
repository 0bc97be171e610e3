"""The one module that touches transformers internals (with its token-sparse layer runs, ``sparse.py``).

Everything else in the project speaks in plain tensors:
keys/values are per layer ``[B, H_kv, T, D]`` with keys **pre-RoPE** (the output of ``k_proj``,
before the rotation), hidden states ``h_l`` are ``[B, T, d]`` (the output of layer l's input RMSNorm,
what ``k_proj``/``v_proj`` read), and a residual-stream state is the input of a decoder layer.

Supported families: Llama, Mistral, Qwen2, Qwen3, Gemma and Gemma 2. They share the HF module
layout ``model.model.layers[i].{input_layernorm, self_attn.{k,v}_proj}``, one ``rotate_half`` RoPE
for every layer (``model.model.rotary_emb``) and caches whose layers are full or sliding-window
attention (``config.layer_types``), which is what this adapter relies on. Qwen3's per-head key
norm is part of the key: keys are captured after ``k_norm``, before the rotation. An unsupported
family fails at load with the list of supported ones.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from shared.errors import ConfigError

if TYPE_CHECKING:
    from shared.model.sparse import _ScatterCache

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"})
# Families that transformers knows but this adapter refuses, and why (so the error says what to do).
REFUSED_MODEL_TYPES = {
    "gemma3": "its local and global layers use two different RoPE tables (rotary_emb per layer type)",
    "gemma3_text": "its local and global layers use two different RoPE tables (rotary_emb per layer type)",
    "phi": "it rotates only part of each head (partial_rotary_factor)",
    "phi3": "it fuses K and V into one qkv_proj",
    "gpt2": "it has no separate k_proj/v_proj and no RoPE",
    "smollm3": "some of its layers use no RoPE (no_rope_layers), which the pre-RoPE transfer of keys assumes every "
               "layer applies",
    "olmo2": "it has no norm before attention (post-norm: its norms follow attention and the MLP) and its k_norm "
             "spans every head at once, where the adapter captures the input norm's output and each head's keys",
}


def check_supported(model_type: str) -> None:
    """Raise UnsupportedModel naming the supported families when ``model_type`` is not one of them."""
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    why = f" ({REFUSED_MODEL_TYPES[model_type]})" if model_type in REFUSED_MODEL_TYPES else ""
    raise UnsupportedModel(f"model_type {model_type!r} is not supported{why}; supported families: "
                           f"{sorted(SUPPORTED_MODEL_TYPES)}")


class UnsupportedModel(ConfigError):
    """The model's family or configuration is not one the adapter can read and write."""


class PrefillCalledOff(Exception):
    """A prefill stopped between two layers because its ``stop`` said so (nobody waits for it any more)."""


@dataclass(frozen=True)
class PrefillState:
    """What one producer prefill yields, captured in a single forward pass."""

    keys: tuple[torch.Tensor, ...]  # per layer [B, H_kv, T, D], pre-RoPE
    values: tuple[torch.Tensor, ...]  # per layer [B, H_kv, T, D]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # normalized pre-attn input [B, T, d]
    residual: dict[int, torch.Tensor] = field(default_factory=dict)  # decoder-layer input [B, T, d]
    token_ids: torch.Tensor | None = None  # [B, T]
    last_logits: torch.Tensor | None = None  # [B, V] logits at the last position

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def n_tokens(self) -> int:
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        """The memory its tensors hold."""
        tensors = [*self.keys, *self.values, *self.hidden.values(), *self.residual.values(), self.token_ids,
                   self.last_logits]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _this_thread() -> Callable[[], bool]:
    """Whether the caller runs on the thread that made this check. Capture hooks sit on the model's
    modules, so they fire for every forward pass on them: one model may serve two engines in one
    process (a producer and a consumer of the same weights, each with its own worker thread), and
    a capture keeps only its own thread's tensors."""
    owner = threading.get_ident()
    return lambda: threading.get_ident() == owner


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """Per-layer K or V [1, H, T, D] -> token rows [T, H*D] (what the maps and codes work on)."""
    return x[0].transpose(0, 1).reshape(x.shape[2], -1)


def from_rows(x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Token rows [T, H*D] -> [1, H, T, D]."""
    return x.reshape(x.shape[0], n_heads, head_dim).transpose(0, 1).unsqueeze(0)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def kv_geometry(cfg) -> tuple[int, int, int, int, int]:
    """(layers, KV heads, head dim, hidden size, KV width = heads x head dim) of an HF config."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, cfg.hidden_size, cfg.num_key_value_heads * head_dim


class ModelAdapter:
    """Reads and writes the KV internals of one HF causal LM."""

    def __init__(self, model: PreTrainedModel):
        cfg = model.config
        check_supported(cfg.model_type)
        self.model = model.eval()
        self.config = cfg
        self.n_layers, self.n_kv_heads, self.head_dim, self.hidden_size, self.kv_dim = kv_geometry(cfg)
        params = inspect.signature(type(model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        layer_params = inspect.signature(type(model.model.layers[0]).forward).parameters
        self._layer_cache_kw = "cache" if "cache" in layer_params else "past_key_values"
        if getattr(cfg, "_attn_implementation", None) == "sdpa":  # the same attention, sparse runs in chunks
            from shared.model.sparse import CHUNKED_SDPA  # (registered on import)

            model.set_attn_implementation(CHUNKED_SDPA)

    # ------------------------------------------------------------------ basics
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def layers(self):
        return self.model.model.layers

    def _ids(self, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        t = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        return t.unsqueeze(0) if t.dim() == 1 else t

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # [B, T, H_kv*D] -> [B, H_kv, T, D]
        return x.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)

    def _rope(self, like: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + length, device=self.device).unsqueeze(0)
        return self.model.model.rotary_emb(like, position_ids=pos)  # each [1, T, D]

    def apply_rope(self, keys: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Rotate pre-RoPE keys [B, H, T, D] to positions start..start+T-1 with this model's RoPE."""
        return self.rotate(keys, *self.rope_tables(keys.shape[2], start))

    def rope_tables(self, length: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [1, 1, length, D] of positions start..start+length-1, for ``rotate``."""
        probe = torch.empty(1, 1, dtype=self.dtype, device=self.device)
        cos, sin = self._rope(probe, start, length)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys [B, H, T, D] rotated by tables from ``rope_tables`` (T positions)."""
        keys = keys.to(self.device, self.dtype)
        return keys * cos + rotate_half(keys) * sin

    # ------------------------------------------------------------------ capture
    @contextlib.contextmanager
    def _capture(
        self, kv_layers: Sequence[int], hidden_layers: Sequence[int], residual_layers: Sequence[int]
    ) -> Iterator[dict[str, dict[int, torch.Tensor]]]:
        out: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}, "h": {}, "r": {}}
        handles = []
        mine = _this_thread()

        def save(kind: str, idx: int, split: bool):
            def hook(_mod, _inp, output):
                if mine():
                    out[kind][idx] = self._split_heads(output) if split else output

            return hook

        def save_heads(kind: str, idx: int):
            def hook(_mod, _inp, output):  # a per-head norm's output [B, T, H, D]
                if mine():
                    out[kind][idx] = output.transpose(1, 2)

            return hook

        def save_input(idx: int):
            def hook(_mod, args, kwargs):
                if mine():
                    out["r"][idx] = args[0] if args else kwargs["hidden_states"]

            return hook

        try:
            for i in kv_layers:
                attn = self.layers[i].self_attn
                if hasattr(attn, "k_norm"):  # Qwen3: the key is k_norm(k_proj(x)), then RoPE
                    handles.append(attn.k_norm.register_forward_hook(save_heads("k", i)))
                else:
                    handles.append(attn.k_proj.register_forward_hook(save("k", i, True)))
                handles.append(attn.v_proj.register_forward_hook(save("v", i, True)))
            for i in hidden_layers:
                handles.append(self.layers[i].input_layernorm.register_forward_hook(save("h", i, False)))
            for i in residual_layers:
                handles.append(self.layers[i].register_forward_pre_hook(save_input(i), with_kwargs=True))
            yield out
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def _stoppable(self, stop: Callable[[], bool] | None) -> Iterator[None]:
        if stop is None:
            yield
            return
        mine = _this_thread()

        def check(_mod, _args):
            if mine() and stop():
                raise PrefillCalledOff("the prefill was called off")

        handles = [layer.register_forward_pre_hook(check) for layer in self.layers]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @torch.inference_mode()
    def prefill(
        self,
        ids: torch.Tensor | Sequence[int],
        hidden_layers: Sequence[int] = (),
        residual_layers: Sequence[int] = (),
        stop: Callable[[], bool] | None = None,
    ) -> PrefillState:
        """One forward pass over ``ids`` capturing pre-RoPE K/V at every layer, ``h_l`` at
        ``hidden_layers`` and the residual-stream input at ``residual_layers``. ``stop`` is asked
        before each layer: when it says True the pass ends there (``PrefillCalledOff``)."""
        ids = self._ids(ids)
        with self._capture(range(self.n_layers), hidden_layers, residual_layers) as cap, self._stoppable(stop):
            out = self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return PrefillState(
            keys=tuple(cap["k"][i] for i in range(self.n_layers)),
            values=tuple(cap["v"][i] for i in range(self.n_layers)),
            hidden=dict(cap["h"]),
            residual=dict(cap["r"]),
            token_ids=ids,
            last_logits=out.logits[:, -1].float(),
        )

    # ------------------------------------------------------------------ write
    def build_cache(
        self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], start: int = 0
    ) -> DynamicCache:
        """A consumer cache from per-layer pre-RoPE keys and values (applies this model's RoPE)."""
        if len(keys) != self.n_layers or len(values) != self.n_layers:
            raise ValueError(f"expected {self.n_layers} layers of K and V, got {len(keys)} and {len(values)}")
        cache = DynamicCache(config=self.config)
        for i, (k, v) in enumerate(zip(keys, values)):
            k = k.to(self.device, self.dtype)
            cache.update(self.apply_rope(k, start), v.to(self.device, self.dtype), i)
        return cache

    @staticmethod
    def cache_from_rotated(rotated: Sequence[tuple[torch.Tensor, torch.Tensor]], config) -> DynamicCache:
        """A cache holding these rotated K/V per layer. A full-attention layer takes the tensors as
        they are (``update`` would copy them onto an empty tensor); a sliding one goes through its
        own ``update``, which keeps its count of positions seen."""
        cache = DynamicCache(config=config)
        for i, (k, v) in enumerate(rotated):
            layer = cache.layers[i] if i < len(cache.layers) else None
            if type(layer) is DynamicLayer:
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
            else:
                cache.update(k, v, i)
        return cache

    @staticmethod
    def cache_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values held by ``cache`` at ``layer``."""
        lay: Any = cache.layers[layer]
        return lay.keys, lay.values

    @torch.inference_mode()
    def regenerate_kv(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Native pre-RoPE K and V of ``layer`` from a normalized pre-attention input [B, T, d]."""
        attn = self.layers[layer].self_attn
        h = hidden.to(self.device, self.dtype)
        k = self._split_heads(attn.k_proj(h))
        if hasattr(attn, "k_norm"):  # families with a per-head key norm (none supported today)
            k = attn.k_norm(k)
        return k, self._split_heads(attn.v_proj(h))

    @torch.inference_mode()
    def attention_mass(self, layer: int, residual: torch.Tensor, n_queries: int) -> torch.Tensor:
        """How much attention the last ``n_queries`` positions pay to each position [T] at ``layer``
        (summed over heads and queries), from residual-stream inputs [1, T, d] with the layer's own
        norm and projections."""
        x = self.layers[layer].input_layernorm(residual.to(self.device, self.dtype))
        k, _ = self.regenerate_kv(layer, x)
        return self.attention_mass_of(layer, x, k, n_queries)

    @torch.inference_mode()
    def attention_mass_of(self, layer: int, hidden: torch.Tensor, keys: torch.Tensor, n_queries: int) -> torch.Tensor:
        """``attention_mass`` from the layer's normalized pre-attention input [1, T, d] (for the
        queries) and its pre-RoPE keys [1, H_kv, T, D], as a prefill captures them."""
        x = hidden.to(self.device, self.dtype)
        t = x.shape[1]
        nq = max(1, min(n_queries, t))
        q = self.apply_rope(self.queries(layer, x[:, t - nq:]), t - nq)
        k = self.apply_rope(keys.to(self.device, self.dtype), 0).repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim ** -0.5  # [1, H, nq, T]
        qpos = torch.arange(t - nq, t, device=self.device).view(-1, 1)
        scores = scores.masked_fill(torch.arange(t, device=self.device).view(1, -1) > qpos, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).sum(dim=(0, 1, 2))

    @torch.inference_mode()
    def kv_from_residual(self, layer: int, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Native pre-RoPE K and V of ``layer`` from its residual-stream input [B, T, d]."""
        norm = self.layers[layer].input_layernorm
        return self.regenerate_kv(layer, norm(residual.to(self.device, self.dtype)))

    @torch.inference_mode()
    def queries(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE queries [B, H_q, T, D] of ``layer`` from a normalized pre-attention input [B, T, d]."""
        attn = self.layers[layer].self_attn
        q = attn.q_proj(hidden.to(self.device, self.dtype))
        b, t, _ = q.shape
        q = q.view(b, t, -1, self.head_dim)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
        return q.transpose(1, 2)

    @torch.inference_mode()
    def run_layers(
        self, residual: torch.Tensor, first: int, last: int, start: int = 0
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Run decoder layers ``first..last-1`` over residual-stream states [B, T, d] at positions
        start.. (selective recompute). Returns the residual output and each layer's pre-RoPE K/V."""
        if not 0 <= first < last <= self.n_layers:
            raise ValueError(f"layer range must satisfy 0 <= first < last <= {self.n_layers}, got {first}..{last}")
        if start != 0:
            raise NotImplementedError("run_layers recomputes a prompt from position 0 only")
        x = residual.to(self.device, self.dtype)
        pos = torch.arange(x.shape[1], device=self.device).unsqueeze(0)
        masks = self._masks(x, pos)
        pe = self.model.model.rotary_emb(x, position_ids=pos)
        with self._capture(range(first, last), (), ()) as cap:
            for i in range(first, last):
                x = self.layers[i](x, attention_mask=masks[self.layer_type(i)], position_ids=pos,
                                   position_embeddings=pe)
        return x, [cap["k"][i] for i in range(first, last)], [cap["v"][i] for i in range(first, last)]

    @torch.inference_mode()
    def run_layers_sparse(
        self, residual: torch.Tensor, positions: torch.Tensor, keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor], first: int, last: int,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """Run decoder layers ``first..last-1`` for some positions only (``SparseLayers``, every
        layer of the range at once). ``residual`` [1, S, d] holds the residual-stream states of
        ``positions`` [S] (sorted); ``keys``/``values`` hold, per layer of the range, pre-RoPE K/V
        [1, H, T, D] of every position, taken as given for the positions not recomputed. Returns the
        residual output of ``positions`` and each layer's K/V, the recomputed positions replaced by
        native ones. With every position selected this is ``run_layers``."""
        if not 0 <= first < last <= self.n_layers:
            raise ValueError(f"layer range must satisfy 0 <= first < last <= {self.n_layers}, got {first}..{last}")
        if len(keys) != last - first or len(values) != last - first:
            raise ValueError(f"expected K/V of {last - first} layers, got {len(keys)} and {len(values)}")
        from shared.model.sparse import SparseLayers

        run = SparseLayers(self, positions, keys[0].shape[2])
        x, keys_out, values_out = residual, [], []
        for i in range(first, last):
            x, k, v = run.step(x, i, keys[i - first], values[i - first])
            keys_out.append(k)
            values_out.append(v)
        return x, keys_out, values_out

    @contextlib.contextmanager
    def _capture_keys(self, layer: int, cache: "_ScatterCache") -> Iterator[None]:
        """While ``layer`` runs, its pre-RoPE keys (after a per-head key norm, if any) go to ``cache``."""
        attn = self.layers[layer].self_attn
        mine = _this_thread()

        def save(_mod, _inp, output):
            if mine():
                cache.native_k = self._split_heads(output) if output.dim() == 3 else output.transpose(1, 2)

        h = (attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj).register_forward_hook(save)
        try:
            yield
        finally:
            h.remove()

    def layer_type(self, layer: int) -> str:
        """``full_attention`` or ``sliding_attention`` (Mistral, Qwen2/3 and Gemma 2 may slide)."""
        types = getattr(self.config, "layer_types", None)
        if types:
            return types[layer]
        return "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention"

    def _masks(self, x: torch.Tensor, pos: torch.Tensor) -> dict[str, object]:
        """The attention mask of each layer type for a prompt from position 0, as the model builds them."""
        kw = dict(config=self.config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos)
        types = {self.layer_type(i) for i in range(self.n_layers)}
        out: dict[str, object] = {}
        if "full_attention" in types:
            out["full_attention"] = create_causal_mask(**kw)
        if "sliding_attention" in types:
            out["sliding_attention"] = create_sliding_window_causal_mask(**kw)
        return out

    # ------------------------------------------------------------------ read out
    @torch.inference_mode()
    def forward_with_cache(self, cache: DynamicCache, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Logits [B, N, V] for ``ids`` placed after the cached tokens; extends ``cache`` in place."""
        out = self.model(input_ids=self._ids(ids), use_cache=True, **{self._cache_kw: cache})
        return out.logits.float()

    @torch.inference_mode()
    def greedy_steps(
        self, cache: DynamicCache, next_id: int, max_new_tokens: int, stop_ids: Sequence[int] = ()
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Greedy decode: feed ``next_id`` (the last prompt token, whose K/V the cache does not hold),
        yield (token, logits) per new token until ``max_new_tokens`` or a stop id."""
        tok = next_id
        for _ in range(max_new_tokens):
            logits = self.forward_with_cache(cache, [tok])[0, -1]
            tok = int(logits.argmax())
            yield tok, logits
            if tok in stop_ids:
                return

    def greedy(
        self, cache: DynamicCache, next_id: int, max_new_tokens: int, stop_ids: Sequence[int] = ()
    ) -> list[int]:
        return [t for t, _ in self.greedy_steps(cache, next_id, max_new_tokens, stop_ids)]

    @torch.inference_mode()
    def score(self, cache: DynamicCache, next_id: int, continuation: Sequence[int]) -> torch.Tensor:
        """Teacher-forced log-probs [N+1, V]: position 0 predicts continuation[0] from the cache plus
        ``next_id``; position j predicts continuation[j]; the last row predicts what follows."""
        ids = [next_id, *continuation]
        return torch.log_softmax(self.forward_with_cache(cache, ids)[0], dim=-1)

    @torch.inference_mode()
    def own_cache(self, ids: torch.Tensor | Sequence[int]) -> DynamicCache:
        """This model's own prefill cache of ``ids`` (the Oracle)."""
        return self.own_prefill(ids)[0]

    @torch.inference_mode()
    def own_prefill(self, ids: torch.Tensor | Sequence[int]) -> tuple[DynamicCache, torch.Tensor]:
        """This model's own prefill cache of ``ids`` and the logits [vocab] after the last of them."""
        out = self.model(input_ids=self._ids(ids), use_cache=True, logits_to_keep=1)
        return (out.cache if hasattr(out, "cache") else out.past_key_values), out.logits[0, -1].float()


def clone_cache(cache: DynamicCache, config=None) -> DynamicCache:
    """A deep copy (decoding extends a cache in place). A sliding-window layer keeps its count of
    positions seen, which a rebuild from its (cropped) tensors would lose."""
    return copy.deepcopy(cache)
