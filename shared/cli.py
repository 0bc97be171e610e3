"""The ``scd`` command line."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="SCD serve: semantic KV-cache transfer between a base model and its fine-tuned variants.")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def _torch_dtype(name: str):
    import torch

    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise typer.BadParameter(f"expected one of {sorted(table)}, got {name!r}")
    return table[name]


@app.command()
def assets(
    force_data: bool = typer.Option(False, help="Rebuild the evaluation data even if present."),
    verbose: bool = typer.Option(False, "-v", "--verbose"),
) -> None:
    """Prepare every asset (idempotent): the producer model, the consumers, the data splits."""
    _setup_logging(verbose)
    from tqdm import tqdm

    from shared import data
    from shared.assets.models import PAIRS, build_consumer, convert_producer, load_tokenizer

    steps = [("producer model", convert_producer)] + [
        (f"consumer {p}", lambda p=p: build_consumer(p)) for p in PAIRS
    ]
    steps.append(("data splits", lambda: data.is_ready() and not force_data or data.build(load_tokenizer())))
    with tqdm(steps, desc="assets", unit="step") as bar:
        for name, fn in bar:
            bar.set_postfix_str(name)
            fn()
    from shared.paths import scd_home

    typer.echo(f"assets ready under {scd_home()}")


@app.command("train-adapter")
def train_adapter(
    pair: str = typer.Option(..., help="strong | mild"),
    out: Optional[Path] = typer.Option(None, help="Output folder (default: artifacts/adapters/PAIR)."),
) -> None:
    """Train a consumer's LoRA adapter from the producer (reproduces the committed adapters)."""
    _setup_logging(True)
    from shared.assets.train import RECIPES, train

    if pair not in RECIPES:
        raise typer.BadParameter(f"expected one of {sorted(RECIPES)}, got {pair!r}")
    typer.echo(str(train(pair, out)))


@app.command()
def drift(
    pair: str = typer.Option("strong", help="Consumer pair: strong | mild."),
    n: int = typer.Option(48, min=1, help="Number of test prompts."),
    native_prefix: str = typer.Option("on", help="on | off: consumer's own K/V for the fixed template prefix."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
    device: str = typer.Option("cpu"),
    dtype: str = typer.Option("float32"),
    verbose: bool = typer.Option(False, "-v", "--verbose"),
) -> None:
    """How far the pair's caches disagree: Oracle vs raw transfer on the test split."""
    _setup_logging(verbose)
    if native_prefix not in ("on", "off"):
        raise typer.BadParameter(f"expected one of ['off', 'on'], got {native_prefix!r}")
    from shared import data
    from shared.assets.models import consumer_dir, load_model, load_tokenizer, producer_dir
    from shared.eval.harness import evaluate, oracle, raw
    from shared.eval.report import print_layers, print_table
    from shared.model.hf_adapter import ModelAdapter

    t0 = time.perf_counter()
    td = _torch_dtype(dtype)
    producer = ModelAdapter(load_model(producer_dir(), device, td))
    consumer = ModelAdapter(load_model(consumer_dir(pair), device, td))
    tok = load_tokenizer()
    items = data.load("qa", "test", n)
    res = evaluate(producer, consumer, tok, items, {"oracle": oracle, "raw": raw}, native_prefix == "on")
    res.update(pair=pair, native_prefix=native_prefix, n=len(items), seconds=round(time.perf_counter() - t0, 1))
    print_table(res, title=f"drift: pair={pair} native_prefix={native_prefix} n={len(items)}")
    print_layers(res)
    if json_out:
        json_out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({"pair": pair, "native_prefix": native_prefix, "n": len(items),
                      "raw_kl": res["methods"]["raw"]["kl"], "raw_agree_f1": res["methods"]["raw"]["agree_f1"]}))


