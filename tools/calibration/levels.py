"""The code levels stage: fewer int8 levels per kind of code, to a bytes target.

SCD's codes travel as int8 with a per-token scale; the wire's zstd entropy-codes them, so a code
quantized to fewer levels costs fewer bytes with no change of format. Starting from 256 levels
(8 bits) everywhere, each step lowers by one bit the kind of code (``z`` REUSE codes, ``qkv``
fallback K/V, ``r`` block entry states, ``u`` PATCH codes) whose step costs the least validation KL
per byte saved, until the wire bytes are at most ``target`` of raw fp16 K/V, as long as validation
KL stays within ``tolerance`` of its KL at 256 levels (a target out of reach stops there, it is
not bought with quality). Every candidate is
scored by the served method on the validation set (no memo: levels change what every layer
decodes) and its bytes are counted from real frames.
"""

from __future__ import annotations

import logging

from tqdm import tqdm

from shared.artifacts.meta import CODE_KINDS, ArtifactMeta
from shared.codecs.scd import code_kind
from tools.calibration.scoring import Scorer, scd_sides

log = logging.getLogger(__name__)

BYTES_PROMPTS = 4
"""Validation prompts whose frames measure a candidate's bytes per token."""


def candidate_bytes(scorer: Scorer, enc) -> float:
    """Mean wire bytes per transferred token of ``enc`` over the first validation prompts."""
    n = min(BYTES_PROMPTS, len(scorer.vps))
    return sum(scorer.bytes_per_token(enc, l, i) for i in range(n) for l in range(scorer.consumer.n_layers)) / n


def _cost(cur: dict, cand: dict) -> tuple[bool, float]:
    """Sort key of a step: the least KL per byte saved first; a step that saves no bytes ranks last."""
    saved = cur["bytes_per_token"] - cand["bytes_per_token"]
    return saved <= 0, (cand["kl"] - cur["kl"]) / saved if saved > 0 else cand["kl"] - cur["kl"]


def tune_levels(scorer: Scorer, meta: ArtifactMeta, prod: dict, cons: dict, target: float, tolerance: float,
                min_bits: int = 4, progress: bool = True) -> tuple[dict[str, int], dict]:
    """(levels per kind, report) for ``meta``'s SCD with these artifact tensors: the greedy descent
    above, stopping at ``target`` x raw fp16 bytes, when every step would take validation KL above
    ``(1 + tolerance)`` x its KL at 256 levels, or when no kind can go lower than ``min_bits``."""
    raw16 = scorer.consumer.n_layers * 2 * scorer.consumer.kv_dim * 2

    def score(levels: dict[str, int]) -> dict:
        enc, dec = scd_sides(scorer, meta.model_copy(update={"code_levels": levels}), prod, cons)
        kl = scorer.kl(enc, dec)
        nbytes = candidate_bytes(scorer, enc)
        return {"levels": dict(levels), "kl": kl, "by_kind": dict(scorer.last_by_kind), "bytes_per_token": nbytes,
                "bytes_vs_raw_fp16": nbytes / raw16}

    enc, _ = scd_sides(scorer, meta, prod, cons)
    vp = scorer.vps[0]
    kinds = sorted({code_kind(name) for l in range(scorer.consumer.n_layers)
                    for name in enc.encode_layer(vp.state, l, vp.start)} & set(CODE_KINDS))
    cur = score({})
    path, bound = [cur], cur["kl"] * (1 + tolerance)
    with tqdm(desc="code levels", disable=not progress) as bar:
        while cur["bytes_vs_raw_fp16"] > target:
            cands = []
            for k in kinds:
                bits = cur["levels"].get(k, 8)
                if bits > min_bits:
                    cands.append(score({**cur["levels"], k: bits - 1}))
                    bar.update()
            ok = [c for c in cands if c["kl"] <= bound]
            if not ok:
                why = "every step exceeds the KL bound" if cands else f"every kind at {min_bits} bits"
                path.append({"stopped": why,
                             "tried": [{"levels": c["levels"], "kl": c["kl"], "bytes_per_token": c["bytes_per_token"]}
                                       for c in cands]})
                break
            cur = min(ok, key=lambda c: _cost(cur, c))
            path.append({**cur, "tried": [{"levels": c["levels"], "kl": c["kl"],
                                           "bytes_per_token": c["bytes_per_token"]} for c in cands]})
    met = cur["bytes_vs_raw_fp16"] <= target
    if not met:
        log.warning("code levels: %s sends %.3fx raw fp16 bytes, over the target %.3fx: %s",
                    cur["levels"] or "256 levels", cur["bytes_vs_raw_fp16"], target, path[-1].get("stopped", ""))
    report = {"target": target, "tolerance": tolerance, "kl_bound": bound, "min_bits": min_bits, "kinds": kinds,
              "path": path, "met": met,
              "levels": cur["levels"], "kl": cur["kl"], "kl_256_levels": path[0]["kl"],
              "bytes_vs_raw_fp16": cur["bytes_vs_raw_fp16"]}
    return cur["levels"], report
