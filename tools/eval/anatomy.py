"""``scd anatomy``: where a pair's drift lives, measured on validation prompts.

Each probe replaces the transferred (raw) K/V of some layers and scores the Oracle's answer
teacher-forced, like ``scd eval``: the consumer's own K/V on a layer range (the ceiling of fixing
those layers), full-rank per-token ridge maps of the producer's state (the ceiling of per-token
maps), and the consumer's own layers recomputed from the producer's residual state (a block).
This is the measurement behind the PATCH block; it is an analysis command, not a transfer method.
"""

from __future__ import annotations

from typing import Callable

import torch
from tqdm import tqdm

from shared.model.hf_adapter import ModelAdapter, to_rows
from tools.calibration import selection as sel
from tools.calibration.linalg import Moments, ridge
from tools.calibration.scoring import Scorer, droidspeak_sides


def _ridge_maps(moms: list[Moments], n_in: int, lam_rel: float = 1e-3):
    """Per layer (A, mean_in, mean_out) of the full-rank ridge map from the first ``n_in`` columns
    to the rest."""
    out = []
    for mo in moms:
        c, mu = mo.cov(), mo.mean
        cxx = c[:n_in, :n_in]
        a = ridge(cxx, c[:n_in, n_in:], lam_rel * float(torch.trace(cxx)) / n_in)
        out.append((a.float(), mu[:n_in].float(), mu[n_in:].float()))
    return out


def default_probes(n_layers: int) -> dict:
    """The probes of the strong pair's 30-layer analysis, scaled to ``n_layers``."""
    f = n_layers / 30

    def at(x: float) -> int:
        return min(n_layers, max(0, round(x * f)))

    blocks = []
    for a, b in ((15, 25), (16, 24), (18, 25), (20, 25)):
        blk = (at(a), at(b))
        if blk[0] < blk[1] and blk not in blocks:
            blocks.append(blk)
    h = n_layers // 2
    return {"ranges": ((0, h), (h, n_layers)), "single": range(at(17), max(at(27), at(17) + 1)),
            "blocks": tuple(blocks)}


def run(producer: ModelAdapter, consumer: ModelAdapter, cal: list[list[int]], val: list[tuple[list[int], int]],
        stop_ids, ranges=((0, 15), (15, 30)), single=range(17, 27), blocks=((15, 25), (16, 24), (18, 25), (20, 25)),
        progress: bool = True) -> dict[str, float]:
    L, m, d = producer.n_layers, producer.kv_dim, producer.hidden_size
    layers = list(range(L))
    moms = [(Moments(d + 2 * m), Moments(4 * m)) for _ in layers]  # [h_p | kv_c], [kv_p | kv_c]
    for ids in tqdm(cal, desc="traces", disable=not progress):
        sp, sc = producer.prefill(ids[:-1], hidden_layers=layers), consumer.prefill(ids[:-1])
        for l in layers:
            kvp = torch.cat([to_rows(sp.keys[l]), to_rows(sp.values[l])], 1)
            kvc = torch.cat([to_rows(sc.keys[l]), to_rows(sc.values[l])], 1)
            moms[l][0].add(torch.cat([sp.hidden[l][0], kvc], 1).cpu())  # moments accumulate on the CPU
            moms[l][1].add(torch.cat([kvp, kvc], 1).cpu())
    vps = sel.prepare_val(producer, consumer, val, n_new=32, progress=progress, stop_ids=stop_ids)
    own = []
    for vp in vps:
        sc = consumer.prefill(vp.ids[:-1])
        own.append([(k[:, :, vp.start:], v[:, :, vp.start:]) for k, v in zip(sc.keys, sc.values)])

    def raw(i, l):  # the producer's K/V as raw transfer sends them (fp16)
        return (vps[i].state.keys[l][:, :, vps[i].start:].half().float(),
                vps[i].state.values[l][:, :, vps[i].start:].half().float())

    def mapped(maps, feat: Callable):
        def kv(i, l):
            x = feat(i, l).float()
            a, mx, my = (t.to(x.device) for t in maps[l])
            y = my + (x - mx) @ a
            return sel.heads(y[:, :m], consumer), sel.heads(y[:, m:], consumer)
        return kv

    probes: dict[str, Callable] = {"raw": raw}
    for a, b in ranges:
        probes[f"own K/V on layers {a}-{b - 1}"] = lambda i, l, a=a, b=b: own[i][l] if a <= l < b else raw(i, l)
    for s in single:
        probes[f"own K/V on layer {s}"] = lambda i, l, s=s: own[i][l] if l == s else raw(i, l)
    hmaps, kvmaps = _ridge_maps([mo[0] for mo in moms], d), _ridge_maps([mo[1] for mo in moms], 2 * m)
    probes["ridge map K/V -> K/V, every layer"] = mapped(kvmaps, lambda i, l: torch.cat([to_rows(x) for x in raw(i, l)],
                                                                                      1))
    probes["ridge map h_l -> K/V, every layer"] = mapped(hmaps, lambda i, l: vps[i].state.hidden[l][0, vps[i].start:])
    out = {name: sel.quality(vps, kv, consumer) for name, kv in tqdm(probes.items(), desc="probes",
                                                                     disable=not progress)}
    scorer = Scorer(producer, consumer, vps)
    for a, b in tqdm(blocks, desc="blocks", disable=not progress):  # a recompute block is DroidSpeak's transfer
        out[f"consumer recomputes {a}-{b - 1} from the producer's residual"] = scorer.kl(
            *droidspeak_sides(scorer, [(a, b)]))
    return out