@app.command()
def anatomy(
    pair: str = typer.Option("strong", help="Consumer pair: strong | mild."),
    n_cal: int = typer.Option(64, min=2, help="Calibration prompts for the ridge-map probes."),
    n_val: int = typer.Option(24, min=1, help="Validation prompts scored."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
    device: str = typer.Option("cpu"),
    dtype: str = typer.Option("float32"),
) -> None:
    """Where the pair's drift lives (validation split): the consumer's own K/V on some layers,
    full-rank per-token maps, and blocks of its own layers recomputed. Prints a table and JSON."""
    from shared import data
    from shared.eval.anatomy import run

    t0 = time.perf_counter()
    producer, consumer, tok = _pair_models(pair, device, dtype)
    qa, lm = data.load("qa", "calibration"), data.load("lm", "calibration")
    cal = [x.prompt_ids[:1024] for pair_ in zip(qa, lm) for x in pair_][:n_cal]
    val = [(it.prompt_ids, it.prefix_len) for it in data.load("qa", "validation")][:n_val]
    res = run(producer, consumer, cal, val, data.stop_ids(tok))
    typer.echo(f"anatomy: pair={pair} native_prefix=on n={len(val)} (KL of the Oracle's answer, nats/token)")
    for name, kl in res.items():
        typer.echo(f"  {name:58s} {kl:.4f}")
    body = {"pair": pair, "n": len(val), "n_cal": len(cal), "kl": res, "seconds": round(time.perf_counter() - t0, 1)}
    if json_out:
        json_out.write_text(json.dumps(body, indent=2) + "\n")
    print(json.dumps(body))


serve_app = typer.Typer(no_args_is_help=True, help="Run a producer or consumer gRPC service.")
app.add_typer(serve_app, name="serve")


def _serve(load_engine, build_server, settings) -> None:
    import asyncio

    from shared.errors import SCDError

    async def run() -> None:
        engine = load_engine(settings)
        built = build_server(engine)
        server, servicer = built if isinstance(built, tuple) else (built, None)
        port = await server.start()
        typer.echo(f"{type(settings).__name__.replace('Settings', '').lower()} listening on "
                   f"{settings.server.host}:{port}", err=True)
        if getattr(server, "http", None) is not None:
            typer.echo(f"HTTP (health, metrics{', OpenAI API' if servicer else ''}) on "
                       f"{settings.http.host}:{server.http.port}", err=True)
        try:
            await server.serve_until_signal(settings.server.grace_s)
        finally:
            if servicer is not None:
                await servicer.close()
            engine.close()

    try:
        asyncio.run(run())
    except (SCDError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _load_settings(cls, config, overrides, **kw):
    from shared.errors import ConfigError

    try:
        return cls.load(config, overrides, **{k: v for k, v in kw.items() if v is not None})
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@serve_app.command("consumer")
def serve_consumer(
    name: Optional[str] = typer.Option(None, help="Consumer name (default: strong)."),
    model: Optional[str] = typer.Option(None, help="Model folder; default: the prepared model of pair NAME."),
    host: Optional[str] = typer.Option(None),
    port: Optional[int] = typer.Option(None),
    store: Optional[str] = typer.Option(None, help="Artifact store directory (default: the repo's artifacts/store)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML settings file."),
    set_: list[str] = typer.Option([], "--set", help="Override a setting: a.b=value (repeatable)."),
    verbose: bool = typer.Option(False, "-v", "--verbose"),
) -> None:
    """Serve a consumer: receives cache streams, reconstructs layer by layer, decodes."""
    _setup_logging(verbose)
    from consumer_service.server import build_server, load_engine
    from consumer_service.settings import ConsumerSettings
    from shared.assets.models import consumer_dir

    from shared.paths import STORE_DIR

    server = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    quick = not config and not set_
    if model is None and quick:
        model = str(consumer_dir(name or "strong"))
    extra = {}
    if quick:  # no settings file: serve what the store holds for this consumer
        store_dir = Path(store) if store else STORE_DIR
        extra["artifact_store"] = str(store_dir)
        methods = ["oracle", "raw", "quant"]
        if (store_dir / (name or "strong") / "meta.json").exists():
            methods += ["scd-reuse", "scd"]
        else:
            typer.echo(f"note: no SCD artifacts for consumer {name or 'strong'!r} in {store_dir} "
                       "(run `scd calibrate`): scd is not served", err=True)
        for kind in ("spectrum", "droidspeak", "ridge"):  # baselines whose profile the store holds
            if (store_dir / f"{name or 'strong'}.{kind}.json").exists():
                methods.append(kind)
        extra["methods"] = methods
    elif store:
        extra["artifact_store"] = store
    s = _load_settings(ConsumerSettings, config, set_, name=name, model={"path": model} if model else None,
                       server=server or None, **extra)
    _serve(load_engine, build_server, s)


@serve_app.command("producer")
def serve_producer(
    consumer: list[str] = typer.Option([], help="NAME=HOST:PORT of a consumer (repeatable)."),
    model: Optional[str] = typer.Option(None, help="Model folder; default: the prepared producer."),
    host: Optional[str] = typer.Option(None),
    port: Optional[int] = typer.Option(None),
    store: Optional[str] = typer.Option(None, help="Artifact store directory (default: the repo's artifacts/store)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML settings file."),
    set_: list[str] = typer.Option([], "--set", help="Override a setting: a.b=value (repeatable)."),
    verbose: bool = typer.Option(False, "-v", "--verbose"),
) -> None:
    """Serve the producer: prefills with the base model and streams the cache to consumers."""
    _setup_logging(verbose)
    from producer_service.server import build_server, load_engine
    from producer_service.settings import ProducerSettings
    from shared.assets.models import producer_dir

    from shared.paths import STORE_DIR

    store_dir = Path(store) if store else STORE_DIR
    consumers = {}
    for c in consumer:
        if "=" not in c:
            raise typer.BadParameter(f"--consumer {c!r} must look like NAME=HOST:PORT")
        n, addr = c.split("=", 1)
        consumers[n] = {"address": addr}
        if (store_dir / n / "meta.json").exists():  # the pair's artifacts, when calibrated
            consumers[n]["artifacts"] = str(store_dir / n)
    server = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    if model is None and not config and not any(o.startswith("model.") for o in set_):
        model = str(producer_dir())
    s = _load_settings(ProducerSettings, config, set_, model={"path": model} if model else None,
                       server=server or None, consumers=consumers or None)
    _serve(load_engine, build_server, s)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text (wrapped in the chat template)."),
    producer: str = typer.Option("127.0.0.1:50051", help="HOST:PORT of the producer."),
    consumer: str = typer.Option("strong", help="Consumer name."),
    method: str = typer.Option("", help="Transfer method (default: the producer's)."),
    param: list[str] = typer.Option([], help="Method setting KEY=VALUE (repeatable)."),
    max_new_tokens: int = typer.Option(64),
    temperature: float = typer.Option(0.0),
    top_p: float = typer.Option(1.0),
    stop: list[str] = typer.Option([]),
    seed: int = typer.Option(0),
    native_prefix: bool = typer.Option(True, help="Consumer uses its own K/V for the template prefix."),
    timeout: float = typer.Option(120.0, help="Deadline in seconds."),
    token: Optional[str] = typer.Option(None, envvar="SCD_TOKEN", help="Bearer token (or env SCD_TOKEN)."),
    tls_ca: Optional[Path] = typer.Option(None, help="PEM CA to verify a TLS producer."),
) -> None:
    """Send a prompt to the producer and print the consumer's tokens as they stream."""
    import grpc

    from shared import client

    params = dict(p.split("=", 1) for p in param if "=" in p)
    req = client.request(prompt, consumer, method, max_new_tokens, temperature, top_p, tuple(stop), seed,
                         native_prefix, params)
    try:
        res = client.generate(producer, req, timeout, on_event=lambda ev: print(ev.text, end="", flush=True),
                              token=token, root_certificates=tls_ca.read_bytes() if tls_ca else None)
    except grpc.RpcError as e:
        typer.echo(f"\nerror: {e.code().name}: {e.details()}", err=True)
        raise typer.Exit(1) from None
    t = res.timings
    print()
    typer.echo(f"[{t.method}] TTFT {t.ttft_ms:.0f} ms | {t.wire_bytes:,} bytes on the wire | "
               f"prefill {t.prefill_ms:.0f} ms, encode {t.encode_ms:.0f} ms, reconstruct {t.reconstruct_ms:.0f} ms | "
               f"{t.completion_tokens} tokens at {t.decode_tokens_per_s:.1f} tok/s | finish {res.finish_reason}")


@app.command()
def demo(
    pair: str = typer.Option("strong"),
    methods: str = typer.Option("oracle,raw,scd", help="Comma-separated transfer methods."),
    max_new_tokens: int = typer.Option(24),
) -> None:
    """Start a consumer and a producer on localhost, stream a real answer per method, shut down."""
    from shared import demo as d

    d.run(pair, tuple(m for m in methods.split(",") if m), max_new_tokens)


@app.command("bench-overlap")
def bench_overlap(
    pair: str = typer.Option("strong"),
    tokens: int = typer.Option(1000, help="Prompt length in tokens."),
    methods: str = typer.Option("raw"),
    iters: int = typer.Option(3),
    tiny: bool = typer.Option(False, help="Tiny random models (smoke test)."),
    json_out: Optional[Path] = typer.Option(None, "--json"),
) -> None:
    """Benchmark: how much reconstruction overlaps the transfer (a table, then a JSON line)."""
    from shared.eval import overlap

    res = overlap.run(pair, tokens, tuple(methods.split(",")), iters, tiny)
    if json_out:
        json_out.write_text(json.dumps(res, indent=2) + "\n")


@app.command()
def bench(
    quick: bool = typer.Option(False, help="1 Gbit/s, one ~1,000-token prompt, methods oracle,raw,scd, 3 repeats."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the full results here."),
    png_out: Optional[Path] = typer.Option(None, "--png", help="TTFT vs link rate plot (default: beside --json)."),
    methods: Optional[str] = typer.Option(None, help="Comma-separated methods (default: oracle,raw,quant,spectrum,"
                                                     "droidspeak,ridge,scd-reuse,scd)."),
    bandwidths: Optional[str] = typer.Option(None, help="Link rates in Mbit/s, comma-separated (default 100,1000,10000)."),
    tokens: Optional[str] = typer.Option(None, help="Prompt lengths in tokens (default 500,1000,2000)."),
    repeats: Optional[int] = typer.Option(None, min=1, help="Requests per point after a warm-up (default 5; --quick 3)."),
    delay_ms: float = typer.Option(0.0, help="One-way delay added on each direction of the link (needs netem)."),
    pair: str = typer.Option("strong", help="Consumer pair (its prepared model and artifacts)."),
    pipelining: bool = typer.Option(True, "--pipelining-comparison/--no-pipelining-comparison",
                                    help="Also time send-everything-then-reconstruct on the same link."),
    threads: Optional[int] = typer.Option(None, min=1, help="CPU threads per service (default: half the cores each)."),
    producer_model: Optional[str] = typer.Option(None, help="Producer model folder (default: the prepared one)."),
    consumer_model: Optional[str] = typer.Option(None, help="Consumer model folder (default: pair's prepared one)."),
    store: Optional[str] = typer.Option(None, help="Artifact store (default: the repo's artifacts/store)."),
    kl_json: Optional[str] = typer.Option(None, help="scd eval JSON with each method's KL, for the quality-aware "
                                                     "target (default: results/eval_all_PAIR_on.json)."),
    device: str = typer.Option("cpu"),
    dtype: str = typer.Option("float32"),
    verbose: bool = typer.Option(False, "-v", "--verbose"),
) -> None:
    """Benchmark: TTFT of every method through the real services, producer and consumer in two network
    namespaces joined by a rate-limited veth link (needs root). A table, a JSON file, a PNG, a JSON line."""
    _setup_logging(verbose)
    from shared.bench import report
    from shared.bench.netns import BenchError
    from shared.bench.runner import BenchConfig, run

    def floats(s):
        try:
            return tuple(float(x) for x in s.split(",") if x)
        except ValueError:
            raise typer.BadParameter(f"expected comma-separated numbers, got {s!r}") from None

    cfg = BenchConfig(argv=sys.argv[1:], delay_ms=delay_ms, pair=pair, pipelining=pipelining,
                      producer_model=producer_model, consumer_model=consumer_model, store=store, kl_json=kl_json,
                      device=device, dtype=dtype)
    if quick:
        cfg.methods, cfg.bandwidths_mbit, cfg.tokens, cfg.repeats = ("oracle", "raw", "scd"), (1000.0,), (1000,), 3
    if methods:
        cfg.methods = tuple(m for m in methods.split(",") if m)
    if bandwidths:
        cfg.bandwidths_mbit = floats(bandwidths)
    if tokens:
        cfg.tokens = tuple(int(x) for x in floats(tokens))
    if repeats:
        cfg.repeats = repeats
    if threads:
        cfg.threads = threads
    try:
        res = run(cfg)
    except BenchError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(report.table(res))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res, indent=2) + "\n")
    png_out = png_out or (json_out.with_suffix(".png") if json_out else None)
    if png_out:
        typer.echo(f"plot: {report.png(res, png_out)}", err=True)
    print(report.final_line(res, json_out))


