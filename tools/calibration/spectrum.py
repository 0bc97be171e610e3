"""SpectrumKV's deployment-time int4 probe for a pair: on a few validation prompts, run the
aggressive three-tier policy (fp16 + int8 + int4 at a low budget) and compare the consumer's
teacher-forced predictions with those it makes from the same producer K/V in fp16. int4 is allowed
when top-1 agreement, over the trials' teacher-forced tokens, is at least ``min_top1`` (the paper's
NIAH trials play this role on 7B models; a 135M model cannot retrieve needles, so agreement with the
fp16 transfer is the stand-in)."""

from __future__ import annotations

import time

from shared.model.hf_adapter import ModelAdapter
from tools.calibration import selection as sel
from tools.calibration.scoring import Scorer
from tools.eval.metrics import kl_top1


def probe(producer: ModelAdapter, consumer: ModelAdapter, val_prompts: list[tuple],
          budget: float = 0.3, trials: int = 3, min_top1: float = 0.9, n_new: int = 32,
          progress: bool = True) -> dict:
    """int4 allowed when the served three-tier spectrum transfer agrees with the served fp16 raw
    transfer on at least ``min_top1`` of the trials' teacher-forced tokens."""
    t0 = time.perf_counter()
    vps = sel.prepare_val(producer, consumer, val_prompts[:trials], n_new=n_new, progress=progress)
    scorer = Scorer(producer, consumer, vps)
    raw = scorer.pair("raw")
    policies = {policy: scorer.pair("spectrum", {"budget": str(budget), "int4": int4})
                for policy, int4 in (("three_tier", "on"), ("two_tier", "off"))}
    runs = []
    for i, vp in enumerate(vps):
        ref = scorer.logprobs(*raw, i)
        row = {}
        for policy, sides in policies.items():
            lp = scorer.logprobs(*sides, i)
            agree = float((lp.argmax(-1) == ref.argmax(-1)).float().mean())
            row[policy] = {"top1_vs_fp16": agree, "kl_vs_fp16": float(kl_top1(ref, lp)[0].mean()),
                           "kl_vs_oracle": float(kl_top1(vp.oracle_lp, lp)[0].mean())}
        runs.append(row)
    top1 = sum(r["three_tier"]["top1_vs_fp16"] for r in runs) / len(runs)
    return {"int4": top1 >= min_top1, "report": {"budget": budget, "min_top1": min_top1, "three_tier_top1": top1,
                                                 "n_new": n_new, "trials": runs,
                                                 "seconds": round(time.perf_counter() - t0, 1)}}
