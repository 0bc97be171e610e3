"""Offline profiling of DroidSpeak's recompute blocks on the validation split: greedily add the
contiguous block whose recompute lowers teacher-forced KL the most, until the recompute budget
(layers) is spent."""

from __future__ import annotations

import time

from tqdm import tqdm

from shared.model.hf_adapter import ModelAdapter
from tools.calibration import selection as sel
from tools.calibration.scoring import Scorer, droidspeak_sides
from tools.calibration.spill import KVMemo, SpillDir


def profile(producer: ModelAdapter, consumer: ModelAdapter, val_prompts: list[tuple],
            budget_layers: int = 12, block_len: int = 12, n_val: int = 24, progress: bool = True,
            stop_ids=()) -> dict:
    """The blocks, greedily: each step adds the candidate block (of ``block_len`` layers, within the
    remaining budget, not overlapping the chosen ones) whose DroidSpeak transfer, as served, has the
    lowest validation KL; stops when no block lowers it."""
    t0 = time.perf_counter()
    L = producer.n_layers
    spill_dir = SpillDir()  # validation states and recomputed blocks on disk: memory does not grow with them
    vps = sel.prepare_val(producer, consumer, val_prompts[:n_val], progress=False, stop_ids=stop_ids,
                          spill_to=spill_dir)
    scorer = Scorer(producer, consumer, vps)
    memo = KVMemo(spill_dir, consumer.device)
    cands = [(a, min(a + block_len, L)) for a in range(0, L - 1)]
    chosen: list[tuple[int, int]] = []

    def kl(blocks: list[tuple[int, int]]) -> float:
        if not blocks:
            return scorer.kl(*scorer.pair("raw"))  # DroidSpeak without blocks is fp16 raw transfer
        return scorer.kl(*droidspeak_sides(scorer, sorted(blocks), memo, keep_blocks=chosen))

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
        keep = {f"block-{a}-{b}" for a, b in chosen}
        memo.forget(lambda tag, keep=keep: tag not in keep)
    bar.close()
    spill_dir.cleanup()
    return {"blocks": sorted([list(b) for b in chosen]), "budget_layers": budget_layers, "block_len": block_len,
            "report": {"raw_kl": base, "kl": cur, "path": path, "n_val": len(vps),
                       "seconds": round(time.perf_counter() - t0, 1)}}
