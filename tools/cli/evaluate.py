"""``scd eval`` (every method side by side against the Oracle), ``scd drift`` and ``scd anatomy``."""

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
    JsonOut,
    Verbose,
    calibration_prompts,
    check_data,
    entry,
    fail,
    items,
    known_methods,
    name_list,
    output_file,
    pair_models,
    setup_logging,
    validation_prompts,
)


def _on_off(value: str) -> bool:
    if value not in ("on", "off"):
        raise typer.BadParameter(f"expected one of ['off', 'on'], got {value!r}")
    return value == "on"


@app.command()
def drift(
    pair: str = typer.Option("strong", help="A registered pair."),
    n: int = typer.Option(48, min=1, help="Number of test prompts."),
    native_prefix: str = typer.Option("on", help="on | off: consumer's own K/V for the fixed template prefix."),
    data_file: Optional[Path] = typer.Option(None, "--data", help="Your prompts (JSONL); its test split is used."),
    json_out: JsonOut = None,
    device: Device = "cpu",
    dtype: DType = "float32",
    verbose: Verbose = False,
) -> None:
    """How far the pair's caches disagree: Oracle vs raw transfer on the test split."""
    setup_logging(verbose)
    prefix = _on_off(native_prefix)
    from shared.codecs import CodecContext
    from tools.eval.harness import evaluate, methods
    from tools.eval.report import print_layers, print_table

    t0 = time.perf_counter()
    check_data(data_file, "test", pair=pair)
    pm = pair_models(pair, device, dtype)
    its = items(pm, "test", n, data_file)
    runners = methods(("oracle", "raw"), CodecContext(pm.producer), CodecContext(pm.consumer))
    res = evaluate(pm.producer, pm.consumer, pm.fmt, its, runners, prefix)
    res.update(pair=pair, native_prefix=native_prefix, n=len(its), seconds=round(time.perf_counter() - t0, 1))
    print_table(res, title=f"drift: pair={pair} native_prefix={native_prefix} n={len(its)}")
    print_layers(res)
    if json_out:
        json_out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({"pair": pair, "native_prefix": native_prefix, "n": len(its),
                      "raw_kl": res["methods"]["raw"]["kl"], "raw_agree_f1": res["methods"]["raw"]["agree_f1"]}))


@app.command()
def anatomy(
    pair: str = typer.Option("strong", help="A registered pair."),
    n_cal: int = typer.Option(64, min=2, help="Calibration prompts for the ridge-map probes."),
    n_val: int = typer.Option(24, min=1, help="Validation prompts scored."),
    data_file: Optional[Path] = typer.Option(None, "--data", help="Your prompts (JSONL)."),
    json_out: JsonOut = None,
    device: Device = "cpu",
    dtype: DType = "float32",
) -> None:
    """Where the pair's drift lives (validation split): the consumer's own K/V on some layers,
    full-rank per-token maps, and blocks of its own layers recomputed. Prints a table and JSON."""
    from tools.eval.anatomy import default_probes, run

    t0 = time.perf_counter()
    check_data(data_file, "calibration", "validation", pair=pair)
    pm = pair_models(pair, device, dtype)
    cal = [ids[:1024] for ids in calibration_prompts(pm, data_file)][:n_cal]
    val = validation_prompts(pm, data_file, n_val)
    res = run(pm.producer, pm.consumer, cal, val, pm.fmt.stop_ids, **default_probes(pm.producer.n_layers))
    typer.echo(f"anatomy: pair={pair} native_prefix=on n={len(val)} (KL of the Oracle's answer, nats/token)")
    for name, kl in res.items():
        typer.echo(f"  {name:58s} {kl:.4f}")
    body = {"pair": pair, "n": len(val), "n_cal": len(cal), "kl": res, "seconds": round(time.perf_counter() - t0, 1)}
    if json_out:
        json_out.write_text(json.dumps(body, indent=2) + "\n")
    print(json.dumps(body))


