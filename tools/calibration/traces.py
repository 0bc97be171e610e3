"""Paired producer/consumer traces on the same prompts, kept as running moments (REUSE, PCA) and a
row sample of hidden states per layer (aligners)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from shared.model.hf_adapter import ModelAdapter
from shared.model.hf_adapter import to_rows as flat
from tools.calibration.linalg import Moments
from tools.calibration.memory import release_memory


@dataclass
class Traces:
    kv: list[Moments]  # per layer, moments of [k_p | v_p | k_c | v_c]
    h: list[Moments]  # per layer, moments of the producer's h_l
    h_p: list[list[torch.Tensor]] = field(default_factory=list)  # per layer, sampled rows
    h_c: list[list[torch.Tensor]] = field(default_factory=list)
    n_prompts: int = 0
    n_tokens: int = 0

    def k(self, layer: int) -> Moments:
        """Moments of [k_p | k_c] (the separate K code)."""
        m = self.kv[layer].sum.numel() // 4
        return self.kv[layer].sub(torch.cat([torch.arange(0, m), torch.arange(2 * m, 3 * m)]))

    def v(self, layer: int) -> Moments:
        m = self.kv[layer].sum.numel() // 4
        return self.kv[layer].sub(torch.cat([torch.arange(m, 2 * m), torch.arange(3 * m, 4 * m)]))

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.h_p[layer]), torch.cat(self.h_c[layer])


def collect(producer: ModelAdapter, consumer: ModelAdapter, prompts: list[list[int]], rows_per_layer: int = 4096,
            seed: int = 0, progress: bool = True) -> Traces:
    L, m, d = producer.n_layers, producer.kv_dim, producer.hidden_size
    tr = Traces([Moments(4 * m) for _ in range(L)], [Moments(d) for _ in range(L)], [[] for _ in range(L)],
                [[] for _ in range(L)])
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
            rows = torch.cat([flat(sp.keys[l]), flat(sp.values[l]), flat(sc.keys[l]), flat(sc.values[l])], 1)
            tr.kv[l].add(rows.cpu())
            hp, hc = sp.hidden[l][0].cpu(), sc.hidden[l][0].cpu()
            tr.h[l].add(hp)
            tr.h_p[l].append(hp[pick].float().clone())
            tr.h_c[l].append(hc[pick].float().clone())
        tr.n_prompts += 1
        tr.n_tokens += T
        del sp, sc
        release_memory()
    return tr
