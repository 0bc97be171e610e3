"""``scd calibrate``: SCD's artifacts, or a baseline's profile, for a registered pair."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer

from tools.cli.app import app
from tools.cli.common import (
    Device,
    DType,
    calibration_prompts,
    check_data,
    entry,
    fail,
    output_dir,
    pair_models,
    parse_set,
    setup_logging,
    validation_items,
)

METHODS = ("scd", "droidspeak", "ridge", "spectrum", "auto", "refine", "fallback", "guard")


@app.command()
def calibrate(
    pair: str = typer.Option("strong", help="A registered pair (scd pair list)."),
    out: Optional[Path] = typer.Option(None, callback=output_dir,
                                       help="Artifact store directory (default: the pair's store)."),
    data_file: Optional[Path] = typer.Option(None, "--data", help="Your prompts (JSONL): the calibration split fits, "
                                                                  "the validation split selects."),
    set_: list[str] = typer.Option([], "--set", help="Calibration setting KEY=VALUE, e.g. r_kv=192 (repeatable)."),
    method: str = typer.Option("scd", help="scd (REUSE + PATCH artifacts), droidspeak (recompute blocks), ridge "
                                          "(cross-model maps), spectrum (int4 probe), auto (the operating table "
                                          "of every method the pair has: run it last), refine (scd's newest "
                                          "stages, the block's entry map and the code form, on the pair's "
                                          "existing artifacts: minutes) or fallback (the layers where scd and "
                                          "scd-reuse send the producer's own K/V, selected again on the existing "
                                          "artifacts; --set modes=scd-reuse for one mode) or guard (the token-sparse "
                                          "block's guard on the existing artifacts, from the validation prompts: "
                                          "seconds)."),
    device: Device = "cpu",
    dtype: DType = "float32",
    verbose: bool = typer.Option(True, "-v/-q", "--verbose/--quiet",
                                 help="Log progress at INFO (--quiet: warnings and errors only)."),
) -> None:
    """Calibrate SCD for a pair (REUSE maps, PATCH aligners, layer selection) into the artifact store, or
    profile a baseline (--method droidspeak|ridge|spectrum), on the built-in data or your own (--data)."""
    setup_logging(verbose)
    from shared.errors import SCDError
    from tools.calibration.pipeline import calibrate as run
    from tools.calibration.pipeline import data_hash

    if method not in METHODS:
        raise typer.BadParameter(f"expected one of {sorted(METHODS)}, got {method!r}")
    overrides = parse_set(set_)
    try:
        cfg = _settings(pair, overrides) if method == "scd" else None
    except ValueError as e:
        fail(str(e))
    n_val = cfg.n_val if cfg else _whole(overrides, "n_val", 24)
    try:
        overrides = _method_settings(method, overrides)
    except ValueError as e:
        fail(str(e))
    check_data(data_file, "validation", *(() if method in ("droidspeak", "spectrum", "auto", "fallback", "guard") else
                                          ("calibration",)), pair=pair)
    if cfg is not None:  # sizes the registry knows: every setting the model cannot take, before it loads
        from tools.calibration.pipeline import model_problems, not_fitting

        e = entry(pair)
        problems = model_problems(cfg, e.n_layers, e.n_kv_heads * e.head_dim, e.hidden_size)
        if problems:
            fail(f"pair {pair!r} ({e.n_layers} layers, K/V width {e.n_kv_heads * e.head_dim}, hidden size "
                 f"{e.hidden_size}): {not_fitting(problems)}\nset others with --set KEY=VALUE")
    if method in _READS_STORE:  # the pair's artifacts and profiles, checked before the models load
        _check_store(method, pair, out)
    pm = pair_models(pair, device, dtype)
    out = pm.store(out)
    stop = pm.fmt.stop_ids
    val_items = validation_items(pm, data_file, n_val)
    val = [(it.prompt_ids, it.prefix_len, list(it.continuation_ids)) for it in val_items]
    source = f"{data_file} (sha256 {_sha(data_file)[:12]})" if data_file else "built-in data"
    typer.echo(f"calibrating {method} for pair {pair!r} on {source}: {len(val)} validation prompts; store {out}",
               err=True)

    def save_profile(prof: dict, tensors=None) -> Path:
        """A baseline's profile into the store, pinned to both models and to its data."""
        from shared.artifacts import store
        from shared.model.fingerprint import weights_fingerprint

        prof = {**prof, "data": source}
        return store.save_profile(out, pair, method, prof, weights_fingerprint(pm.producer.model),
                                  weights_fingerprint(pm.consumer.model), tensors=tensors)

    try:
        if method == "droidspeak":
            from tools.calibration.droidspeak import profile

            prof = profile(pm.producer, pm.consumer, val, stop_ids=stop, **overrides)
            typer.echo(f"droidspeak blocks {prof['blocks']} written to {save_profile(prof)}")
            typer.echo(json.dumps(prof["report"]))
            return
        if method == "spectrum":
            from tools.calibration.spectrum import probe

            overrides.pop("n_val", None)
            prof = probe(pm.producer, pm.consumer, val, **overrides)
            typer.echo(f"spectrum int4 {'allowed' if prof['int4'] else 'disabled (two-tier fp16 + int8)'}; written to "
                       f"{save_profile(prof)}")
            typer.echo(json.dumps(prof["report"]))
            return
        if method == "auto":
            _auto(pm, out, pair, val_items, overrides, save_profile)
            return
        if method == "refine":
            _refine(pm, out, pair, val_items, val, calibration_prompts(pm, data_file), overrides)
            return
        if method == "fallback":
            _refallback(pm, out, pair, val_items, val, overrides)
            return
        if method == "guard":
            _guard(pm, out, pair, val, overrides)
            return
        cal = calibration_prompts(pm, data_file)
        if method == "ridge":
            from tools.calibration.ridge import calibrate as fit_ridge

            n_prompts = _whole(overrides, "n_prompts", 64)
            overrides.pop("n_prompts", None)
            tensors, prof = fit_ridge(pm.producer, pm.consumer, cal[:n_prompts], val, stop_ids=stop, **overrides)
            path = save_profile(prof, tensors)
            r = prof["report"]
            typer.echo(f"ridge maps (top_k={prof['top_k']}, alpha={prof['alpha']}) written to {path}; validation KL "
                       f"{r['kl']:.4f} vs raw {r['raw_kl']:.4f}")
            typer.echo(json.dumps({k: v for k, v in r.items() if k != "r2_per_layer"}))
            return
        kinds = [it.kind for it in val_items]
        if _fast(pm, out, pair, cal, val, cfg):
            from tools.calibration.fast import calibrate_fast

            folder, report = calibrate_fast(pm.producer, pm.consumer, cal, val, cfg, str(out),
                                            data_hash(cal[: cfg.fast_prompts]), stop_ids=stop, val_kinds=kinds)
        else:
            folder, report = run(pm.producer, pm.consumer, cal, val, cfg, str(out), data_hash(cal[: cfg.n_prompts]),
                                 stop_ids=stop, val_kinds=kinds)
    except (ValueError, TypeError, SCDError) as e:  # SCDError: the store's artifacts or profiles (missing, stale..)
        fail(str(e))
    v = report["validation"]
    typer.echo(f"artifacts written to {folder}")
    patched = [p["layer"] for p in report["greedy_path"][: cfg.budget_k]]
    typer.echo(f"validation KL: raw {v['raw_kl']:.4f} | REUSE only {v['reuse_only_kl']:.4f} | "
               f"SCD {report['selected_kl']:.4f}; patch layers {patched}"
               + (f"; PATCH block {blk[0]}-{blk[1] - 1} (REUSE + block {v.get('served_block_kl', v['block_kl']):.4f})"
                  if (blk := report.get("patch_block")) else ""))
    if report["selected_kl"] >= v["raw_kl"]:
        typer.echo(f"warning: on validation SCD is worse than raw transfer for pair {pair!r} (KL "
                   f"{report['selected_kl']:.4f} vs {v['raw_kl']:.4f}): its caches barely drift and the lossy code "
                   "costs more than it corrects; serve raw or quant to this consumer", err=True)
    for key, name in (("fallback", "scd"), ("reuse_fallback", "scd-reuse")):
        if (fb := report.get(key)) and fb["bound"]:
            kinds = ", ".join(f"{k} {fb['by_kind'][k]:.4f} (bound {b:.4f})" for k, b in fb["bound"].items())
            typer.echo(f"{name}: fallback layers {fb['layers']}; validation KL per kind: {kinds}"
                       + ("" if fb["bound_met"] else " -- no set of fallback layers holds the bound on every kind: "
                          "kept the closest"),
                       err=not fb["bound_met"])
    typer.echo(json.dumps({"stage_seconds": report["stage_seconds"], "peak_rss_mb": report.get("peak_rss_mb"),
                           "validation": v, "selected_kl": report["selected_kl"]}))