@app.command("eval")
def eval_(
    pair: str = typer.Option("strong", help="A registered pair."),
    methods: str = typer.Option("oracle,raw,scd-reuse,scd", help="Comma-separated transfer methods; a method "
                                "with settings is KIND:KEY=VALUE;KEY=VALUE (scd:block_tokens=0.2)."),
    n: Optional[int] = typer.Option(None, min=1, help="Number of prompts scored (default: 48 of the built-in "
                                    "data; every prompt of the split of a --data file)."),
    native_prefix: str = typer.Option("on", help="on | off"),
    store_dir: Optional[Path] = typer.Option(None, "--store", help="Artifact store (default: the pair's store)."),
    data_file: Optional[Path] = typer.Option(None, "--data", help="Your prompts (JSONL); --split says which of "
                                             "them are scored."),
    split: str = typer.Option("test", help="test (default) | validation | calibration | all: the split scored; "
                              "all scores a held-out file whole (a file calibration never read)."),
    rows_json: Optional[Path] = typer.Option(None, "--rows-json", callback=output_file,
                                             help="Also write one JSON line per prompt: its id, kind, length, "
                                                  "metadata (a --data row's other fields) and each method's scores."),
    data_kind: Optional[str] = typer.Option(None, "--kind", help="Built-in test data: qa (questions over "
                                            "Wikipedia passages; the default), lm (Wikipedia and Python docs, "
                                            "continuation scored) or heldout (license texts, a domain calibration "
                                            "never sees). Not with --data."),
    json_out: JsonOut = None,
    param: list[str] = typer.Option([], help="METHOD.KEY=VALUE method setting (repeatable)."),
    sweep: bool = typer.Option(False, help="Vary each method's knob; write the points and a Pareto PNG."),
    answers: bool = typer.Option(True, help="Also decode each method's greedy answer (agreement and task F1); "
                                 "--no-answers takes the teacher-forced measures only (KL, top-1, perplexity), "
                                 "in about half the time."),
    device: Device = "cpu",
    dtype: DType = "float32",
) -> None:
    """Quality and cost of each transfer method against the Oracle, side by side on the same prompts."""
    setup_logging(False)
    prefix = _on_off(native_prefix)
    from shared.artifacts import store
    from shared.codecs import CODECS, CodecContext, check_settings
    from shared.codecs.scd import PairArtifacts
    from shared.errors import SCDError
    from shared.model.fingerprint import weights_fingerprint
    from tools.data import SPLITS
    from tools.eval.harness import MAX_NEW_TOKENS, codec_method, evaluate
    from tools.eval.report import print_buckets, print_table

    if data_kind is not None and data_file is not None:  # it was ignored, and recorded as the data's kind
        raise typer.BadParameter("--kind picks built-in test data; with --data your file's test split is used (a "
                                 "record with a continuation is scored on it): leave --kind out")
    data_kind = data_kind or "qa"
    if data_kind not in ("qa", "lm", "heldout"):
        raise typer.BadParameter(f"--kind must be one of qa, lm, heldout; got {data_kind!r}")
    if split not in (*SPLITS, "all"):
        raise typer.BadParameter(f"--split must be one of {', '.join((*SPLITS, 'all'))}; got {split!r}")
    if data_kind == "heldout" and split != "test":
        raise typer.BadParameter("--kind heldout is one set of text calibration never reads, with no splits: leave "
                                 "--split out")
    if n is None and data_file is None:
        n = 48
    from shared.codecs import parse_variant

    labels = list(name_list(methods))
    try:
        variants = {m: parse_variant(m) for m in labels}  # a kind, or a kind with settings (scd:block_tokens=0.2)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    names = list(dict.fromkeys(kind for kind, _ in variants.values()))
    known_methods(names, allow=("auto",))
    if sweep and "auto" in names:
        raise typer.BadParameter("--sweep varies each method's knob; auto has none (leave it out of --methods)")
    params: dict[str, dict[str, str]] = {}
    for p in param:
        key, eq, value = p.partition("=")
        meth, dot, k = (x.strip() for x in key.partition("."))
        if not (eq and dot and meth and k):
            raise typer.BadParameter(f"--param takes METHOD.KEY=VALUE (scd.block_tokens=0.35), got {p!r}")
        if meth not in names:
            raise typer.BadParameter(f"--param {p!r}: method {meth!r} is not in --methods {names}")
        if k in params.get(meth, {}):
            raise typer.BadParameter(f"--param {meth}.{k} is given twice; give each setting once")
        params.setdefault(meth, {})[k] = value
    for lab, (kind, vp) in variants.items():  # a label's own setting and a --param for its kind, two values
        for k, v in vp.items():
            if params.get(kind, {}).get(k, v) != v:
                raise typer.BadParameter(f"--param {kind}.{k}={params[kind][k]} contradicts --methods {lab}; "
                                         "give each setting once")
    settings = {lab: {**params.get(kind, {}), **vp} or None for lab, (kind, vp) in variants.items()}
    for lab, (kind, _) in variants.items():  # refused before the models load, as each request would be
        try:
            check_settings(kind, settings[lab])
        except SCDError as e:
            raise typer.BadParameter(f"{lab}: {e}") from None
    t0 = time.perf_counter()
    check_data(data_file, *(SPLITS if split == "all" else (split,)), pair=pair, any_split=split == "all")
    from tools.assets.registry import calibration_missing

    where = store_dir or entry(pair).store_dir()
    own = {"droidspeak": "blocks", "spectrum": "int4"}  # a setting given in place of the profile's choice
    needed = [kind for lab, (kind, _) in variants.items()
              if kind not in own or (settings[lab] or {}).get(own[kind], "auto") == "auto"]
    if why := calibration_missing(list(dict.fromkeys(needed)), where, pair):  # before the models load
        fail(why)
    pm = pair_models(pair, device, dtype)
    store_dir = pm.store(store_dir)
    producer, consumer = pm.producer, pm.consumer
    pctx, cctx = CodecContext(producer), CodecContext(consumer)
    pfp, cfp = weights_fingerprint(producer.model), weights_fingerprint(consumer.model)
    if "auto" in names:  # auto may choose any method the pair has artifacts or a profile for
        from shared.engine import load_context

        try:
            pctx = load_context(producer, store_dir / pair, "producer", pfp, cfp, require=("auto",))
            cctx = load_context(consumer, store_dir / pair, "consumer", pfp, cfp, require=("auto",))
        except SCDError as e:
            fail(str(e))
    if any(m in CODECS and "artifacts" in CODECS[m].requires for m in names):
        try:
            folder = store_dir / pair
            meta, pt = store.load(folder, "producer", pfp, cfp)
            _, ct = store.load(folder, "consumer", pfp, cfp)
        except SCDError as e:
            fail(str(e))
        pctx.artifacts, cctx.artifacts = PairArtifacts(meta, pt, "producer"), PairArtifacts(meta, ct, "consumer")
    for kind in (m for m in names if m in CODECS and "profile" in CODECS[m].requires):
        try:
            prof = store.load_profile(store_dir, pair, kind, pfp, cfp)
        except SCDError as e:
            if kind not in needed:  # every label of it gives the setting the profile would choose
                continue
            fail(str(e))
        pctx.profiles[kind] = cctx.profiles[kind] = prof
    try:
        if sweep:
            from tools.eval import sweep as sw

            ds = pctx.profiles.get("droidspeak", {}).get("blocks")
            pl = pctx.artifacts.meta.patch_layers if pctx.artifacts else None
            pts = sw.points(names, ds, pl, pctx.artifacts.meta.patch_blocks if pctx.artifacts else None)
            runners = {lab: codec_method(kind, pctx, cctx, prm) for lab, kind, prm in pts}
        else:
            from tools.calibration.auto import auto_runner

            runners = {lab: auto_runner(pctx.profiles["auto"], pctx, cctx, settings[lab]) if kind == "auto"
                       else codec_method(kind, pctx, cctx, settings[lab]) for lab, (kind, _) in variants.items()}
    except SCDError as e:
        fail(str(e))
    hidden = sorted({l for r in runners.values() for l in getattr(r, "hidden_layers", ())})
    residual = sorted({l for r in runners.values() for l in getattr(r, "residual_layers", ())})
    its = items(pm, None if split == "all" else split, n, data_file, kinds=(data_kind,))
    lengths = sorted(len(it.prompt_ids) for it in its)
    typer.echo(f"scoring {len(its)} prompts of the {split} split ({lengths[0]}-{lengths[-1]} tokens) with "
               f"{len(runners)} methods: teacher-forced KL" + (f", and {len(runners) * len(its)} greedy answers of up "
                                                            f"to {MAX_NEW_TOKENS} tokens (--no-answers skips them)"
                                                            if answers else ""), err=True)
    res = evaluate(producer, consumer, pm.fmt, its, runners, prefix, hidden_layers=hidden, residual_layers=residual,
                   generate=answers)
    for lab, r in runners.items():  # what each KL was measured with (scd bench uses a KL only for the same)
        if hasattr(r, "identity") and lab in res["methods"]:
            res["methods"][lab]["identity"] = r.identity(pfp)
    rows = res.pop("rows")
    res.update(pair=pair, models={"producer": pfp, "consumer": cfp}, native_prefix=native_prefix, n=len(its),
               kind="user" if data_file else data_kind, answers=answers, split=split,
               data=str(data_file) if data_file else "built-in",
               seconds=round(time.perf_counter() - t0, 1))
    print_table(res, title=f"eval: pair={pair} native_prefix={native_prefix} split={split} n={len(its)}")
    print_buckets(res)
    if rows_json:
        rows_json.write_text("".join(json.dumps(r) + "\n" for r in rows))
        typer.echo(f"per-prompt scores: {rows_json} ({len(rows)} lines)", err=True)
    if "auto" in runners and not sweep:
        res["auto_choices"] = dict(runners["auto"].choices)
        typer.echo(f"auto chose: {', '.join(f'{k} x{v}' for k, v in runners['auto'].choices.most_common())}")
    if sweep:
        target = json_out.with_name(json_out.stem + ".sweep.json") if json_out else Path("sweep.json")
        body = sw.write(res["methods"], target, f"{pair}, native prefix {native_prefix}, n={len(its)}")
        typer.echo(f"pareto frontier: {body['pareto']}; points in {target}, plot in {body['png']}")
    if json_out:
        json_out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({"pair": pair, "native_prefix": native_prefix, "n": len(its),
                      "kl": {m: r["kl"] for m, r in res["methods"].items()}}))
