"""``scd calibrate``: traces -> REUSE maps -> PATCH block scan -> the block's entry map -> PATCH
projections and aligners -> layer selection -> ablations -> code levels -> artifacts. Every
configuration is scored by the served SCD method on candidate artifacts
(``tools.calibration.scoring``), so what is selected is what the services run. Every stage is
timed and its peak memory reported; the artifact write is atomic, so an interrupted run is simply
restarted."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Sequence

import torch
from tqdm import tqdm

from shared.artifacts import store
from shared.artifacts.meta import ArtifactMeta
from shared.codecs.quant import dequantize_rows, quantize_rows
from shared.model.fingerprint import weights_fingerprint
from shared.model.hf_adapter import ModelAdapter
from shared.version import VERSION
from tools.calibration import selection as sel
from tools.calibration.aligner import train_aligner
from tools.calibration.guard import fit_guards
from tools.calibration.levels import tune_levels
from tools.calibration.linalg import fit_entry_map, fit_reuse, pca
from tools.calibration.memory import PeakRSS, estimate, timed_stages
from tools.calibration.scoring import Scorer, linear_aligner, patch_tensors, reuse_tensors, scd_sides
from tools.calibration.settings import CalibrationSettings
from tools.calibration.spill import KVMemo, SpillDir
from tools.calibration.traces import Traces, collect

log = logging.getLogger(__name__)


def _codes(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A code as the consumer receives it: int8 per token with an absmax scale, or fp16."""
    if bits == 16:
        return x.half().float()
    return dequantize_rows(*quantize_rows(x, 8))