def _settings(pair: str, overrides: dict):
    """The calibration settings with ``--set`` applied; ValueError listing each bad one on its own
    line (``--set KEY: what is wrong``), not pydantic's report."""
    from pydantic import ValidationError

    from shared.config import field_errors
    from tools.calibration.pipeline import CalibrationSettings

    try:
        return CalibrationSettings(pair=pair, **overrides)
    except ValidationError as e:
        lines = "\n".join(f"  --set {line}" for line in field_errors(e, model=CalibrationSettings))
        raise ValueError(f"invalid calibration settings:\n{lines}") from None


# the --set keys of the methods that check them in their own step (their values: CalibrationSettings)
_TAKES = {"auto": {"n_val", "candidates"},
          "refine": {"n_val", "val_tokens", "code_channel", "bytes_target", "levels_tolerance", "code_levels_min",
                     "spill_dir", "entry_map", "entry_map_ridge", "n_prompts", "max_prompt_tokens", "guard_margin",
                     "layer_guard_margin"},
          "guard": {"n_val", "guard_margin", "layer_guard_margin"},
          "fallback": {"n_val", "val_tokens", "fallback_gain", "fallback_bound", "spill_dir", "modes"}}


def _method_settings(method: str, overrides: dict) -> dict:
    """``--set`` values checked for ``method`` before any model loads: a baseline's typed (its
    settings model), the others' keys; ValueError listing each bad one (``--set KEY: what is wrong``).
    A baseline's profile function was called with them as they were: an unknown key ended in
    "profile() got an unexpected keyword argument", after the models had loaded."""
    from pydantic import ValidationError

    from shared.config import field_errors
    from tools.calibration.settings import BASELINE_SETTINGS

    if method in BASELINE_SETTINGS:
        model = BASELINE_SETTINGS[method]
        try:
            checked = model(**overrides)
        except ValidationError as e:
            lines = "\n".join(f"  --set {line}" for line in field_errors(e, model=model))
            raise ValueError(f"invalid {method} calibration settings:\n{lines}") from None
        return {k: getattr(checked, k) for k in overrides}
    unknown = set(overrides) - _TAKES.get(method, set(overrides))
    if unknown:
        raise ValueError(f"unknown {method} settings {sorted(unknown)}; {method} takes {sorted(_TAKES[method])}"
                         + (" (candidates: method labels separated by spaces)" if method == "auto" else ""))
    return overrides


