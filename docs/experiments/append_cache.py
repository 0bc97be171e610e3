# Research script (issue 16, fifteenth round), kept so that docs/scd-speed.md's in-place append numbers can be rerun:
#   .venv/bin/python docs/experiments/append_cache.py
# The twelfth round noted that transformers' DynamicLayer concatenates every cached position to append one token
# and estimated an in-place append at ~8% of a decode step. This measures it: AppendLayer (below) keeps K/V in
# buffers with spare room and writes new positions into them; the strong consumer decodes 40 greedy steps from
# its own prefill of a random 1,000- and 2,000-token prompt, one thread, the two caches stepped alternately
# (so drift of the machine hits both), median step time. Not part of the package; excluded from lint.
from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

# Growth past the reserved room: at least this many positions, or a quarter of the current length.
MIN_SPARE = 64


class AppendLayer(DynamicLayer):
    """A full-attention cache layer that appends in place into spare capacity."""

    def __init__(self, spare: int = MIN_SPARE):
        super().__init__()
        self.spare = max(0, int(spare))
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    @classmethod
    def from_layer(cls, layer: DynamicLayer, spare: int) -> "AppendLayer":
        """The same layer (its tensors, not copied) with room for ``spare`` more positions at its
        next growth."""
        new = cls(spare)
        state = {k: v for k, v in layer.__dict__.items() if k not in ("_kbuf", "_vbuf", "spare")}
        new.__dict__.update(state)
        return new

    @staticmethod
    def _prefix_of(t: torch.Tensor, buf: torch.Tensor | None) -> bool:
        """Whether ``t`` is ``buf[..., :n, :]``."""
        return (buf is not None and t.dim() == 4 and t.numel() > 0 and t.data_ptr() == buf.data_ptr()
                and t.dtype == buf.dtype and t.shape[:2] == buf.shape[:2] and t.shape[3] == buf.shape[3]
                and t.stride() == buf.stride())

    def _room(self, n: int, k: torch.Tensor, v: torch.Tensor) -> bool:
        kb, vb = self._kbuf, self._vbuf
        if kb is None or vb is None or n == 0:
            return False
        if not (self._prefix_of(self.keys, kb) and self._prefix_of(self.values, vb)):
            return False
        return (n + k.shape[2] <= kb.shape[2] and n + v.shape[2] <= vb.shape[2]
                and k.shape[:2] == kb.shape[:2] and k.shape[3] == kb.shape[3] and k.dtype == kb.dtype
                and v.shape[:2] == vb.shape[:2] and v.shape[3] == vb.shape[3] and v.dtype == vb.dtype
                and k.device == kb.device and v.device == vb.device)

    def _grow(self, cur: torch.Tensor, new: torch.Tensor, need: int) -> torch.Tensor:
        cap = need + max(self.spare, MIN_SPARE, need // 4)
        buf = new.new_empty((new.shape[0], new.shape[1], cap, new.shape[3]))
        n = cur.shape[2] if cur.numel() else 0
        if n:
            buf[:, :, :n].copy_(cur)
        return buf

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.get_seq_length()
        t = key_states.shape[2]
        if not self._room(n, key_states, value_states):
            self._kbuf = self._grow(self.keys, key_states, n + t)
            self._vbuf = self._grow(self.values, value_states, n + value_states.shape[2])
            self.spare = MIN_SPARE  # the reserved room is used once; later growth is geometric
        kb, vb = self._kbuf, self._vbuf
        assert kb is not None and vb is not None
        kb[:, :, n:n + t].copy_(key_states)
        vb[:, :, n:n + value_states.shape[2]].copy_(value_states)
        self.keys, self.values = kb[:, :, :n + t], vb[:, :, :n + value_states.shape[2]]
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self._kbuf = self._vbuf = None  # never write over positions an earlier view still shows

    def reset(self) -> None:
        super().reset()
        self._kbuf = self._vbuf = None


def reserve(cache, spare):
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = AppendLayer.from_layer(layer, spare)
    return cache


if __name__ == "__main__":
    import statistics as st
    import time

    from shared.model.hf_adapter import clone_cache
    from tools.cli.common import pair_models

    torch.set_num_threads(1)
    C = pair_models("strong").consumer
    for T in (1000, 2000):
        ids = torch.randint(100, 40000, (T,), generator=torch.Generator().manual_seed(0)).tolist()
        base = C.own_cache(ids[:-1])
        caches = {"dyn": clone_cache(base), "app": reserve(clone_cache(base), 64)}
        toks = {m: ids[-1] for m in caches}
        times: dict[str, list[float]] = {m: [] for m in caches}
        for s in range(40):
            for m in (("dyn", "app") if s % 2 else ("app", "dyn")):
                t0 = time.perf_counter()
                toks[m] = int(C.forward_with_cache(caches[m], [toks[m]])[0, -1].argmax())
                if s:
                    times[m].append(time.perf_counter() - t0)
        d, a = st.median(times["dyn"]) * 1e3, st.median(times["app"]) * 1e3
        print(f"T={T} median step: DynamicLayer {d:.1f} ms, AppendLayer {a:.1f} ms, ratio {d / a:.3f}; "
              f"same tokens {toks['dyn'] == toks['app']}")
