"""Quality on held-out prompts for a candidate SCD configuration, and the paper's Appendix A
layer selection: restore-one sensitivity, then a greedy budgeted search (gain per unit cost)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from shared.model.hf_adapter import ModelAdapter, PrefillState, clone_cache, from_rows
from tools.calibration.memory import release_memory
from tools.calibration.spill import SpillDir, SpilledState, spill
from tools.eval.metrics import kl_top1


def heads(x: torch.Tensor, model: ModelAdapter) -> torch.Tensor:
    return from_rows(x, model.n_kv_heads, model.head_dim)


@dataclass
class ValPrompt:
    """A held-out prompt with everything a configuration's quality needs, computed once."""

    ids: list[int]
    start: int  # native prefix length
    state: PrefillState | SpilledState  # producer prefill with hidden and residual states of every layer
    prefix_kv: list[tuple[torch.Tensor, torch.Tensor]]  # consumer's own pre-RoPE K/V for [0, start)
    target: list[int]  # teacher-forced tokens: the Oracle's greedy continuation
    oracle_lp: torch.Tensor  # [N, V]


def prepare_val(producer: ModelAdapter, consumer: ModelAdapter, prompts: Sequence[tuple],
                n_new: int = 16, progress: bool = True, stop_ids: Sequence[int] = (),
                spill_to: SpillDir | None = None, states: Sequence | None = None) -> list[ValPrompt]:
    """Held-out prompts scored like ``scd eval`` scores the test split. Each prompt is (ids, fixed-prefix
    length) or (ids, fixed-prefix length, held-out continuation): a prompt with a continuation (LM
    text) is scored on its first ``n_new`` tokens, teacher-forced; any other on the Oracle's greedy
    continuation of up to ``n_new`` tokens, ending at a stop id (the answer). The two differ in sign
    for REUSE codes on plain text (the Oracle's own greedy text flatters a code that real text does
    not), so LM text is never scored on the greedy continuation when it has its own. With ``spill_to``
    each producer state is written there and read back per tensor (see
    ``tools.calibration.spill``), so the set's memory does not grow with its tokens x layers.
    ``states``: the producer's prefill state of each prompt, computed earlier (the producer cache)."""
    out = []
    layers = list(range(producer.n_layers))
    for i, (ids, start, *given) in enumerate(tqdm(prompts, desc="validation set", disable=not progress)):
        ctx = ids[:-1]
        if states is not None:
            sp = states[i]
        else:
            sp = producer.prefill(ctx, hidden_layers=layers, residual_layers=layers)
        if spill_to is not None and states is None:
            sp = spill(sp, spill_to, i, producer.device)
        sc = consumer.prefill(ctx)
        cache = consumer.build_cache(sc.keys, sc.values)
        if given and len(given[0]):
            target = [int(t) for t in given[0][:n_new]]
        else:
            target = consumer.greedy(clone_cache(cache, consumer.config), ids[-1], n_new, stop_ids)
        lp = consumer.score(cache, ids[-1], target)[: len(target)]
        out.append(ValPrompt(ids, start, sp, [(k[:, :, :start].clone(), v[:, :, :start].clone())
                                              for k, v in zip(sc.keys, sc.values)], target, lp))
        del sc, cache
        release_memory()
    return out


def logprobs(vp: ValPrompt, kv: Callable[[int], tuple], model: ModelAdapter) -> torch.Tensor:
    """Teacher-forced log-probs [N, V] of ``vp.target`` from a cache whose positions [start, n) at
    each layer are ``kv(layer)`` (pre-RoPE K, V) after the consumer's own prefix."""
    ks, vs = [], []
    for layer in range(model.n_layers):
        k, v = kv(layer)
        pk, pv = vp.prefix_kv[layer]
        ks.append(torch.cat([pk, k.to(pk.dtype)], 2))
        vs.append(torch.cat([pv, v.to(pv.dtype)], 2))
    return model.score(model.build_cache(ks, vs), vp.ids[-1], vp.target)[: len(vp.target)]


def quality(vps: list[ValPrompt], kv: Callable[[int, int], tuple], model: ModelAdapter) -> float:
    """Mean teacher-forced KL(oracle ‖ config) over ``vps``; ``kv(i, layer)`` gives the config's
    pre-RoPE K/V of prompt i at layer for positions [start, n)."""
    kls = []
    for i, vp in enumerate(vps):
        kls.append(float(kl_top1(vp.oracle_lp, logprobs(vp, lambda l, i=i: kv(i, l), model))[0].mean()))
        release_memory()  # each prompt's cache is freed here; keep its pages from piling up
    return sum(kls) / len(kls)


def restore_one(candidates: list[int], base_kl: float, kl_with: Callable[[frozenset[int]], float],
                progress: bool = True) -> dict[int, float]:
    """Quality gain of patching each candidate layer alone (all others REUSE)."""
    return {l: base_kl - kl_with(frozenset([l])) for l in tqdm(candidates, desc="restore-one", disable=not progress)}


def greedy(pool: list[int], steps: int, base_kl: float, kl_with: Callable[[frozenset[int]], float],
           cost: Callable[[int], float], progress: bool = True) -> list[dict]:
    """Repeatedly add the layer with the largest marginal gain per unit cost; stops early when no
    layer improves quality. Returns the path: [{layer, kl, gain, gain_per_cost}, ...]."""
    chosen: frozenset[int] = frozenset()
    cur, path = base_kl, []
    for _ in tqdm(range(min(steps, len(pool))), desc="greedy", disable=not progress):
        best = None
        for l in pool:
            if l in chosen:
                continue
            kl = kl_with(chosen | {l})
            score = (cur - kl) / cost(l)
            if best is None or score > best[0]:
                best = (score, l, kl)
        if best is None or best[2] >= cur:
            break
        chosen = chosen | {best[1]}
        path.append({"layer": best[1], "kl": best[2], "gain": cur - best[2], "gain_per_cost": best[0]})
        cur = best[2]
    return path