_READS_STORE = ("refine", "fallback", "guard", "auto")
"""The methods that read what the store holds for the pair: the first three need its SCD artifacts;
auto scores the artifacts and profiles it finds (and skips the methods it finds none for)."""


def _check_store(method: str, pair: str, out: Path | None) -> None:
    """What ``method`` will read from the store, loaded and checked against the registered weights
    before the models load: a missing, stale (other weights) or corrupt artifact or profile is a
    one-line error, not a traceback after the models have loaded."""
    from shared.artifacts import store
    from shared.errors import SCDError
    from shared.paths import profile_path
    from tools.cli.common import check_store

    e = entry(pair)
    where = check_store(Path(out) if out else e.store_dir())
    folder = where / pair
    pfp, cfp = e.producer_fingerprint, e.consumer_fingerprint
    try:
        if method != "auto" or (folder / "meta.json").exists():
            meta, _ = store.load(folder, "producer", pfp, cfp)
            store.load(folder, "consumer", pfp, cfp)
            if method == "refine" and meta.code_bits != 8:
                fail(f"pair {pair!r}'s codes are fp16 (code_bits={meta.code_bits}); refine needs int8 codes")
        if method == "auto":
            for kind in _auto_reads():
                if profile_path(where, pair, kind).exists():
                    store.load_profile(where, pair, kind, pfp, cfp)
    except SCDError as err:
        fail(str(err))


def _auto_reads() -> tuple[str, ...]:
    """The profiles auto's operating table scores: every profile kind but its own old table, which
    it replaces and does not read."""
    from shared.engine import PROFILE_KINDS

    return tuple(k for k in PROFILE_KINDS if k != "auto")


