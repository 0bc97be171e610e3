"""``scd bench`` (TTFT over a rate-limited link between two network namespaces) and ``scd bench-overlap``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from tools.cli.app import app
from tools.cli.common import (
    Device,
    DType,
    JsonOut,
    Verbose,
    fail,
    finite_in,
    known_methods,
    name_list,
    output_file,
    setup_logging,
)


@app.command("bench-overlap")
def bench_overlap(
    pair: str = typer.Option("strong", help="A registered pair."),
    tokens: int = typer.Option(1000, min=1, help="Prompt length in tokens."),
    methods: str = typer.Option("raw", help="Comma-separated transfer methods."),
    iters: int = typer.Option(3, min=1, help="Timed requests per method, after a warm-up."),
    tiny: bool = typer.Option(False, help="Tiny random models (smoke test)."),
    json_out: JsonOut = None,
) -> None:
    """Benchmark: how much reconstruction overlaps the transfer (a table, then a JSON line)."""
    import grpc

    from shared.errors import SCDError
    from tools.eval import overlap

    names = known_methods(name_list(methods))
    if not tiny:  # before the models load
        from tools.assets.registry import calibration_missing
        from tools.cli.common import entry

        if why := calibration_missing(names, entry(pair).store_dir(), pair):
            fail(why)
    try:
        res = overlap.run(pair, tokens, names, iters, tiny)
    except grpc.RpcError as e:  # a request the services refused (a prompt over their limit, say)
        fail(f"{e.code().name}: {e.details()}", 1)
    except SCDError as e:
        fail(str(e))
    if json_out:
        json_out.write_text(json.dumps(res, indent=2) + "\n")


@app.command()
def bench(
    quick: bool = typer.Option(False, help="1 Gbit/s, one ~1,000-token prompt, methods oracle,raw,droidspeak,"
                                           "scd-reuse,scd, 3 repeats."),
    json_out: Optional[Path] = typer.Option(None, "--json", callback=output_file, help="Write the full results here."),
    png_out: Optional[Path] = typer.Option(None, "--png", callback=output_file,
                                           help="TTFT vs link rate plot (default: beside --json)."),
    methods: Optional[str] = typer.Option(None, help="Comma-separated methods (default: oracle,raw,quant,spectrum,"
                                                     "droidspeak,ridge,scd-reuse,scd)."),
    bandwidths: Optional[str] = typer.Option(None, help="Link rates in Mbit/s, comma-separated "
                                                        "(default 100,1000,10000)."),
    tokens: Optional[str] = typer.Option(None, help="Prompt lengths in tokens (default 500,1000,2000)."),
    repeats: Optional[int] = typer.Option(None, min=1, help="Requests per point after a warm-up (default 5; "
                                                           "--quick 3)."),
    delay_ms: float = typer.Option(0.0, callback=finite_in(0.0),
                                   help="One-way delay added on each direction of the link (needs netem)."),
    pair: str = typer.Option("strong", help="A registered pair (its models and artifact store)."),
    pipelining: bool = typer.Option(True, "--pipelining-comparison/--no-pipelining-comparison",
                                    help="Also time send-everything-then-reconstruct on the same link."),
    threads: Optional[int] = typer.Option(None, min=1, help="CPU threads per service (default: half the cores each)."),
    producer_model: Optional[str] = typer.Option(None, help="Producer model folder (default: the prepared one)."),
    consumer_model: Optional[str] = typer.Option(None, help="Consumer model folder (default: pair's prepared one)."),
    store: Optional[str] = typer.Option(None, help="Artifact store (default: the repo's artifacts/store)."),
    kl_json: Optional[str] = typer.Option(None, help="scd eval JSON with each method's KL, for the quality-aware "
                                                     "target (default: results/eval_all_PAIR_on.json)."),
    fleet: bool = typer.Option(False, help="One producer in front of every built-in consumer, mixed traffic: the "
                                           "Oracle vs fixed methods vs auto (--methods: the policies; --repeats: "
                                           "prompts per policy, each asked of every consumer; --quick: 3 prompts)."),
    clients: int = typer.Option(2, min=1, help="--fleet: requests in flight at once."),
    pairs: Optional[str] = typer.Option(None, help="--fleet: registered pairs sharing one producer, comma-separated "
                                                   "(default strong,mild,code,verse)."),
    device: Device = "cpu",
    dtype: DType = "float32",
    verbose: Verbose = False,
) -> None:
    """Benchmark: TTFT of every method through the real services, producer and consumer in two network
    namespaces joined by a rate-limited veth link (needs root). A table, a JSON file, a PNG, a JSON line."""
    setup_logging(verbose)
    from tools.bench import report
    from tools.bench.netns import BenchError
    from tools.bench.runner import BenchConfig, run

    if fleet:
        _fleet(quick, methods, bandwidths, tokens, repeats, clients, threads, device, dtype, json_out, png_out, pairs)
        return
    cfg = BenchConfig(argv=sys.argv[1:], delay_ms=delay_ms, pair=pair, pipelining=pipelining,
                      producer_model=producer_model, consumer_model=consumer_model, store=store, kl_json=kl_json,
                      device=device, dtype=dtype)
    if quick:
        cfg.methods, cfg.bandwidths_mbit, cfg.tokens, cfg.repeats = (
            ("oracle", "raw", "droidspeak", "scd-reuse", "scd"), (1000.0,), (1000,), 3)
    if methods is not None:  # given, even empty: an empty list is refused, not the default grid run
        cfg.methods = name_list(methods)
    if bandwidths is not None:
        cfg.bandwidths_mbit = _numbers(bandwidths, "--bandwidths", float)
    if tokens is not None:
        cfg.tokens = _numbers(tokens, "--tokens", int)
    if repeats:
        cfg.repeats = repeats
    if threads:
        cfg.threads = threads
    try:
        res = run(cfg)
    except BenchError as e:
        fail(str(e))
    _emit(res, report, json_out, png_out)
    _interrupted(res, f"{len(res['rows'])} point(s)")


def _numbers(value: str, option: str, kind) -> tuple:
    """A comma-separated option's positive numbers (``kind`` int: whole numbers); empty, zero,
    negative or non-finite values are refused with the option's name."""
    import math

    what = "whole numbers" if kind is int else "numbers"
    try:
        got = tuple(kind(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"{option} takes comma-separated positive {what}, got {value!r}") from None
    if not got or not all(math.isfinite(x) and x > 0 for x in got):
        raise typer.BadParameter(f"{option} takes comma-separated positive {what}, got {value!r}")
    return got


def _fleet(quick, methods, bandwidths, tokens, repeats, clients, threads, device, dtype, json_out, png_out,
           pairs) -> None:
    from tools.bench import fleet as fl
    from tools.bench.netns import BenchError

    cfg = fl.FleetConfig(clients=clients, device=device, dtype=dtype, argv=sys.argv[1:])
    if quick:
        cfg.prompts = 3
    if pairs is not None:
        cfg.pairs = name_list(pairs, "--pairs")
    if methods is not None:
        cfg.policies = name_list(methods)
    for option, value, kind, field in (("--bandwidths", bandwidths, float, "link_mbit"),
                                       ("--tokens", tokens, int, "tokens")):
        if value is not None:
            got = _numbers(value, option, kind)
            if len(got) != 1:
                raise typer.BadParameter(f"{option} takes one value with --fleet (one link, one prompt length), "
                                         f"got {value!r}")
            setattr(cfg, field, got[0])
    if repeats:
        cfg.prompts = repeats
    if threads:
        cfg.threads = threads
    try:
        res = fl.run(cfg)
    except BenchError as e:
        fail(str(e))
    _emit(res, fl, json_out, png_out)
    _interrupted(res, f"{len(res['policies'])} policy run(s)")


def _interrupted(res: dict, measured: str) -> None:
    """A run that Ctrl-C ended: its results were emitted; say so and exit 130."""
    if res["config"].get("interrupted"):
        typer.echo(f"interrupted: the results above are the {measured} measured before Ctrl-C", err=True)
        raise typer.Exit(130)


def _emit(res: dict, fmt, json_out: Optional[Path], png_out: Optional[Path]) -> None:
    """A benchmark's table, JSON file, plot (beside the JSON unless named) and final JSON line;
    ``fmt``: the module with its ``table``, ``png`` and ``final_line``."""
    typer.echo(fmt.table(res))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res, indent=2) + "\n")
    png_out = png_out or (json_out.with_suffix(".png") if json_out else None)
    if png_out:
        typer.echo(f"plot: {fmt.png(res, png_out)}", err=True)
    print(fmt.final_line(res, json_out))


