"""Calibration of the cross-model ridge mapper (seed 004, third abstract): for every consumer layer
and KV head, a closed-form ridge map from the concatenated K/V of the top-k most predictive
producer layers (same head, keys pre-RoPE so the map is position-free) to the consumer's K/V.

All maps come from one pass over the calibration prompts: per KV head, the running moments of the
producer's K|V of every layer against the consumer's K|V of every layer. Source layers are ranked per target
layer by their single-layer R^2 (averaged over heads); ``top_k`` and the ridge strength are chosen
from a small grid by teacher-forced KL on the validation split."""

from __future__ import annotations

import itertools
import time

import torch
from tqdm import tqdm

from shared.codecs import CodecContext
from tools.calibration import selection as sel
from tools.calibration.linalg import ridge
from tools.calibration.scoring import Scorer
from tools.calibration.spill import SpillDir


def _feats(state, n_layers: int) -> torch.Tensor:
    """[H, T, n_layers * 2D]: per head, each layer's [K | V] rows side by side."""
    return torch.cat([torch.cat([state.keys[l][0], state.values[l][0]], -1) for l in range(n_layers)], -1).float()


class PairMoments:
    """Running moments of one KV head's producer features x (every layer's [K|V]) and consumer
    targets y: x's mean and Gram, the cross product x^T y, and only the per-layer diagonal blocks
    of y's Gram (nothing needs the rest), in float64."""

    def __init__(self, n_layers: int, w: int):
        d = n_layers * w
        self.n, self.w = 0, w
        self.sx, self.sy = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
        self.xx, self.xy = torch.zeros(d, d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64)
        self.yy = torch.zeros(n_layers, w, w, dtype=torch.float64)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.n += x.shape[0]
        self.sx += x.sum(0, dtype=torch.float64)
        self.sy += y.sum(0, dtype=torch.float64)
        self.xx += (x.T @ x).double()
        self.xy += (x.T @ y).double()
        yb = y.reshape(y.shape[0], -1, self.w).transpose(0, 1)  # [L, T, w]
        self.yy += (yb.transpose(1, 2) @ yb).double()

    def blocks(self, xi: torch.Tensor, tgt: int):
        """Centred (Cxx, Cxy, Cyy) for source columns ``xi`` and target layer ``tgt``, and the means."""
        n, w = max(self.n, 1), self.w
        yi = torch.arange(tgt * w, (tgt + 1) * w)
        mx, my = self.sx[xi] / n, self.sy[yi] / n
        cxx = self.xx[xi][:, xi] / n - torch.outer(mx, mx)
        cxy = self.xy[xi][:, yi] / n - torch.outer(mx, my)
        cyy = self.yy[tgt] / n - torch.outer(my, my)
        return cxx, cxy, cyy, mx, my


def collect(producer, consumer, prompts: list[list[int]], progress: bool = True) -> list[PairMoments]:
    L, H, D = producer.n_layers, producer.n_kv_heads, producer.head_dim
    moms = [PairMoments(L, 2 * D) for _ in range(H)]
    for ids in tqdm(prompts, desc="ridge traces", disable=not progress):
        xp, xc = _feats(producer.prefill(ids[:-1]), L).cpu(), _feats(consumer.prefill(ids[:-1]), L).cpu()
        for h in range(H):
            moms[h].add(xp[h], xc[h])
    return moms


def _fit(mom: PairMoments, src: list[int], tgt: int, alpha: float):
    """Ridge from source-layer blocks to the target block: (W [k*w, w], bias [w], R^2)."""
    w = mom.w
    xi = torch.cat([torch.arange(s * w, (s + 1) * w) for s in src])
    cxx, cxy, cyy, mx, my = mom.blocks(xi, tgt)
    lam = alpha * float(torch.trace(cxx)) / len(xi)
    W = ridge(cxx, cxy, lam)
    sse = torch.trace(cyy) - 2 * torch.trace(W.T @ cxy) + torch.trace(W.T @ cxx @ W)
    r2 = 1 - float(sse / torch.trace(cyy).clamp_min(1e-30))
    return W, my - mx @ W, r2


def fit(moms: list[PairMoments], n_layers: int, head_dim: int, top_k: int, alpha: float,
        ranking: list[list[int]] | None = None) -> tuple[dict[str, torch.Tensor], list[list[int]], list[float]]:
    """Maps for every target layer: tensors ``w.{l}`` [H, k*2D, 2D] (fp16), ``b.{l}`` [H, 2D] and
    ``src.{l}`` [k]; also the source ranking per target and the mean R^2 per target."""
    if ranking is None:
        ranking = []
        for t in range(n_layers):
            score = [sum(_fit(m, [s], t, alpha)[2] for m in moms) / len(moms) for s in range(n_layers)]
            ranking.append(sorted(range(n_layers), key=lambda s: -score[s]))
    tensors, r2s = {}, []
    for t in range(n_layers):
        src = sorted(ranking[t][:top_k])
        fits = [_fit(m, src, t, alpha) for m in moms]
        tensors[f"w.{t}"] = torch.stack([f[0] for f in fits]).to(torch.float16)
        tensors[f"b.{t}"] = torch.stack([f[1] for f in fits]).float()
        tensors[f"src.{t}"] = torch.tensor(src, dtype=torch.int32)
        r2s.append(sum(f[2] for f in fits) / len(fits))
    return tensors, ranking, r2s


def calibrate(producer, consumer, prompts: list[list[int]], val_prompts: list[tuple],
              top_ks=(1, 2, 3), alphas=(1e-3, 1e-2, 1e-1), n_val: int = 8, progress: bool = True, stop_ids=()):
    """(tensors, payload) for the pair: the best (top_k, alpha) on validation KL, with the grid."""
    t0 = time.perf_counter()
    L, D = producer.n_layers, producer.head_dim
    moms = collect(producer, consumer, prompts, progress)
    t_traces = time.perf_counter() - t0
    spill_dir = SpillDir()  # validation states on disk, read per layer
    vps = sel.prepare_val(producer, consumer, val_prompts[:n_val], progress=progress, stop_ids=stop_ids,
                          spill_to=spill_dir)
    scorer = Scorer(producer, consumer, vps)
    raw_kl = scorer.kl(*scorer.pair("raw"))
    grid, best, rankings = [], None, {}
    for alpha, k in tqdm(list(itertools.product(alphas, top_ks)), desc="ridge grid", disable=not progress):
        tensors, rankings[alpha], r2 = fit(moms, L, D, k, alpha, rankings.get(alpha))
        profiles = {"ridge": {"tensors": tensors}}  # the candidate maps, served by the ridge method itself
        kl = scorer.kl(*scorer.pair("ridge", producer_ctx=CodecContext(producer, profiles=profiles),
                                    consumer_ctx=CodecContext(consumer, profiles=profiles)))
        grid.append({"top_k": k, "alpha": alpha, "kl": kl, "mean_r2": sum(r2) / L})
        if best is None or kl < best[0]:
            best = (kl, k, alpha, tensors, r2)
    kl, k, alpha, tensors, r2 = best
    payload = {"top_k": k, "alpha": alpha, "sources": {str(l): tensors[f"src.{l}"].tolist() for l in range(L)},
               "report": {"raw_kl": raw_kl, "kl": kl, "grid": grid, "r2_per_layer": r2, "n_prompts": len(prompts),
                          "n_val": len(vps), "traces_seconds": round(t_traces, 1),
                          "seconds": round(time.perf_counter() - t0, 1)}}
    spill_dir.cleanup()
    return tensors, payload