def _whole(overrides: dict, key: str, default: int) -> int:
    """A count among the --set values: a whole number >= 1, or a usage error naming the flag."""
    v = overrides.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise typer.BadParameter(f"--set {key} takes a whole number >= 1, got {v!r}")
    return v


def _fast(pm, out: Path, pair: str, cal: list, val: list, cfg) -> bool:
    """Whether this run is the fast search: asked for, or ``auto`` for a new member (no artifacts of
    its own yet) of a producer that another pair in the store was calibrated for."""
    from shared.model.fingerprint import weights_fingerprint
    from tools.calibration.fast import producer_cache

    if cfg.search == "full":
        return False
    if cfg.search == "auto":
        fp = weights_fingerprint(pm.producer.model)
        from tools.assets.registry import json_object

        # another pair's unreadable manifest is its problem, reported when it is loaded, not this calibration's
        peers = [m.parent.name for m in out.glob("*/meta.json")
                 if m.parent.name != pair and (json_object(m) or {}).get("producer_fingerprint") == fp]
        if (out / pair / "meta.json").exists() or not peers:
            typer.echo("full search (" + ("recalibrating an existing pair" if peers else
                                          "the first pair of this producer") + "; --set search=fast for minutes)",
                       err=True)
            return False
        typer.echo(f"a new member of a producer already calibrated for {sorted(peers)}", err=True)
    cache = producer_cache(pm.producer, cal, val, cfg)
    typer.echo(f"fast search (producer cache {cache.path}{'' if cache.ready else ': building it first'}; "
               "--set search=full for the full search)", err=True)
    return True


def _auto(pm, out: Path, pair: str, val_items: list, overrides: dict, save_profile) -> None:
    """The operating table: every candidate method and setting the pair can serve, scored on validation."""
    from shared.engine import load_context
    from shared.model.fingerprint import weights_fingerprint
    from tools.calibration.auto import CANDIDATES, operating_table

    cands = tuple(str(overrides["candidates"]).split()) if overrides.get("candidates") else CANDIDATES
    pfp, cfp = weights_fingerprint(pm.producer.model), weights_fingerprint(pm.consumer.model)
    # what the pair has, less the old operating table this one replaces (a stale or corrupt one
    # stopped its own recalibration)
    pctx = load_context(pm.producer, out / pair, "producer", pfp, cfp, profiles=_auto_reads())
    cctx = load_context(pm.consumer, out / pair, "consumer", pfp, cfp, profiles=_auto_reads())
    t0 = time.perf_counter()
    table = operating_table(pm.producer, pm.consumer, pm.fmt, val_items, pctx, cctx, cands)
    table["report"]["seconds"] = round(time.perf_counter() - t0, 1)
    path = save_profile(table)
    raw = table["raw_kl"]
    typer.echo(f"{'point':<24}{'KL':>9}{'x raw':>8}{'B/tok':>9}{'enc ms/tok':>12}{'rec ms/tok':>12}")
    for p in sorted(table["points"], key=lambda p: p["kl"]):
        typer.echo(f"{p['label']:<24}{p['kl']:>9.4f}{p['kl'] / raw if raw else 0:>8.2f}{p['bytes_per_token']:>9.0f}"
                   f"{p['encode_ms_per_token']:>12.3f}{p['reconstruct_ms_per_token']:>12.3f}")
    for label, why in table["report"]["skipped"].items():
        typer.echo(f"skipped {label}: {why}", err=True)
    typer.echo(f"operating table ({len(table['points'])} points, {table['report']['seconds']} s) written to {path}")
    typer.echo(json.dumps({"raw_kl": raw, "points": {p["label"]: round(p["kl"], 5) for p in table["points"]},
                           "seconds": table["report"]["seconds"]}))