@app.command()
def soak(
    minutes: float = typer.Option(10.0, callback=finite_in(0.5), help="Minutes of traffic (at least 0.5)."),
    pair: str = typer.Option("strong", help="A registered pair (both services run on this machine)."),
    clients: int = typer.Option(3, min=1, help="Client threads sending at once."),
    max_new_tokens: int = typer.Option(16, min=1, help="Tokens each request asks for."),
    seed: int = typer.Option(0, help="Seed of the traffic mix (prompts, methods, cancellations)."),
    faults: bool = typer.Option(False, "--faults", help="Add streams that fail part-way, straight to the consumer "
                                "(bad checksum, NaN, truncated, stalled, cancelled, sender killed, oversized, "
                                "undeclared tensor): each must get its one answer and leave no memory behind."),
    rss_every: int = typer.Option(200, min=1, help="Print both services' RSS every this many streams."),
    json_out: JsonOut = None,
) -> None:
    """Benchmark: minutes of mixed traffic (every method, HTTP and gRPC, streamed or not, cancellations,
    corrupt frames, a consumer restart) against both services; requests by outcome, TTFT, memory.
    Exits 1 if a request was lost or refused, a 5xx came outside the restart, or memory did not come back."""
    setup_logging(False)
    from tools.cli.common import entry, served_methods
    from tools.soak import METHODS, Soak, SoakError

    served = served_methods(entry(pair).store_dir(), pair)  # a pair without calibration: the methods it serves
    try:
        res = Soak(pair, minutes, clients, max_new_tokens, seed, tuple(m for m in METHODS if m in served),
                   faults=faults, rss_every=rss_every).run()
    except (SoakError, RuntimeError, TimeoutError) as e:  # refused, or a service that did not start
        fail(str(e), 1)
    if json_out:
        json_out.write_text(json.dumps(res, indent=2) + "\n")
    if not res["passed"]:
        sys.exit(1)
