"""The fast search (``search=fast``): SCD's artifacts for a new consumer of an already-calibrated
producer in minutes, not the full search's tens of minutes.

Where the time goes in the full search (2 cores, 135M pair): tracing both models over 64 prompts,
preparing 24 validation prompts, and ~100 validation scorings (a 19-placement block scan, restore-one,
greedy PATCH layers, per-layer fallback, ablations). Here:

- the producer's side (its K/V on the calibration prompts, the moments of its hidden states, its
  validation prefill states) comes from ``ProducerCache``, computed once per producer;
- the consumer traces only ``fast_prompts`` prompts and fits its side (the REUSE maps);
- the block is screened every ``fast_stride`` layers on ``fast_screen`` validation prompts (with its
  exit layer unless ``block_exit_kv=off``), and the best placement is kept only if it beats REUSE alone
  on all ``fast_val`` prompts;
- no PATCH layers (they moved validation KL little once a block was chosen), no ablations;
- fallback layers are ranked from the traces (where the producer's own K/V are closer to the
  consumer's than the code's reconstruction) and only a few sets are scored, then the per-kind bound
  holds as in the full search (``fallback_bound``), adding layers a few at a time.

Everything selected is still scored by the served method on validation prompts, so the guarantee is
the full search's: on validation, neither ``scd`` nor ``scd-reuse`` is kept above the bound where a set
of fallback layers reaches it. What is lost is search breadth; the report says what was tried.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Sequence

import torch
from tqdm import tqdm

from shared.artifacts import store
from shared.model.hf_adapter import ModelAdapter
from shared.model.hf_adapter import to_rows as flat
from shared.version import VERSION
from tools.calibration import selection as sel
from tools.calibration.guard import fit_guards
from tools.calibration.linalg import Moments
from tools.calibration.memory import PeakRSS, release_memory, timed_stages
from tools.calibration.pipeline import _Run, _worst, bound_pick
from tools.calibration.producer_cache import ProducerCache
from tools.calibration.scoring import Scorer
from tools.calibration.settings import CalibrationSettings
from tools.calibration.spill import KVMemo, SpillDir
from tools.calibration.traces import Traces

log = logging.getLogger(__name__)


def producer_cache(producer: ModelAdapter, cal_prompts: list[list[int]], val_prompts: list[tuple],
                   cfg: CalibrationSettings, root=None) -> ProducerCache:
    """The producer cache the fast search of these prompts and settings uses (built or not)."""
    prompts = [p[: cfg.max_prompt_tokens] for p in cal_prompts[: cfg.fast_prompts]]
    val = [(list(v[0]), v[1], *map(list, v[2:])) for v in val_prompts[: cfg.fast_val]]
    return ProducerCache.for_prompts(producer, prompts, val, root)


def consumer_traces(cache: ProducerCache, consumer: ModelAdapter, progress: bool = True) -> Traces:
    """The traces the REUSE fit needs, from the cached producer K/V and one consumer pass per prompt."""
    L, m = consumer.n_layers, consumer.kv_dim
    tr = Traces([Moments(4 * m) for _ in range(L)], cache.hidden_moments())
    for i, ids in enumerate(tqdm(cache.prompts, desc="traces (consumer)", disable=not progress)):
        sc = consumer.prefill(ids[:-1])
        kp, vp = cache.kv(i)
        for l in range(L):
            tr.kv[l].add(torch.cat([flat(kp[l]), flat(vp[l]), flat(sc.keys[l]).cpu(), flat(sc.values[l]).cpu()], 1))
        tr.n_prompts += 1
        tr.n_tokens += len(ids) - 1
        del sc
        release_memory()
    return tr


def fallback_order(tr: Traces, run: _Run, layers: Sequence[int]) -> list[tuple[int, float]]:
    """REUSE layers by how much closer the producer's own K/V are to the consumer's than the code's
    reconstruction (share of the consumer's second moment; > 0: raw transfer is closer), best first."""
    out = []
    for l in layers:
        mom, w = tr.kv[l], 2 * run.m
        g = mom.gram / max(mom.n, 1)
        raw_err = torch.trace(g[w:, w:]) + torch.trace(g[:w, :w]) - 2 * torch.trace(g[:w, w:])
        code_err = run.maps0[l][0].rel_err ** 2 * torch.trace(g[w:, w:])
        out.append((l, float((code_err - raw_err) / torch.trace(g[w:, w:]).clamp_min(1e-30))))
    return sorted(out, key=lambda x: -x[1])


def _fallback(run: _Run, report: dict, key: str, order: list[tuple[int, float]], progress: bool,
              **kw) -> tuple[list[int], float]:
    """A few fallback sets ranked from the traces: none, half and all of the layers where raw
    transfer is closer; the best by validation KL; then the per-kind bound, adding the next layers
    in that order a quarter of the rest at a time. Recorded like the full search's."""
    cfg, by_kind = run.cfg, lambda: dict(run.scorer.last_by_kind)
    cands = [l for l, g in order if g > 0]
    cur = run.kl(**kw)
    path = [{"layers": [], "kl": cur, "by_kind": by_kind()}]
    for n in tqdm(sorted({len(cands) // 2, len(cands)} - {0}), desc=f"{key} sets", disable=not progress):
        kl = run.kl(fallback=cands[:n], **kw)
        path.append({"layers": sorted(cands[:n]), "kl": kl, "by_kind": by_kind()})
    b = min(path, key=lambda p: p["kl"])
    chosen, kl, kk = b["layers"], b["kl"], b["by_kind"]
    best = (chosen, kl, kk)
    limit = {k: cfg.fallback_bound * r for k, r in run.raw_by_kind.items()} if cfg.fallback_bound else {}
    rest = [l for l, _ in order if l not in chosen]
    step, bound_path = max(1, math.ceil(len(rest) / 4)), []
    while _worst(kk, limit) > 1 and rest:
        chosen, rest = sorted([*chosen, *rest[:step]]), rest[step:]
        kl = run.kl(fallback=chosen, **kw)
        kk = by_kind()
        bound_path.append({"layers": chosen, "kl": kl, "by_kind": kk})
    met = _worst(kk, limit) <= 1
    if not met:
        chosen, kl, kk = bound_pick(best, bound_path, limit)
        log.warning("%s: no fallback set tried holds validation KL within %.2fx raw's on every kind; keeping the "
                    "closest", key, cfg.fallback_bound)
    report[key] = {"kl_without": cur, "by_kind_without": path[0]["by_kind"], "order": order, "path": path,
                   "bound": limit, "bound_path": bound_path, "bound_met": met, "layers": chosen, "kl": kl,
                   "by_kind": kk}
    return chosen, kl


def calibrate_fast(producer: ModelAdapter, consumer: ModelAdapter, cal_prompts: list[list[int]],
                   val_prompts: list[tuple], cfg: CalibrationSettings, out: str,
                   data_hash: str = "", progress: bool = True, stop_ids: Sequence[int] = (),
                   val_kinds: Sequence[str] = (), cache_root=None) -> tuple[str, dict]:
    """The fast search; builds the producer cache first when it is missing (timed as its own stage)."""
    torch.manual_seed(cfg.seed)
    L = producer.n_layers
    report: dict = {"search": "fast"}
    rss = PeakRSS()
    stage = timed_stages(report, rss)
    t_all = t = time.perf_counter()
    cache = producer_cache(producer, cal_prompts, val_prompts, cfg, cache_root)
    report["producer_cache"] = {"path": str(cache.path), "hit": cache.ready}
    if not cache.ready:
        cache.build(progress)
        t = stage("producer_cache", t)
    tr = consumer_traces(cache, consumer, progress)
    t = stage("traces", t)
    run = _Run(producer, consumer, tr, cfg)
    report["layers"] = [{"layer": l, "kv_var_explained": run.maps0[l][0].var_explained,
                         "kv_rel_err": run.maps0[l][0].rel_err} for l in range(L)]
    t = stage("reuse_fit", t)

    spill_dir = SpillDir(cfg.spill_dir)
    kinds = list(val_kinds)[: len(cache.val)]
    vps = sel.prepare_val(producer, consumer, cache.val, n_new=cfg.val_tokens, progress=progress, stop_ids=stop_ids,
                          states=cache.val_states())
    full = run.scorer = Scorer(producer, consumer, vps, kinds)
    run.memo = KVMemo(spill_dir, consumer.device)
    t = stage("validation_prep", t)

    raw_kl = full.kl(*full.pair("raw"))
    run.raw_by_kind = dict(full.last_by_kind)
    base_kl = run.kl()
    report["validation"] = {"n": len(vps), "raw_kl": raw_kl, "raw_kl_by_kind": run.raw_by_kind,
                            "reuse_only_kl": base_kl}
    cur_kl = base_kl
    if cfg.block_layers:
        n, k = cfg.block_layers, min(cfg.fast_screen, len(vps))
        run.scorer = Scorer(producer, consumer, vps[:k], kinds[:k])  # a prefix: the memo's prompt indices hold
        run.exit_kv = cfg.block_exit_kv != "off"
        starts = sorted(set(range(0, L - n + 1, cfg.fast_stride)) | {L - n})
        screen = []
        for a0 in tqdm(starts, desc="block screen", disable=not progress):
            screen.append({"block": [a0, a0 + n], "kl": run.kl(block=(a0, a0 + n))})
            run.forget_blocks()
        run.scorer = full
        top = min(screen, key=lambda x: x["kl"])
        run.chosen_block = (top["block"][0], top["block"][1])
        kl = run.kl()
        report["block_scan"] = {"screen_prompts": k, "screen": screen, "best": top["block"], "kl": kl}
        if kl < base_kl:
            cur_kl = kl
        else:
            run.chosen_block, run.exit_kv = None, False
        run.forget_blocks()
        t = stage("patch_block", t)
    block = run.chosen_block
    report["patch_block"] = list(block) if block else None
    report["block_exit_kv"] = {"kept": run.exit_kv}
    report["validation"]["block_kl"] = cur_kl if block else None
    report["greedy_path"] = []

    fallback, reuse_fallback, sel_kl = [], [], cur_kl
    if cfg.fallback:
        skip = set(range(*block)) | ({block[1]} if run.exit_kv else set()) if block else set()
        free = [l for l in range(L) if l not in skip]
        fallback, sel_kl = _fallback(run, report, "fallback", fallback_order(tr, run, free), progress)
        reuse_fallback, _ = _fallback(run, report, "reuse_fallback", fallback_order(tr, run, range(L)), progress,
                                      no_block=True)
        t = stage("fallback", t)

    guard, layer_guard = 0.0, {}
    if (block and cfg.guard_margin) or cfg.layer_guard_margin:
        served = run.meta((), block, fallback=fallback, reuse_fallback=reuse_fallback)
        guard, layer_guard, guards = fit_guards(producer, served, run.reuse0[0], ((vp.state, vp.start) for vp in vps),
                                                cfg.guard_margin if block else 0.0, cfg.layer_guard_margin)
        report.update(guards)
        t = stage("guards", t)
    report["stage_seconds"]["total"] = round(time.perf_counter() - t_all, 2)
    report["peak_rss_mb"]["total"] = max(report["peak_rss_mb"].values())
    report["selected_kl"] = sel_kl
    rss.close()
    spill_dir.cleanup()
    import transformers

    meta = run.meta((), block, fallback=fallback, reuse_fallback=reuse_fallback).model_copy(update={
        "block_guard": guard, "layer_guard": layer_guard,
        "calibration": {"data_sha256": data_hash, "n_prompts": tr.n_prompts, "n_tokens": tr.n_tokens,
                        "settings": cfg.model_dump()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "scd": VERSION},
        "report": report})
    folder = store.save(out, meta, *run.reuse0)
    return str(folder), report