def _refine(pm, out: Path, pair: str, val_items: list, val: list, cal: list, overrides: dict) -> None:
    """scd calibration's newest stages on the pair's existing artifacts, written back into the store:
    per-channel scales (``code_channel``), the PATCH block's entry map (``entry_map``, kept when
    validation KL falls) and the code levels (``bytes_target``), each scored by the served method."""
    from shared.artifacts import store
    from shared.model.fingerprint import weights_fingerprint
    from tools.calibration import selection as sel
    from tools.calibration.guard import fit_guards
    from tools.calibration.levels import tune_levels
    from tools.calibration.linalg import fit_entry_map
    from tools.calibration.scoring import Scorer, scd_sides
    from tools.calibration.spill import SpillDir

    cfg = _settings(pair, overrides)
    pfp, cfp = weights_fingerprint(pm.producer.model), weights_fingerprint(pm.consumer.model)
    meta, prod = store.load(out / pair, "producer", pfp, cfp)
    _, cons = store.load(out / pair, "consumer", pfp, cfp)
    if meta.code_bits != 8:
        raise ValueError(f"pair {pair!r}'s codes are fp16 (code_bits={meta.code_bits}); refine needs int8 codes")
    cons = {k: v for k, v in cons.items() if not k.startswith("entry.")}  # a previous refine's map is refitted
    t0 = time.perf_counter()
    spill = SpillDir(cfg.spill_dir)
    rep: dict = {}
    try:
        vps = sel.prepare_val(pm.producer, pm.consumer, val, n_new=cfg.val_tokens, stop_ids=pm.fmt.stop_ids,
                              spill_to=spill)
        scorer = Scorer(pm.producer, pm.consumer, vps, [it.kind for it in val_items])

        def kl(m, c) -> float:
            return scorer.kl(*scd_sides(scorer, m, prod, c))

        meta = meta.model_copy(update={"code_channel": list(cfg.code_channel), "code_levels": {},
                                       "block_entry_map": False})
        rep["kl_before"] = kl(meta.model_copy(update={"code_channel": []}), cons)
        rep["kl_channel_scales"] = kl(meta, cons)
        if meta.patch_blocks and cfg.entry_map:
            a = meta.patch_blocks[0][0]
            entry = fit_entry_map(pm.producer, pm.consumer, [p[: cfg.max_prompt_tokens] for p in cal[: cfg.n_prompts]],
                                  a, cfg.entry_map_ridge, cfg.max_prompt_tokens)
            mapped = meta.model_copy(update={"block_entry_map": True})
            with_map = kl(mapped, {**cons, **entry})
            rep["entry_map"] = {"layer": a, "kl_without": rep["kl_channel_scales"], "kl_with": with_map,
                                "kept": with_map < rep["kl_channel_scales"], "n_prompts": min(cfg.n_prompts, len(cal))}
            if rep["entry_map"]["kept"]:
                meta, cons = mapped, {**cons, **entry}
        levels, rep["code_levels"] = tune_levels(scorer, meta, prod, cons, cfg.bytes_target, cfg.levels_tolerance,
                                                 cfg.code_levels_min) if cfg.bytes_target else ({}, {})
        guard, layer_guard, guards = fit_guards(pm.producer, meta.model_copy(update={"code_levels": levels}), prod,
                                                ((vp.state, vp.start) for vp in vps), cfg.guard_margin,
                                                cfg.layer_guard_margin)
        rep.update(guards)
    finally:
        spill.cleanup()
    rep["seconds"] = round(time.perf_counter() - t0, 1)
    settings = {**meta.calibration.get("settings", {}),
                **{k: getattr(cfg, k) for k in ("code_channel", "bytes_target", "levels_tolerance", "code_levels_min",
                                                "entry_map", "entry_map_ridge", "guard_margin",
                                                "layer_guard_margin")}}
    new = meta.model_copy(update={"code_levels": levels, "block_guard": guard, "layer_guard": layer_guard,
                                  "report": {**meta.report, "refine": rep},
                                  "calibration": {**meta.calibration, "settings": settings}})
    folder = store.save(out, new, prod, cons)
    lv = rep["code_levels"]
    em = rep.get("entry_map")
    typer.echo(f"validation KL {rep['kl_before']:.4f} (as loaded, no channel scales) -> {rep['kl_channel_scales']:.4f} "
               f"(per-channel scales on {list(cfg.code_channel)})"
               + (f" -> {em['kl_with']:.4f} (entry map at layer {em['layer']}, {'kept' if em['kept'] else 'dropped'})"
                  if em else "")
               + (f" -> {lv['kl']:.4f} (code levels {levels or 'none lowered'}, "
                  f"{lv['bytes_vs_raw_fp16']:.3f}x raw fp16 bytes, target {cfg.bytes_target})" if lv else "")
               + f"; written to {folder}", err=bool(lv) and not lv["met"])
    typer.echo(json.dumps({"seconds": rep["seconds"], "kl_before": rep["kl_before"],
                           "kl_channel_scales": rep["kl_channel_scales"], "entry_map": em,
                           "code_levels": {k: v for k, v in lv.items() if k != "path"}}))