def _pair_models(pair: str, device: str, dtype: str):
    from shared.assets.models import consumer_dir, load_model, load_tokenizer, producer_dir
    from shared.model.hf_adapter import ModelAdapter

    td = _torch_dtype(dtype)
    return (ModelAdapter(load_model(producer_dir(), device, td)), ModelAdapter(load_model(consumer_dir(pair), device, td)),
            load_tokenizer())


@app.command()
def calibrate(
    pair: str = typer.Option("strong", help="Consumer pair: strong | mild."),
    out: Path = typer.Option(Path("artifacts/store"), help="Artifact store directory."),
    data_file: Optional[Path] = typer.Option(None, "--data", help="Calibrate on your own prompts (JSONL)."),
    set_: list[str] = typer.Option([], "--set", help="Calibration setting KEY=VALUE, e.g. r_k=64 (repeatable)."),
    method: str = typer.Option("scd", help="scd (REUSE + PATCH artifacts), droidspeak (recompute blocks), ridge "
                                          "(cross-model maps) or spectrum (int4 probe)."),
    device: str = typer.Option("cpu"),
    dtype: str = typer.Option("float32"),
    verbose: bool = typer.Option(True, "-v/-q", "--verbose/--quiet"),
) -> None:
    """Calibrate SCD for a pair (REUSE maps, PATCH aligners, layer selection) into the artifact store, or
    profile DroidSpeak's recompute blocks (--method droidspeak)."""
    _setup_logging(verbose)
    import yaml

    from shared import data
    from shared.calibration.pipeline import CalibrationSettings, calibrate as run, data_hash

    overrides = {}
    for item in set_:
        if "=" not in item:
            raise typer.BadParameter(f"--set {item!r} must look like key=value")
        k, v = item.split("=", 1)
        overrides[k] = yaml.safe_load(v)
    try:
        cfg = CalibrationSettings(pair=pair, **overrides) if method == "scd" else None
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    producer, consumer, tok = _pair_models(pair, device, dtype)
    val = [(it.prompt_ids, it.prefix_len) for it in data.load("qa", "validation")]

    def save_profile(prof: dict, tensors=None) -> Path:
        """A baseline's profile into the store, pinned to both models."""
        from shared.artifacts import store
        from shared.model.fingerprint import weights_fingerprint

        return store.save_profile(out, pair, method, prof, weights_fingerprint(producer.model),
                                  weights_fingerprint(consumer.model), tensors=tensors)

    if method == "droidspeak":
        from shared.calibration.droidspeak import profile

        prof = profile(producer, consumer, val, stop_ids=data.stop_ids(tok), **overrides)
        typer.echo(f"droidspeak blocks {prof['blocks']} written to {save_profile(prof)}")
        typer.echo(json.dumps(prof["report"]))
        return
    if method == "spectrum":
        from shared.calibration.spectrum import probe

        prof = probe(producer, consumer, val, **overrides)
        typer.echo(f"spectrum int4 {'allowed' if prof['int4'] else 'disabled (two-tier fp16 + int8)'}; written to "
                   f"{save_profile(prof)}")
        typer.echo(json.dumps(prof["report"]))
        return
    if method not in ("scd", "ridge"):
        raise typer.BadParameter(f"expected one of ['droidspeak', 'ridge', 'scd', 'spectrum'], got {method!r}")
    if data_file:
        cal = [it.prompt_ids for it in data.load_jsonl_prompts(data_file, tok)]
    else:  # interleave QA and LM calibration prompts
        qa, lm = data.load("qa", "calibration"), data.load("lm", "calibration")
        cal = [x.prompt_ids for pair_ in zip(qa, lm) for x in pair_] + [x.prompt_ids for x in qa[len(lm):]]
    if method == "ridge":
        from shared.calibration.ridge import calibrate as fit_ridge

        n_prompts = int(overrides.pop("n_prompts", 64))
        tensors, prof = fit_ridge(producer, consumer, cal[:n_prompts], val, stop_ids=data.stop_ids(tok), **overrides)
        path = save_profile(prof, tensors)
        r = prof["report"]
        typer.echo(f"ridge maps (top_k={prof['top_k']}, alpha={prof['alpha']}) written to {path}; validation KL "
                   f"{r['kl']:.4f} vs raw {r['raw_kl']:.4f}")
        typer.echo(json.dumps({k: v for k, v in r.items() if k != "r2_per_layer"}))
        return
    folder, report = run(producer, consumer, cal, val, cfg, str(out), data_hash(cal[: cfg.n_prompts]),
                         stop_ids=data.stop_ids(tok))
    v = report["validation"]
    typer.echo(f"artifacts written to {folder}")
    typer.echo(f"validation KL: raw {v['raw_kl']:.4f} | REUSE only {v['reuse_only_kl']:.4f} | "
               f"SCD {report['selected_kl']:.4f}; patch layers {[p['layer'] for p in report['greedy_path'][:cfg.budget_k]]}"
               + (f"; PATCH block {blk[0]}-{blk[1] - 1} (REUSE + block {v['block_kl']:.4f})"
                  if (blk := report.get("patch_block")) else ""))
    if report["selected_kl"] >= v["raw_kl"]:
        typer.echo(f"warning: on validation SCD is worse than raw transfer for pair {pair!r} (KL "
                   f"{report['selected_kl']:.4f} vs {v['raw_kl']:.4f}): its caches barely drift and the lossy code "
                   "costs more than it corrects; serve raw or quant to this consumer", err=True)
    typer.echo(json.dumps({"stage_seconds": report["stage_seconds"], "validation": v, "selected_kl": report["selected_kl"]}))


