"""Paired producer/consumer traces on the same prompts, kept as running moments (REUSE, PCA) and a
row sample of hidden states per layer (aligners)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from shared.calibration.linalg import Moments
from shared.model.hf_adapter import ModelAdapter, to_rows as flat


@dataclass
class Traces:
    k: list[Moments]  # per layer, moments of [k_p | k_c]
    v: list[Moments]
    h: list[Moments]  # per layer, moments of the producer's h_l
    h_p: list[list[torch.Tensor]] = field(default_factory=list)  # per layer, sampled rows
    h_c: list[list[torch.Tensor]] = field(default_factory=list)
    n_prompts: int = 0
    n_tokens: int = 0

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.h_p[layer]), torch.cat(self.h_c[layer])


def collect(producer: ModelAdapter, consumer: ModelAdapter, prompts: list[list[int]], rows_per_layer: int = 4096,
            seed: int = 0, progress: bool = True) -> Traces:
    L, m, d = producer.n_layers, producer.kv_dim, producer.hidden_size
    tr = Traces([Moments(2 * m) for _ in range(L)], [Moments(2 * m) for _ in range(L)], [Moments(d) for _ in range(L)],
                [[] for _ in range(L)], [[] for _ in range(L)])
    g = torch.Generator().manual_seed(seed)
    per_prompt = max(1, rows_per_layer // max(1, len(prompts)))
    layers = list(range(L))
    for ids in tqdm(prompts, desc="traces", disable=not progress):
        ctx = ids[:-1]
        sp = producer.prefill(ctx, hidden_layers=layers)
        sc = consumer.prefill(ctx, hidden_layers=layers)
        T = len(ctx)
        pick = torch.randperm(T, generator=g)[:per_prompt]
        for l in layers:
            tr.k[l].add(torch.cat([flat(sp.keys[l]), flat(sc.keys[l])], 1).cpu())
            tr.v[l].add(torch.cat([flat(sp.values[l]), flat(sc.values[l])], 1).cpu())
            hp, hc = sp.hidden[l][0].cpu(), sc.hidden[l][0].cpu()
            tr.h[l].add(hp)
            tr.h_p[l].append(hp[pick].float().clone())
            tr.h_c[l].append(hc[pick].float().clone())
        tr.n_prompts += 1
        tr.n_tokens += T
    return tr