def _guard(pm, out: Path, pair: str, val: list, overrides: dict) -> None:
    """The guards on the pair's existing artifacts (``block_guard`` and ``layer_guard`` in their meta),
    from the validation prompts. They change what is served: the pair's operating table is remade
    after (``scd calibrate --method auto``)."""
    from shared.artifacts import store
    from shared.model.fingerprint import weights_fingerprint
    from tools.calibration.guard import fit_guards

    cfg = _settings(pair, overrides)
    pfp, cfp = weights_fingerprint(pm.producer.model), weights_fingerprint(pm.consumer.model)
    meta, prod = store.load(out / pair, "producer", pfp, cfp)
    _, cons = store.load(out / pair, "consumer", pfp, cfp)
    states = ((pm.producer.prefill(ids[:-1]), start) for ids, start, _ in val)
    guard, layer_guard, rep = fit_guards(pm.producer, meta, prod, states, cfg.guard_margin, cfg.layer_guard_margin)
    settings = {**meta.calibration.get("settings", {}), "guard_margin": cfg.guard_margin,
                "layer_guard_margin": cfg.layer_guard_margin}
    new = meta.model_copy(update={"block_guard": guard, "layer_guard": layer_guard, "report": {**meta.report, **rep},
                                  "calibration": {**meta.calibration, "settings": settings}})
    folder = store.save(out, new, prod, cons)
    block = rep["block_guard"]
    if guard:
        typer.echo(f"block guard {guard:.4f} ({cfg.guard_margin} x the highest of {block['n_prompts']} validation "
                   f"prompts, {block['highest']:.4f}; median {block['median']:.4f})")
    else:
        typer.echo(f"no block guard ({block['why']})")
    typer.echo(f"layer guard on {len(layer_guard)} layers ({cfg.layer_guard_margin} x the validation prompts' "
               f"highest share outside each layer's code)" if layer_guard else "no layer guard")
    typer.echo(f"written to {folder}; remake the operating table: scd calibrate --pair {pair} --method auto")
    typer.echo(json.dumps(rep))


def _sha(path: Path) -> str:
    from tools.data.user import file_hash

    return file_hash(path)


def _refallback(pm, out: Path, pair: str, val_items: list, val: list, overrides: dict) -> None:
    """The fallback layers of scd and scd-reuse selected again on the pair's existing artifacts."""
    from shared.model.fingerprint import weights_fingerprint
    from tools.calibration.refallback import MODES, reselect

    modes = str(overrides.pop("modes", " ".join(MODES))).replace(",", " ").split()
    cfg = _settings(pair, overrides)
    folder, rep = reselect(pm.producer, pm.consumer, out / pair, out, val, [it.kind for it in val_items], cfg, modes,
                           pm.fmt.stop_ids, weights_fingerprint(pm.producer.model),
                           weights_fingerprint(pm.consumer.model))
    raw = rep["raw_by_kind"]
    for mode in modes:
        key = MODES[mode]
        was, now = rep[f"{key}_before"], rep[key]
        per_kind = ", ".join(f"{k} {now['by_kind'][k]:.4f} ({now['by_kind'][k] / r:.2f}x raw; was "
                             f"{was['by_kind'][k] / r:.2f}x)" for k, r in raw.items() if r)
        typer.echo(f"{mode}: fallback layers {was['layers']} -> {now['layers']}; validation KL {was['kl']:.4f} -> "
                   f"{now['kl']:.4f}; per kind {per_kind}"
                   + ("" if now["bound_met"] else f" -- no set holds {cfg.fallback_bound}x raw on every kind: kept "
                      "the closest"), err=not now["bound_met"])
    typer.echo(f"written to {folder} ({rep['seconds']} s)")
    typer.echo(json.dumps({"seconds": rep["seconds"], "raw_by_kind": raw,
                           **{MODES[m]: {"layers": rep[MODES[m]]["layers"], "by_kind": rep[MODES[m]]["by_kind"],
                                         "before": rep[f"{MODES[m]}_before"]} for m in modes}}))
