"""Offline profiling of DroidSpeak's recompute blocks on the validation split: greedily add the
contiguous block whose recompute lowers teacher-forced KL the most, until the recompute budget
(layers) is spent."""

from __future__ import annotations

import time

from tqdm import tqdm

from shared.calibration import selection as sel
from shared.model.hf_adapter import ModelAdapter


def profile(producer: ModelAdapter, consumer: ModelAdapter, val_prompts: list[tuple[list[int], int]],
            budget_layers: int = 12, block_len: int = 12, n_val: int = 24, progress: bool = True,
            stop_ids=()) -> dict:
    t0 = time.perf_counter()
    L = producer.n_layers
    vps = [(vp, vp.state.residual)  # the producer's prefill there already holds every layer's residual state
           for vp in sel.prepare_val(producer, consumer, val_prompts[:n_val], progress=False, stop_ids=stop_ids)]
    cands = [(a, min(a + block_len, L)) for a in range(0, L - 1)]
    recompute: dict = {}

    def block_kv(i, blk):
        if (i, blk) not in recompute:
            vp, res = vps[i]
            _, ks, vs = consumer.run_layers(res[blk[0]], blk[0], blk[1])
            s = vp.start
            recompute[(i, blk)] = [(k[:, :, s:], v[:, :, s:]) for k, v in zip(ks, vs)]
        return recompute[(i, blk)]

    def kl(blocks):
        def kv(i, layer):
            for blk in blocks:
                if blk[0] <= layer < blk[1]:
                    return block_kv(i, blk)[layer - blk[0]]
            vp = vps[i][0]
            return vp.state.keys[layer][:, :, vp.start:].half().float(), vp.state.values[layer][:, :, vp.start:].half().float()
        return sel.quality([v for v, _ in vps], kv, consumer)

    chosen: list[tuple[int, int]] = []
    base = cur = kl(chosen)
    path = []
    used = 0
    bar = tqdm(total=budget_layers, desc="droidspeak profile", disable=not progress)
    while used < budget_layers:
        best = None
        for blk in cands:
            if any(not (blk[1] <= a or blk[0] >= b) for a, b in chosen) or used + blk[1] - blk[0] > budget_layers:
                continue
            k = kl(chosen + [blk])
            if best is None or k < best[0]:
                best = (k, blk)
        if best is None or best[0] >= cur:
            break
        chosen.append(best[1])
        used += best[1][1] - best[1][0]
        cur = best[0]
        path.append({"block": list(best[1]), "kl": cur})
        bar.update(best[1][1] - best[1][0])
        recompute = {k: v for k, v in recompute.items() if k[1] in chosen}
    bar.close()
    return {"blocks": sorted([list(b) for b in chosen]), "budget_layers": budget_layers, "block_len": block_len,
            "report": {"raw_kl": base, "kl": cur, "path": path, "n_val": len(vps),
                       "seconds": round(time.perf_counter() - t0, 1)}}