@app.command("eval")
def eval_(
    pair: str = typer.Option("strong"),
    methods: str = typer.Option("oracle,raw,scd-reuse,scd", help="Comma-separated transfer methods."),
    n: int = typer.Option(48, min=1, help="Number of test prompts."),
    native_prefix: str = typer.Option("on", help="on | off"),
    store_dir: Path = typer.Option(Path("artifacts/store"), "--store", help="Artifact store directory."),
    data_file: Optional[Path] = typer.Option(None, "--data", help="Evaluate on your own prompts (JSONL)."),
    json_out: Optional[Path] = typer.Option(None, "--json"),
    param: list[str] = typer.Option([], help="METHOD.KEY=VALUE method setting (repeatable)."),
    sweep: bool = typer.Option(False, help="Vary each method's knob; write the points and a Pareto PNG."),
    device: str = typer.Option("cpu"),
    dtype: str = typer.Option("float32"),
) -> None:
    """Quality and cost of each transfer method against the Oracle, side by side on the same prompts."""
    _setup_logging(False)
    if native_prefix not in ("on", "off"):
        raise typer.BadParameter(f"expected one of ['off', 'on'], got {native_prefix!r}")
    from shared import data
    from shared.codecs import CODECS, CodecContext
    from shared.codecs.scd import PairArtifacts
    from shared.errors import SCDError
    from shared.eval.harness import codec_method, evaluate
    from shared.eval.report import print_table
    from shared.artifacts import store
    from shared.model.fingerprint import weights_fingerprint

    names = [m for m in methods.split(",") if m]
    unknown = [m for m in names if m not in CODECS]
    if unknown:
        raise typer.BadParameter(f"unknown methods {unknown}; expected some of {sorted(CODECS)}")
    params: dict[str, dict[str, str]] = {}
    for p in param:
        key, _, value = p.partition("=")
        meth, _, k = key.partition(".")
        params.setdefault(meth, {})[k] = value
    t0 = time.perf_counter()
    producer, consumer, tok = _pair_models(pair, device, dtype)
    pctx, cctx = CodecContext(producer), CodecContext(consumer)
    if any(m.startswith("scd") for m in names):
        try:
            folder = store_dir / pair
            pfp, cfp = weights_fingerprint(producer.model), weights_fingerprint(consumer.model)
            meta, pt = store.load(folder, "producer", pfp, cfp)
            _, ct = store.load(folder, "consumer", pfp, cfp)
        except SCDError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        pctx.artifacts, cctx.artifacts = PairArtifacts(meta, pt, "producer"), PairArtifacts(meta, ct, "consumer")
    from shared.eval.harness import oracle

    for kind in (m for m in names if "profile" in CODECS[m].requires):
        try:
            prof = store.load_profile(store_dir, pair, kind, weights_fingerprint(producer.model),
                                      weights_fingerprint(consumer.model))
        except SCDError as e:
            explicit = (kind == "droidspeak" and params.get(kind, {}).get("blocks", "auto") != "auto") or \
                       (kind == "spectrum" and params.get(kind, {}).get("int4", "auto") != "auto")
            if explicit:
                continue
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        pctx.profiles[kind] = cctx.profiles[kind] = prof
    if sweep:
        from shared.eval import sweep as sw

        ds = pctx.profiles.get("droidspeak", {}).get("blocks")
        pl = pctx.artifacts.meta.patch_layers if pctx.artifacts else None
        pts = sw.points(names, ds, pl, pctx.artifacts.meta.patch_blocks if pctx.artifacts else None)
        runners = {lab: oracle if kind == "oracle" else codec_method(kind, pctx, cctx, prm) for lab, kind, prm in pts}
    else:
        runners = {m: oracle if m == "oracle" else codec_method(m, pctx, cctx, params.get(m)) for m in names}
    hidden = sorted({l for r in runners.values() for l in getattr(r, "hidden_layers", ())})
    residual = sorted({l for r in runners.values() for l in getattr(r, "residual_layers", ())})
    items = data.load_jsonl_prompts(data_file, tok)[:n] if data_file else data.load("qa", "test", n)
    res = evaluate(producer, consumer, tok, items, runners, native_prefix == "on", hidden_layers=hidden,
                   residual_layers=residual)
    res.update(pair=pair, native_prefix=native_prefix, n=len(items), seconds=round(time.perf_counter() - t0, 1))
    print_table(res, title=f"eval: pair={pair} native_prefix={native_prefix} n={len(items)}")
    if sweep:
        target = json_out.with_name(json_out.stem + ".sweep.json") if json_out else Path("sweep.json")
        body = sw.write(res["methods"], target, f"{pair}, native prefix {native_prefix}, n={len(items)}")
        typer.echo(f"pareto frontier: {body['pareto']}; points in {target}, plot in {body['png']}")
    if json_out:
        json_out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({"pair": pair, "native_prefix": native_prefix, "n": len(items),
                      "kl": {m: r["kl"] for m, r in res["methods"].items()}}))


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