class _Run:
    """One calibration: the fitted pieces, the validation set, and the scoring of candidates."""

    def __init__(self, producer: ModelAdapter, consumer: ModelAdapter, tr: Traces, cfg: CalibrationSettings):
        self.producer, self.consumer, self.tr, self.cfg = producer, consumer, tr, cfg
        self.scorer: Scorer
        self.memo: KVMemo
        self.L, self.m = producer.n_layers, producer.kv_dim
        self.fps = weights_fingerprint(producer.model), weights_fingerprint(consumer.model)
        self.maps0 = self.fit_joint(cfg.r_kv) if cfg.reuse_code == "joint" else self.fit(cfg.r_k, cfg.r_v)
        self.pcas = {l: pca(tr.h[l], cfg.r_h, cfg.center) for l in range(self.L)}
        self.reuse0 = reuse_tensors(self.maps0, cfg.reuse_code)
        self.chosen_block: tuple[int, int] | None = None
        self.exit_kv = False
        self.raw_by_kind: dict[str, float] = {}  # raw transfer's validation KL per kind of text
        self.aligners: dict[str, dict] = {}  # "linear" / "trained": (producer, consumer) PATCH tensors
        self.entry: dict[str, torch.Tensor] = {}  # the block entry map's consumer-side tensors, if kept

    # -------------------------------------------------------------------------- fits
    def fit(self, rk: int, rv: int) -> list[tuple]:
        """Per layer, the (K map, V map) of separate codes."""
        m, c = self.m, self.cfg
        return [(fit_reuse(self.tr.k(l), m, min(rk, m), c.ridge, c.center),
                 fit_reuse(self.tr.v(l), m, min(rv, m), c.ridge, c.center)) for l in range(self.L)]

    def fit_joint(self, r: int) -> list[tuple]:
        """Per layer, the (KV map,) of one joint code."""
        m, c = self.m, self.cfg
        return [(fit_reuse(self.tr.kv[l], 2 * m, min(r, 2 * m), c.ridge, c.center),) for l in range(self.L)]

    def patch_codes(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(u, target) rows of layer l: the producer's PATCH code as served (fp16 projection, then
        the wire's code) and the consumer's own normalized pre-attention input."""
        wh, mu_h, _ = self.pcas[l]
        hp, hc = self.tr.rows(l)
        return _codes((hp - mu_h.half().float()) @ wh.half().float(), self.cfg.code_bits), hc

    # -------------------------------------------------------------------------- candidates
    def meta(self, patch_layers=(), block=None, code: str | None = None, ranks: dict | None = None,
             layer_ranks: dict[int, int] | None = None, fallback=(), reuse_fallback=(),
             code_levels: dict[str, int] | None = None) -> ArtifactMeta:
        c = self.cfg
        code = code or c.reuse_code
        m = self.m  # the fits clip each rank to the width it codes; the meta says what was fit
        r = {"r_k": min(c.r_k, m), "r_v": min(c.r_v, m), "r_kv": min(c.r_kv, 2 * m) if code == "joint" else 0,
             **(ranks or {})}
        return ArtifactMeta(
            pair=c.pair, producer_fingerprint=self.fps[0], consumer_fingerprint=self.fps[1], n_layers=self.L,
            n_kv_heads=self.producer.n_kv_heads, head_dim=self.producer.head_dim,
            hidden_size=self.producer.hidden_size, r_h=c.r_h, reuse_code=code, code_bits=c.code_bits,
            center=c.center, patch_layers=sorted(patch_layers), patch_blocks=[block] if block else [],
            block_exit_kv=bool(block) and self.exit_kv, layer_ranks=layer_ranks or {},
            block_entry_map=bool(block) and bool(self.entry),
            fallback_layers=sorted(fallback), reuse_fallback_layers=sorted(reuse_fallback),
            aligner_hidden=c.aligner_hidden, code_channel=list(c.code_channel) if c.code_bits == 8 else [],
            code_levels=code_levels or {}, **r)

    def reuse_all(self, i: int):
        """Prompt i's REUSE decode of every layer by the served SCD (no patch, no block), kept on disk."""
        def compute():
            enc, dec = scd_sides(self.scorer, self.meta(), *self.reuse0)
            vp = self.scorer.vps[i]
            return {l: dec.decode_tensors(l, enc.encode_layer(vp.state, l, vp.start)) for l in range(self.L)}
        return self.memo.get("reuse", i, compute)

    def kl(self, patch_layers=(), aligners: str = "trained", block=None, maps=None, code: str | None = None,
           ranks: dict | None = None, layer_ranks: dict[int, int] | None = None, block_tokens: float = 1.0,
           fallback=(), no_block: bool = False) -> float:
        """Validation KL of SCD with these PATCH layers (and their ``aligners``), this block (default:
        the chosen one; ``no_block``: none), these REUSE maps (default: the calibrated ones) and the
        producer's own K/V on the ``fallback`` layers."""
        block = None if no_block else block or self.chosen_block
        prod, cons = self.reuse0 if maps is None else reuse_tensors(maps, code or self.cfg.reuse_code)
        if patch_layers:
            pp, pc = self.aligners[aligners]
            prod, cons = {**prod, **pp}, {**cons, **pc}
        cons = {**cons, **self.entry}
        meta = self.meta(patch_layers, block, code, ranks, layer_ranks, fallback)
        enc, dec = scd_sides(self.scorer, meta, prod, cons, self.memo, self.reuse_all if maps is None else None,
                             keep_blocks=[self.chosen_block] if self.chosen_block else [], block_tokens=block_tokens)
        return self.scorer.kl(enc, dec)

    def forget_blocks(self) -> None:
        """Drop the recomputed K/V of every block but the chosen one (which later stages reuse)."""
        keep = f"block-{self.chosen_block[0]}-{self.chosen_block[1]}" if self.chosen_block else None
        self.memo.forget(lambda tag: tag.startswith("block-") and (keep is None or not tag.startswith(keep)))

    def cost(self, layers: list[int]) -> dict[int, float]:
        """Gain-per-cost denominators: a PATCH layer's wire bytes over the REUSE layer's it replaces,
        both counted from real frames of the first validation prompt, plus its consumer compute."""
        enc, _ = scd_sides(self.scorer, self.meta(), *self.reuse0)
        out = {}
        pp, pc = self.aligners["trained"]
        for l in layers:
            penc, _ = scd_sides(self.scorer, self.meta([l]), {**self.reuse0[0], **pp}, {**self.reuse0[1], **pc})
            ratio = self.scorer.bytes_per_token(penc, l) / self.scorer.bytes_per_token(enc, l)
            out[l] = ratio + self.cfg.patch_compute_cost
        return out


def model_problems(cfg: CalibrationSettings, n_layers: int, kv_dim: int, hidden_size: int) -> list[str]:
    """The settings that do not fit a model of these sizes (its layers, K/V width, residual width),
    one line each: every one at once (a model smaller than the defaults assume failed on one per run)."""
    ranks = ((("r_kv", cfg.r_kv, 2 * kv_dim),) if cfg.reuse_code == "joint" else
             (("r_k", cfg.r_k, kv_dim), ("r_v", cfg.r_v, kv_dim)))
    out = []
    if cfg.block_layers >= n_layers:
        out.append(f"block_layers={cfg.block_layers} would recompute all {n_layers} layers (that is the Oracle); "
                   f"choose block_layers < {n_layers}, or 0 for no PATCH block")
    for name, r, width in (*ranks, ("r_h", cfg.r_h, hidden_size)):
        if r > width:
            out.append(f"{name}={r} is larger than the {width} numbers it codes; choose {name} <= {width}")
    return out


def not_fitting(problems: list[str]) -> str:
    return problems[0] if len(problems) == 1 else "settings that do not fit the model:\n" + "\n".join(
        f"  {p}" for p in problems)


def calibrate(producer: ModelAdapter, consumer: ModelAdapter, cal_prompts: list[list[int]],
              val_prompts: list[tuple], cfg: CalibrationSettings, out: str,
              data_hash: str = "", progress: bool = True, stop_ids: Sequence[int] = (),
              val_kinds: Sequence[str] = ()) -> tuple[str, dict]:
    """Fit and write the pair's artifacts into store ``out``; returns (folder, report). ``val_kinds``:
    the kind of text of each validation prompt (the fallback bound holds per kind)."""
    torch.manual_seed(cfg.seed)
    L, m = producer.n_layers, producer.kv_dim
    problems = model_problems(cfg, L, m, producer.hidden_size)
    if problems:
        raise ValueError(not_fitting(problems))
    report: dict = {}
    rss = PeakRSS()
    stage = timed_stages(report, rss)
    t_all = t = time.perf_counter()
    prompts = [p[: cfg.max_prompt_tokens] for p in cal_prompts[: cfg.n_prompts]]
    tr = collect(producer, consumer, prompts, cfg.aligner_rows, cfg.seed, progress)
    t = stage("traces", t)

    run = _Run(producer, consumer, tr, cfg)
    sep = run.maps0 if cfg.reuse_code == "separate" else run.fit(cfg.r_k, cfg.r_v)
    joint = run.maps0 if cfg.reuse_code == "joint" else run.fit_joint(cfg.r_kv)
    report["layers"] = [{"layer": l, "k_var_explained": sep[l][0].var_explained,
                         "v_var_explained": sep[l][1].var_explained, "k_rel_err": sep[l][0].rel_err,
                         "v_rel_err": sep[l][1].rel_err, "kv_var_explained": joint[l][0].var_explained,
                         "h_var_explained": run.pcas[l][2]} for l in range(L)]
    t = stage("reuse_fit", t)

    spill_dir = SpillDir(cfg.spill_dir)  # validation states and memoized K/V live on disk, not in memory
    vps = sel.prepare_val(producer, consumer, val_prompts[: cfg.n_val], n_new=cfg.val_tokens, progress=progress,
                          stop_ids=stop_ids, spill_to=spill_dir)
    scorer = run.scorer = Scorer(producer, consumer, vps, list(val_kinds)[: len(vps)])
    run.memo = KVMemo(spill_dir, consumer.device)
    t = stage("validation_prep", t)

    raw_kl = scorer.kl(*scorer.pair("raw"))
    run.raw_by_kind = dict(scorer.last_by_kind)
    base_kl = run.kl()
    other = "separate" if cfg.reuse_code == "joint" else "joint"
    other_kl = run.kl(maps=sep if other == "separate" else joint, code=other)
    report["validation"] = {"n": len(vps), "raw_kl": raw_kl, "raw_kl_by_kind": run.raw_by_kind,
                            "reuse_only_kl": base_kl,
                            f"reuse_only_kl_{cfg.reuse_code}": base_kl, f"reuse_only_kl_{other}": other_kl}
    cur_kl = base_kl
    if cfg.block_layers:  # where a PATCH block of the budgeted length earns most: slide it over the depth
        n = cfg.block_layers
        scan = []
        for a0 in tqdm(range(L - n + 1), desc="patch block", disable=not progress):
            scan.append({"block": [a0, a0 + n], "kl": run.kl(block=(a0, a0 + n))})
            run.forget_blocks()
        best = min(scan, key=lambda x: x["kl"])
        report["block_scan"] = scan
        if best["kl"] < base_kl:
            run.chosen_block, cur_kl = tuple(best["block"]), best["kl"]
        t = stage("patch_block", t)
    chosen_block = run.chosen_block
    report["patch_block"] = list(chosen_block) if chosen_block else None
    report["validation"]["block_kl"] = cur_kl if chosen_block else None
    if chosen_block and chosen_block[1] < L and cfg.block_exit_kv != "off":
        run.exit_kv = True
        exit_kl = run.kl()
        report["block_exit_kv"] = {"kl_without": cur_kl, "kl_with": exit_kl}
        if cfg.block_exit_kv == "on" or exit_kl <= cur_kl * (1 + cfg.tolerance):
            cur_kl = exit_kl
        else:
            run.exit_kv = False
        report["block_exit_kv"]["kept"] = run.exit_kv
        t = stage("block_exit", t)
    if chosen_block and cfg.block_min_layers < chosen_block[1] - chosen_block[0]:
        chosen_block, cur_kl = _shorten_block(run, report, cur_kl, progress)
        report["patch_block"] = list(chosen_block)
        report["validation"]["served_block_kl"] = cur_kl
        t = stage("block_length", t)
    if chosen_block and cfg.entry_map:
        cur_kl = _entry_map(run, report, prompts, cur_kl, progress)
        t = stage("entry_map", t)
    free = [l for l in range(L) if not (chosen_block and chosen_block[0] <= l < chosen_block[1] + run.exit_kv)]
    linear = {}
    for l in free:
        u, hc = run.patch_codes(l)
        linear[l] = linear_aligner(torch.linalg.lstsq(torch.cat([u, torch.ones(len(u), 1)], 1), hc).solution)
    run.aligners["linear"] = patch_tensors(run.pcas, linear)
    sens = sel.restore_one(free, cur_kl, lambda s: run.kl(s, "linear"), progress)
    report["sensitivity"] = [{"layer": l, "gain": g} for l, g in sens.items()]
    pool = [l for l, g in sorted(sens.items(), key=lambda kv: -kv[1]) if g > 0][: cfg.pool]
    t = stage("restore_one", t)

    aligners = {}
    for l in pool:
        u, hc = run.patch_codes(l)
        aligners[l], rep = train_aligner(u, hc, cfg.aligner_hidden, cfg.aligner_steps, seed=cfg.seed)
        report["layers"][l].update({f"aligner_{k}": v for k, v in rep.items()})
    run.aligners["trained"] = patch_tensors(run.pcas, aligners)
    t = stage("aligners", t)

    costs = run.cost(pool)
    report["patch_cost"] = {str(l): round(c, 4) for l, c in costs.items()}
    steps = max(cfg.budget_k, 8 if cfg.ablations else 0)
    path = sel.greedy(pool, steps, cur_kl, lambda s: run.kl(s), costs.get, progress)
    report["greedy_path"] = path
    chosen = [p["layer"] for p in path[: cfg.budget_k]]
    t = stage("greedy", t)

    sel_kl = path[len(chosen) - 1]["kl"] if chosen else cur_kl
    layer_ranks, maps = _pre_block_ranks(run, report, chosen, sel_kl, progress)
    if layer_ranks:
        sel_kl = report["pre_block_rank"]["kl"]
        t = stage("pre_block_ranks", t)

    fallback, reuse_fallback = [], []
    if cfg.fallback:
        fallback, sel_kl = _fallback(run, report, "fallback", progress, patch_layers=chosen, maps=maps,
                                     layer_ranks=layer_ranks)
        reuse_fallback, _ = _fallback(run, report, "reuse_fallback", progress, maps=maps,
                                      layer_ranks=layer_ranks, no_block=True)
        t = stage("fallback", t)

    if cfg.ablations:
        _ablations(run, report, path, chosen, cur_kl, progress)
        t = stage("ablations", t)

    prod_t, cons_t = run.reuse0 if maps is None else reuse_tensors(maps, cfg.reuse_code)
    pp, pc = patch_tensors(run.pcas, {l: aligners[l] for l in chosen})
    prod_t, cons_t = {**prod_t, **pp}, {**cons_t, **pc, **run.entry}
    levels = {}
    if cfg.bytes_target and cfg.code_bits == 8:  # last: fewer levels change what every memoized decode holds
        served = run.meta(chosen, chosen_block, layer_ranks=layer_ranks, fallback=fallback,
                          reuse_fallback=reuse_fallback)
        levels, report["code_levels"] = tune_levels(scorer, served, prod_t, cons_t, cfg.bytes_target,
                                                    cfg.levels_tolerance, cfg.code_levels_min, progress)
        sel_kl = report["code_levels"]["kl"]
        t = stage("code_levels", t)
    served = run.meta(chosen, chosen_block, layer_ranks=layer_ranks, fallback=fallback,
                      reuse_fallback=reuse_fallback, code_levels=levels)
    guard, layer_guard = 0.0, {}
    if (chosen_block and cfg.guard_margin) or cfg.layer_guard_margin:
        guard, layer_guard, guards = fit_guards(producer, served, prod_t, ((vp.state, vp.start) for vp in vps),
                                                cfg.guard_margin if chosen_block else 0.0, cfg.layer_guard_margin)
        report.update(guards)
        t = stage("guards", t)
    report["stage_seconds"]["total"] = round(time.perf_counter() - t_all, 2)
    report["peak_rss_mb"]["total"] = max(report["peak_rss_mb"].values())
    rss.close()
    spill_dir.cleanup()
    n_params = sum(p.numel() for p in producer.model.parameters())
    longest = max(max(len(p) for p in prompts), max(len(v[0]) for v in val_prompts[: cfg.n_val]))
    report["memory_model_mb"] = estimate(n_params, L, m, producer.hidden_size, producer.config.vocab_size, longest,
                                         len(vps), cfg.val_tokens, cfg.aligner_rows)
    report["selected_kl"] = sel_kl
    import transformers

    meta = served.model_copy(update={
        "block_guard": guard, "layer_guard": layer_guard,
        "calibration": {"data_sha256": data_hash, "n_prompts": tr.n_prompts, "n_tokens": tr.n_tokens,
                        "settings": cfg.model_dump()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "scd": VERSION},
        "report": report})
    folder = store.save(out, meta, prod_t, cons_t)
    return str(folder), report


def _entry_map(run: _Run, report: dict, prompts: list[list[int]], cur_kl: float, progress: bool) -> float:
    """Fit the chosen block's entry map and keep it if validation KL falls; returns the KL kept."""
    a = run.chosen_block[0]
    run.entry = fit_entry_map(run.producer, run.consumer, prompts, a, run.cfg.entry_map_ridge,
                              run.cfg.max_prompt_tokens, progress)
    blocks = lambda tag: tag.startswith("block-")  # noqa: E731 - the memoized blocks ran from the unmapped state
    run.memo.forget(blocks)
    kl = run.kl()
    kept = kl < cur_kl
    if not kept:
        run.entry = {}
        run.memo.forget(blocks)
    report["entry_map"] = {"layer": a, "kl_without": cur_kl, "kl_with": kl, "kept": kept}
    return kl if kept else cur_kl


def _shorten_block(run: _Run, report: dict, cur_kl: float, progress: bool) -> tuple[tuple[int, int], float]:
    """Shorten the chosen PATCH block from its end, two layers at a time down to ``block_min_layers``,
    while validation KL stays within ``tolerance`` of the full-length block's (with its exit layer
    as decided). Returns the block kept and its KL."""
    cfg = run.cfg
    a, b = run.chosen_block
    bound = cur_kl * (1 + cfg.tolerance)
    tried, kept = [{"layers": b - a, "kl": cur_kl}], (run.chosen_block, cur_kl)
    for n in tqdm(range(b - a - 2, cfg.block_min_layers - 1, -2), desc="block length", disable=not progress):
        kl = run.kl(block=(a, a + n))
        tried.append({"layers": n, "kl": kl})
        if kl > bound:
            break
        kept = ((a, a + n), kl)
    run.chosen_block = kept[0]
    run.forget_blocks()
    report["block_length"] = {"bound": bound, "tried": tried, "kept": kept[0][1] - kept[0][0]}
    return kept


def _fallback(run: _Run, report: dict, key: str, progress: bool, **kw) -> tuple[list[int], float]:
    """The REUSE layers where the producer's own K/V beat the code on validation. Each layer alone
    first (a layer qualifies when its gain exceeds ``fallback_gain`` of the configuration's KL), then the
    qualifying layers by gain, 1, 2, 4, ... of them and all: the set with the lowest KL is kept
    (none, if no set beats the configuration). Then the per-kind bound (``fallback_bound``): while a kind of
    validation text scores above its share of raw's KL, the layer that helps that kind most falls
    back too. ``kw``: the configuration scored (patches, maps, block)."""
    cfg, by_kind = run.cfg, lambda: dict(run.scorer.last_by_kind)
    block = None if kw.get("no_block") else run.chosen_block
    patched = set(kw.get("patch_layers", ()))
    skip = set(range(*block)) | ({block[1]} if run.exit_kv else set()) if block else set()
    layers = [l for l in range(run.L) if l not in skip and l not in patched]
    cur_kl = run.kl(**kw)  # this configuration's KL per kind, from the same scoring as the rest
    base = by_kind()
    gains, kinds = {}, {}
    for l in tqdm(layers, desc=f"{key} per layer", disable=not progress):
        gains[l], kinds[l] = cur_kl - run.kl(fallback=[l], **kw), by_kind()
    order = [l for l, g in sorted(gains.items(), key=lambda x: -x[1]) if g > cfg.fallback_gain * cur_kl]
    sizes = sorted({n for n in (1, 2, 4, 8, 16, len(order)) if 0 < n <= len(order)})
    path, best = [], ([], cur_kl, base)
    for n in sizes:
        if n == 1:
            kl, kk = cur_kl - gains[order[0]], kinds[order[0]]
        else:
            kl, kk = run.kl(fallback=order[:n], **kw), by_kind()
        path.append({"layers": sorted(order[:n]), "kl": kl, "by_kind": kk})
        if kl < best[1]:
            best = (sorted(order[:n]), kl, kk)
    chosen, kl, kk = best
    limit = {k: cfg.fallback_bound * r for k, r in run.raw_by_kind.items()} if cfg.fallback_bound else {}
    bound_path = []
    while _worst(kk, limit) > 1 and (rest := [l for l in layers if l not in chosen]):
        worst = max(limit, key=lambda k: _share(kk, limit, k))
        l = max(rest, key=lambda l: base[worst] - kinds[l][worst])
        chosen = sorted([*chosen, l])
        kl = run.kl(fallback=chosen, **kw)
        kk = by_kind()
        bound_path.append({"layer": l, "for": worst, "layers": chosen, "kl": kl, "by_kind": kk})
        log.info("%s: layer %d falls back for the %s bound (%d layers): %s", key, l, worst, len(chosen),
                 ", ".join(f"{k} {_share(kk, limit, k):.2f}x its bound" for k in limit))
    met = _worst(kk, limit) <= 1
    if not met:  # out of reach: the set along the way that came closest on its worst kind
        chosen, kl, kk = bound_pick(best, bound_path, limit)
        log.warning("%s: no fallback set holds validation KL within %.2fx raw's on every kind; keeping the closest "
                    "(%s)", key, cfg.fallback_bound, ", ".join(f"{k} {kk[k] / r:.2f}x raw" for k, r in
                                                              run.raw_by_kind.items()))
    report[key] = {"kl_without": cur_kl, "by_kind_without": base, "gain": {str(l): g for l, g in gains.items()},
                   "path": path, "bound": limit, "bound_path": bound_path, "bound_met": met,
                   "layers": chosen, "kl": kl, "by_kind": kk}
    return chosen, kl


def _share(by_kind: dict[str, float], limit: dict[str, float], kind: str) -> float:
    """A kind's KL as a share of its limit (infinite for a limit of 0: raw itself is exact there)."""
    return by_kind[kind] / limit[kind] if limit[kind] else float("inf")


def _worst(by_kind: dict[str, float], limit: dict[str, float]) -> float:
    """The largest ratio of a kind's KL to its limit (0 without limits)."""
    return max((_share(by_kind, limit, k) for k in limit), default=0.0)


def bound_pick(best: tuple, bound_path: list[dict], limit: dict[str, float]) -> tuple[list[int], float, dict]:
    """Of the best set by KL and the sets the bound added layers to, the one whose worst kind is
    closest to its limit: (layers, KL, KL per kind)."""
    sets = [best] + [(p["layers"], p["kl"], p["by_kind"]) for p in bound_path]
    return min(sets, key=lambda s: _worst(s[2], limit))


def _pre_block_ranks(run: _Run, report: dict, chosen: list[int], cur_kl: float,
                     progress: bool) -> tuple[dict[int, int], list | None]:
    """Lower the joint code's rank on the REUSE layers before the PATCH block: the smallest rank
    of ``pre_block_ranks`` whose validation KL is within ``tolerance`` of the full rank's. Returns
    the per-layer ranks and the REUSE maps to save (None: the calibrated ones)."""
    cfg = run.cfg
    if cfg.reuse_code != "joint" or not run.chosen_block or not cfg.pre_block_ranks:
        return {}, None
    a = run.chosen_block[0]
    layers = [l for l in range(a) if l not in chosen]
    bound = cur_kl * (1 + cfg.tolerance)
    tried, kept = [], None
    for r in tqdm(sorted(r for r in set(cfg.pre_block_ranks) if r < cfg.r_kv), desc="pre-block ranks",
                  disable=not progress):  # smallest first: the first within the bound is kept
        low = run.fit_joint(r)
        maps = [low[l] if l in layers else run.maps0[l] for l in range(run.L)]
        ranks = {l: min(r, 2 * run.m) for l in layers}
        kl = run.kl(chosen, maps=maps, layer_ranks=ranks)
        tried.append({"rank": r, "kl": kl})
        if kl <= bound:
            kept = (ranks, maps)
            report["pre_block_rank"] = {"rank": r, "layers": layers, "kl": kl}
            break
    report["ablation_pre_block_rank"] = tried + [{"rank": cfg.r_kv, "kl": cur_kl}]
    return kept if kept else ({}, None)


def _ablations(run: _Run, report: dict, path: list[dict], chosen: list[int], cur_kl: float, progress: bool) -> None:
    """The ablations of the calibration report: patch budget k, the separate K and V ranks, the
    PATCH block's length and the joint code's rank, each scored by the served method."""
    cfg, L, m = run.cfg, run.L, run.m
    kl_at = [cur_kl] + [p["kl"] for p in path]
    report["ablation_patch_budget"] = [{"k": k, "kl": kl_at[min(k, len(path))]} for k in (0, 1, 2, 4, 6, 8)]
    sweep = []
    for which in ("k", "v"):  # the paper's separate codes: does K compress harder than V?
        for r in sorted({32, 64, 96, 128, 160, m}):
            rk, rv = min(r if which == "k" else cfg.r_k, m), min(r if which == "v" else cfg.r_v, m)
            kl = run.kl(chosen, maps=run.fit(rk, rv), code="separate", ranks={"r_k": rk, "r_v": rv})
            sweep.append({"which": which, "rank": r, "kl": kl})
    report["ablation_ranks"] = sweep
    if run.chosen_block:  # how long the block should be: lengths at the chosen entry, REUSE elsewhere, no patches
        a = run.chosen_block[0]
        lengths = sorted(n for n in {2, 4, 6, 8, 10, 12, 14, 16, cfg.block_layers} if a + n <= L and n < L)
        report["ablation_block_length"] = []
        for n in tqdm(lengths, desc="block length", disable=not progress):
            blk = (a, a + n)
            kl = run.kl(block=blk)
            report["ablation_block_length"].append({"layers": n, "block": list(blk), "kl": kl})
            run.forget_blocks()
    if run.chosen_block:  # token-sparse recompute (CacheBlend-style): the share of positions recomputed
        report["ablation_block_tokens"] = [{"share": 1.0, "kl": cur_kl}]
        for share in tqdm((0.5, 0.35, 0.2, 0.1), desc="block tokens", disable=not progress):
            report["ablation_block_tokens"].append({"share": share, "kl": run.kl(block_tokens=share)})
    report["ablation_joint_rank"] = []
    for r in sorted({128, 192, cfg.r_kv, 288, 2 * m}):
        r = min(r, 2 * m)
        kl = run.kl(chosen, maps=run.fit_joint(r), code="joint", ranks={"r_kv": r})
        report["ablation_joint_rank"].append({"rank": r, "kl": kl})


def data_hash(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
