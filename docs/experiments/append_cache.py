# Research script (issue 16, fifteenth round), kept so that docs/scd-speed.md's in-place append numbers can be rerun:
#   .venv/bin/python docs/experiments/append_cache.py
# The twelfth round noted that transformers' DynamicLayer concatenates every cached position to append one token
# and estimated an in-place append at ~8% of a decode step. This measures it: AppendLayer (below) keeps K/V in
# buffers with spare room and writes new positions into them; the strong consumer decodes 40 greedy steps from
# its own prefill of a random 1,000- and 2,000-token prompt, one thread, the two caches stepped alternately
# (so drift of the machine hits both), median step time. Not part of the package; excluded from lint.
from __future__ import annotations

import statistics as st
import time

import torch
from transformers.cache_utils import DynamicLayer

from shared.model.hf_adapter import clone_cache
from tools.cli.common import pair_models

SPARE = 64  # room for this many appends (the probe makes 40)


class AppendLayer(DynamicLayer):
    """A full-attention cache layer that writes new positions into a buffer with spare room; ``keys``
    and ``values`` are views of its first n positions. Enough for appends only (no crop, no reorder)."""

    def update(self, key_states, value_states, *args, **kwargs):
        n, t = self.keys.shape[2], key_states.shape[2]
        if not hasattr(self, "_buf") or n + t > self._buf[0].shape[2]:
            self._buf = tuple(torch.cat([c, new.new_empty(*new.shape[:2], t + SPARE, new.shape[3])], dim=2)
                              for c, new in ((self.keys, key_states), (self.values, value_states)))
        for buf, new in zip(self._buf, (key_states, value_states)):
            buf[:, :, n:n + t].copy_(new)
        self.keys, self.values = (buf[:, :, :n + t] for buf in self._buf)
        return self.keys, self.values


def appending(cache):
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            new = AppendLayer()
            new.__dict__.update(layer.__dict__)
            cache.layers[i] = new
    return cache


if __name__ == "__main__":
    torch.set_num_threads(1)
    C = pair_models("strong").consumer
    for T in (1000, 2000):
        ids = torch.randint(100, 40000, (T,), generator=torch.Generator().manual_seed(0)).tolist()
        base = C.own_cache(ids[:-1])
        caches = {"dyn": clone_cache(base), "app": appending(clone_cache(base))}
        toks = {m: ids[-1] for m in caches}
        times: dict[str, list[float]] = {m: [] for m in caches}
        logits: dict[str, list[torch.Tensor]] = {m: [] for m in caches}
        for s in range(40):
            for m in (("dyn", "app") if s % 2 else ("app", "dyn")):
                t0 = time.perf_counter()
                lg = C.forward_with_cache(caches[m], [toks[m]])[0, -1]
                toks[m] = int(lg.argmax())
                if s:
                    times[m].append(time.perf_counter() - t0)
                logits[m].append(lg)
        d, a = st.median(times["dyn"]) * 1e3, st.median(times["app"]) * 1e3
        diff = float((torch.stack(logits["dyn"]) - torch.stack(logits["app"])).abs().max())
        print(f"T={T} median step: DynamicLayer {d:.1f} ms, AppendLayer {a:.1f} ms, ratio {d / a:.3f}; "
              f"largest logit difference {diff:.1e}")
