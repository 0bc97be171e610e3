"""``scd calibrate``: traces -> REUSE maps -> PATCH block scan -> PATCH projections and aligners ->
layer selection -> ablations -> artifacts. Every stage is timed and reported; the artifact write is atomic, so an
interrupted run is simply restarted."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from shared.artifacts import store
from shared.artifacts.meta import ArtifactMeta
from shared.model.fingerprint import weights_fingerprint
from shared.model.hf_adapter import ModelAdapter
from tools.calibration import selection as sel
from tools.calibration.aligner import train_aligner
from tools.calibration.linalg import fit_reuse, pca
from tools.calibration.memory import PeakRSS, estimate, timed_stages
from tools.calibration.spill import KVMemo, SpillDir
from tools.calibration.traces import collect

log = logging.getLogger(__name__)


class CalibrationSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    pair: str
    n_prompts: int = Field(64, ge=2)
    """Calibration prompts (paired traces)."""
    max_prompt_tokens: int = Field(1024, ge=16)
    reuse_code: Literal["joint", "separate"] = "joint"
    """``separate``: the paper's REUSE, one code for K and one for V (ranks r_k, r_v); ``joint``: one
    code of [K | V] per layer (rank r_kv), which measured better at the same bytes."""
    r_k: int = Field(96, ge=1)
    r_v: int = Field(128, ge=1)
    r_kv: int = Field(224, ge=1)
    r_h: int = Field(128, ge=1)
    code_bits: Literal[8, 16] = 8
    center: bool = True
    ridge: float = Field(1e-3, ge=0)
    """Ridge strength relative to the mean input variance."""
    budget_k: int = Field(6, ge=0)
    """Patch budget: at most this many PATCH layers."""
    pool: int = Field(8, ge=1)
    """Candidate pool size kept after restore-one."""
    n_val: int = Field(24, ge=1)
    """Validation prompts for selection and ablations."""
    val_tokens: int = Field(32, ge=1)
    """Teacher-forced tokens per validation prompt (the Oracle's greedy continuation)."""
    aligner_hidden: int = Field(256, ge=1)
    aligner_steps: int = Field(300, ge=1)
    aligner_rows: int = Field(4096, ge=64)
    block_layers: int = Field(12, ge=0)
    """PATCH block length: the consumer may recompute this many consecutive layers from the
    producer's residual-stream state at the block's entry (0: no block, the paper's SCD)."""
    patch_compute_cost: float = Field(0.25, ge=0)
    """Consumer compute of a PATCH layer, in units of one REUSE layer's bytes, for gain per cost."""
    ablations: bool = True
    """Sweep patch budget k and r_K, r_V on the validation split (adds minutes)."""
    spill_dir: str | None = None
    """Where validation states and memoized K/V are spilled (default: the system's temporary folder);
    removed when calibration ends."""
    seed: int = 0


def calibrate(producer: ModelAdapter, consumer: ModelAdapter, cal_prompts: list[list[int]],
              val_prompts: list[tuple[list[int], int]], cfg: CalibrationSettings, out: str,
              data_hash: str = "", progress: bool = True, stop_ids: Sequence[int] = ()) -> tuple[str, dict]:
    """Fit and write the pair's artifacts into store ``out``; returns (folder, report)."""
    torch.manual_seed(cfg.seed)
    L, m = producer.n_layers, producer.kv_dim
    ranks = (("r_kv", cfg.r_kv, 2 * m),) if cfg.reuse_code == "joint" else (("r_k", cfg.r_k, m), ("r_v", cfg.r_v, m))
    if cfg.block_layers >= L:
        raise ValueError(f"block_layers={cfg.block_layers} would recompute all {L} layers (that is the Oracle); "
                         f"choose block_layers < {L}, or 0 for no PATCH block")
    for name, r, width in (*ranks, ("r_h", cfg.r_h, producer.hidden_size)):
        if r > width:
            raise ValueError(f"{name}={r} is larger than the {width} numbers it codes; choose {name} <= {width}")
    report: dict = {}
    rss = PeakRSS()
    _stage = timed_stages(report, rss)  # noqa: N806
    t_all = t = time.perf_counter()
    prompts = [p[: cfg.max_prompt_tokens] for p in cal_prompts[: cfg.n_prompts]]
    tr = collect(producer, consumer, prompts, cfg.aligner_rows, cfg.seed, progress)
    t = _stage("traces", t)

    def fit(rk, rv):
        """Per layer, the (K map, V map) of separate codes."""
        return [(fit_reuse(tr.k(l), m, min(rk, m), cfg.ridge, cfg.center),
                 fit_reuse(tr.v(l), m, min(rv, m), cfg.ridge, cfg.center))
                for l in range(L)]

    def fit_joint(r):
        """Per layer, the (KV map,) of one joint code."""
        return [(fit_reuse(tr.kv[l], 2 * m, min(r, 2 * m), cfg.ridge, cfg.center),) for l in range(L)]

    sep = fit(cfg.r_k, cfg.r_v)
    joint = fit_joint(cfg.r_kv)
    maps0 = joint if cfg.reuse_code == "joint" else sep
    pcas = [pca(tr.h[l], cfg.r_h, cfg.center) for l in range(L)]
    report["layers"] = [{"layer": l, "k_var_explained": sep[l][0].var_explained, "v_var_explained": sep[l][1].var_explained,
                         "k_rel_err": sep[l][0].rel_err, "v_rel_err": sep[l][1].rel_err,
                         "kv_var_explained": joint[l][0].var_explained, "h_var_explained": pcas[l][2]}
                        for l in range(L)]
    t = _stage("reuse_fit", t)

    spill_dir = SpillDir(cfg.spill_dir)  # validation states and memoized K/V live on disk, not in memory
    vps = sel.prepare_val(producer, consumer, val_prompts[: cfg.n_val], n_new=cfg.val_tokens, progress=progress,
                          stop_ids=stop_ids, spill_to=spill_dir)
    t = _stage("validation_prep", t)

    bits = cfg.code_bits
    memo = KVMemo(spill_dir, consumer.device)

    def reuse(i, l, maps=None):
        if maps is None or maps is maps0:  # the served code: every layer decoded once per prompt, kept on disk
            return memo.get("reuse", i, lambda: {j: sel.reuse_kv(vps[i], j, maps0[j], bits, consumer)
                                                 for j in range(L)})[l]
        return sel.reuse_kv(vps[i], l, maps[l], bits, consumer)

    aligners: dict[int, object] = {}

    def linear_aligner(l):
        wh, mu_h, _ = pcas[l]
        hp, hc = tr.rows(l)
        u = sel.roundtrip((hp - mu_h) @ wh, bits)
        x = torch.cat([u, torch.ones(len(u), 1)], 1)
        sol = torch.linalg.lstsq(x, hc).solution
        return lambda uu: uu @ sol[:-1] + sol[-1]

    def patch(i, l, fn):
        wh, mu_h, _ = pcas[l]
        return sel.patch_kv(vps[i], l, wh, mu_h, fn, bits, consumer)

    chosen_block: tuple[int, int] | None = None

    def block(i, blk):
        """The block's recomputed K/V of prompt i: the chosen block's kept on disk across stages, any
        other's only while its prompt is scored."""
        tag = f"block-{blk[0]}-{blk[1]}"
        return memo.get(tag, i, lambda: sel.block_kv(vps[i], blk, bits, consumer), keep=blk == chosen_block)

    def forget_blocks():
        """Drop the recomputed K/V of every block but the chosen one (which later stages reuse)."""
        keep = f"block-{chosen_block[0]}-{chosen_block[1]}" if chosen_block else None
        memo.forget(lambda tag: tag.startswith("block-") and tag != keep)

    def kl_with(patches: dict[int, object], maps=None, blk=None) -> float:
        blk = blk or chosen_block

        def kv(i, l):
            if blk and blk[0] <= l < blk[1]:
                return block(i, blk)[l]
            return patch(i, l, patches[l]) if l in patches else reuse(i, l, maps)
        return sel.quality(vps, kv, consumer)

    raw_kl = sel.quality(vps, lambda i, l: (vps[i].state.keys[l][:, :, vps[i].start:],
                                            vps[i].state.values[l][:, :, vps[i].start:]), consumer)
    base_kl = kl_with({})
    report["validation"] = {"n": len(vps), "raw_kl": raw_kl, "reuse_only_kl": base_kl,
                            "reuse_only_kl_separate": base_kl if cfg.reuse_code == "separate" else kl_with({}, sep),
                            "reuse_only_kl_joint": base_kl if cfg.reuse_code == "joint" else kl_with({}, joint)}
    cur_kl = base_kl
    if cfg.block_layers:  # where a PATCH block of the budgeted length earns most: slide it over the depth
        n = cfg.block_layers
        scan = []
        for a0 in tqdm(range(L - n + 1), desc="patch block", disable=not progress):
            scan.append({"block": [a0, a0 + n], "kl": kl_with({}, blk=(a0, a0 + n))})
            forget_blocks()
        best = min(scan, key=lambda x: x["kl"])
        report["block_scan"] = scan
        if best["kl"] < base_kl:
            chosen_block, cur_kl = tuple(best["block"]), best["kl"]
        t = _stage("patch_block", t)
    report["patch_block"] = list(chosen_block) if chosen_block else None
    report["validation"]["block_kl"] = cur_kl if chosen_block else None
    free = [l for l in range(L) if not (chosen_block and chosen_block[0] <= l < chosen_block[1])]
    lin = {l: linear_aligner(l) for l in free}
    sens = sel.restore_one(free, cur_kl, lambda s: kl_with({l: lin[l] for l in s}), progress)
    report["sensitivity"] = [{"layer": l, "gain": g} for l, g in sens.items()]
    pool = [l for l, g in sorted(sens.items(), key=lambda kv: -kv[1]) if g > 0][: cfg.pool]
    t = _stage("restore_one", t)

    for l in pool:
        wh, mu_h, _ = pcas[l]
        hp, hc = tr.rows(l)
        u = sel.roundtrip((hp - mu_h) @ wh, bits)
        aligners[l], rep = train_aligner(u, hc, cfg.aligner_hidden, cfg.aligner_steps, seed=cfg.seed)
        report["layers"][l].update({f"aligner_{k}": v for k, v in rep.items()})
    t = _stage("aligners", t)

    width = cfg.r_kv if cfg.reuse_code == "joint" else cfg.r_k + cfg.r_v
    scales = 2 if cfg.reuse_code == "joint" else 4
    reuse_bytes = width + scales if bits == 8 else 2 * width  # per token, scales included
    patch_bytes = cfg.r_h + 2 if bits == 8 else 2 * cfg.r_h
    cost = lambda l: patch_bytes / reuse_bytes + cfg.patch_compute_cost  # noqa: E731
    steps = max(cfg.budget_k, 8 if cfg.ablations else 0)
    path = sel.greedy(pool, steps, cur_kl, lambda s: kl_with({l: aligners[l] for l in s}), cost, progress)
    report["greedy_path"] = path
    chosen = [p["layer"] for p in path[: cfg.budget_k]]
    t = _stage("greedy", t)

    if cfg.ablations:
        kl_at = [cur_kl] + [p["kl"] for p in path]
        report["ablation_patch_budget"] = [{"k": k, "kl": kl_at[min(k, len(path))]} for k in (0, 1, 2, 4, 6, 8)]
        patches = {l: aligners[l] for l in chosen}
        sweep = []
        for which in ("k", "v"):  # the paper's separate codes: does K compress harder than V?
            for r in sorted({32, 64, 96, 128, 160, m}):
                maps = fit(r, cfg.r_v) if which == "k" else fit(cfg.r_k, r)
                sweep.append({"which": which, "rank": r, "kl": kl_with(patches, maps)})
        report["ablation_ranks"] = sweep
        if chosen_block:  # how long the block should be: lengths at the chosen entry, REUSE elsewhere, no patches
            a = chosen_block[0]
            lengths = sorted(n for n in {2, 4, 6, 8, 10, 12, 14, 16, cfg.block_layers} if a + n <= L and n < L)
            report["ablation_block_length"] = []
            for n in tqdm(lengths, desc="block length", disable=not progress):
                blk = (a, a + n)  # the chosen length was scored by the scan
                kl = report["validation"]["block_kl"] if blk == chosen_block else kl_with({}, blk=blk)
                report["ablation_block_length"].append({"layers": n, "block": list(blk), "kl": kl})
                forget_blocks()
        report["ablation_joint_rank"] = []
        for r in sorted({128, 192, cfg.r_kv, 288, 2 * m}):
            report["ablation_joint_rank"].append({"rank": r, "kl": kl_with(patches, fit_joint(r))})
        t = _stage("ablations", t)

    prod_t, cons_t = {}, {}
    names = ("kv",) if cfg.reuse_code == "joint" else ("k", "v")
    for l in range(L):
        for kv, mp in zip(names, maps0[l]):
            prod_t[f"enc.{kv}.{l}"], prod_t[f"mu_p.{kv}.{l}"] = mp.enc.half(), mp.mu_p.half()
            cons_t[f"dec.{kv}.{l}"], cons_t[f"mu_c.{kv}.{l}"] = mp.dec.half(), mp.mu_c.half()
    for l in chosen:
        wh, mu_h, _ = pcas[l]
        prod_t[f"wh.{l}"], prod_t[f"mu_h.{l}"] = wh.half(), mu_h.half()
        for k, v in aligners[l].state_dict().items():
            cons_t[f"align.{l}.{k}"] = v.half()
    report["stage_seconds"]["total"] = round(time.perf_counter() - t_all, 2)
    report["peak_rss_mb"]["total"] = max(report["peak_rss_mb"].values())
    rss.close()
    spill_dir.cleanup()
    n_params = sum(p.numel() for p in producer.model.parameters())
    longest = max(max(len(p) for p in prompts), max(len(ids) for ids, _ in val_prompts[: cfg.n_val]))
    report["memory_model_mb"] = estimate(n_params, L, m, producer.hidden_size, producer.config.vocab_size, longest,
                                         len(vps), cfg.val_tokens, cfg.aligner_rows)
    report["selected_kl"] = path[len(chosen) - 1]["kl"] if chosen else cur_kl
    import transformers

    meta = ArtifactMeta(
        pair=cfg.pair, producer_fingerprint=weights_fingerprint(producer.model),
        consumer_fingerprint=weights_fingerprint(consumer.model), n_layers=L, n_kv_heads=producer.n_kv_heads,
        head_dim=producer.head_dim, hidden_size=producer.hidden_size, r_k=cfg.r_k, r_v=cfg.r_v, r_h=cfg.r_h,
        reuse_code=cfg.reuse_code, r_kv=cfg.r_kv if cfg.reuse_code == "joint" else 0,
        code_bits=cfg.code_bits, center=cfg.center, patch_layers=sorted(chosen),
        patch_blocks=[chosen_block] if chosen_block else [], aligner_hidden=cfg.aligner_hidden,
        calibration={"data_sha256": data_hash, "n_prompts": tr.n_prompts, "n_tokens": tr.n_tokens,
                     "settings": cfg.model_dump()},
        versions={"torch": torch.__version__, "transformers": transformers.__version__, "scd": "0.1.0"},
        report=report,
    )
    folder = store.save(out, meta, prod_t, cons_t)
    return str(folder), report


def data_hash(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
