"""``scd serve consumer|producer``, ``scd generate`` and ``scd demo``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from tools.cli.app import app
from tools.cli.common import Verbose, bearer_token, check_store, fail, finite_in, served_methods, setup_logging

serve_app = typer.Typer(no_args_is_help=True, help="Run a producer or consumer gRPC service.")
app.add_typer(serve_app, name="serve")

# the options both services take
Host = Annotated[Optional[str], typer.Option(help="Listen address (default: the settings').")]
Port = Annotated[Optional[int], typer.Option(help="gRPC port (default: the settings'; 0 picks a free one).")]
Config = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML settings file.")]
Sets = Annotated[list[str], typer.Option("--set", help="Override a setting: a.b=value (repeatable).")]


def _serve(load_engine, build_server, settings) -> None:
    import asyncio

    from shared.errors import SCDError

    async def run() -> None:
        from shared.rpc.server import address, check_can_listen

        settings.security.check()  # its files, and the addresses below, before minutes of model loading
        check_can_listen(settings.server.host, settings.server.port, "server")
        check_can_listen(settings.http.host, settings.http.port, "http")
        hosts = {settings.server.host, settings.http.host}
        if settings.http.port and settings.http.port == settings.server.port and (
                len(hosts) == 1 or hosts & {"", "0.0.0.0", "::"}):  # each port is free alone, not both
            raise SCDError(f"server.port and http.port are both {settings.server.port}: give the HTTP front another "
                           "port (--set http.port=N; 0 picks a free one)")
        engine = load_engine(settings)
        built = build_server(engine)
        server, servicer = built if isinstance(built, tuple) else (built, None)
        port = await server.start()
        typer.echo(f"{type(settings).__name__.replace('Settings', '').lower()} listening on "
                   f"{address(settings.server.host, port)}", err=True)
        if getattr(server, "http", None) is not None:
            typer.echo(f"HTTP (health, metrics{', OpenAI API' if servicer else ''}) on "
                       f"{address(settings.http.host, server.http.port)}", err=True)
        try:
            await server.serve_until_signal(settings.server.grace_s)
        finally:
            if servicer is not None:
                await servicer.close()
            engine.close()

    try:
        asyncio.run(run())
    except (SCDError, OSError) as e:
        fail(str(e))


def _load_settings(cls, config, overrides, defaults=None, hint: str = "", **kw):
    """Settings from ``defaults`` (what the store holds), the file, the environment, ``--set``, then
    the explicit flags in ``kw`` (None: not given); ``hint``: said when no model folder was given."""
    from shared.errors import ConfigError

    try:
        return cls.load(config, overrides, defaults=defaults, **{k: v for k, v in kw.items() if v is not None})
    except ConfigError as e:
        no_model = re.search(r"(^|\s)model(\.path)?: Field required", str(e))  # no model folder, or none at all
        fail(f"{hint}\n{e}" if hint and no_model else str(e))


def _registered(name: str):
    """The registry entry of ``name``, or None when it is not a registered pair."""
    from shared.errors import SCDError
    from tools.assets import registry

    try:
        return registry.load().pairs.get(name)
    except SCDError as e:
        fail(str(e))


def _note_missing_store(store: str | None) -> None:
    """Not an error: a store may be filled later (raw and oracle need none); a file is one."""
    if store:
        check_store(Path(store))
    if store and not Path(store).is_dir():
        typer.echo(f"note: --store {store} is not a folder (yet): only methods that need no calibration are served",
                   err=True)


@serve_app.command("consumer")
def serve_consumer(
    pair: Optional[str] = typer.Option(None, help="A registered pair: its consumer model, name and artifact store."),
    name: Optional[str] = typer.Option(None, help="Consumer name (default: the pair's name, else strong)."),
    model: Optional[str] = typer.Option(None, help="Model folder (default: the pair's consumer)."),
    adapter: Optional[str] = typer.Option(None, help="LoRA adapter folder merged into --model at load."),
    store: Optional[str] = typer.Option(None, help="Artifact store directory (default: the pair's store)."),
    host: Host = None, port: Port = None, config: Config = None, set_: Sets = [], verbose: Verbose = False,  # noqa: B006
) -> None:
    """Serve a consumer: receives cache streams, reconstructs layer by layer, decodes."""
    setup_logging(verbose, service=True)
    from consumer_service.server import build_server, load_engine
    from consumer_service.settings import ConsumerSettings

    server = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    quick = not config and not set_
    if adapter and model is None:  # a pair's consumer is already a folder or a folder and its adapter
        fail("--adapter is merged into --model: give the folder it was trained on with --model (or register the "
             "pair with `scd pair add NAME --producer DIR --consumer-adapter DIR` and serve --pair NAME)")
    _note_missing_store(store)
    e = None
    if pair or (quick and model is None):
        pair = pair or name or "strong"
        e = _registered(pair)
        if e is None:
            from shared.errors import SCDError
            from tools.assets import registry

            try:
                registry.get(pair)  # raises, with the command that registers it (scd assets for a built-in pair)
            except SCDError as err:
                fail(f"{err}; or give --model")
    # what the pair gives is a default: a file, the environment or --set overrides it, a flag beats all
    defaults: dict = {}
    if e is not None:
        defaults["name"] = e.name
        defaults["producer_fingerprint"] = e.producer_fingerprint  # a producer of other weights is refused
        if model is None:
            pair_model, pair_adapter = e.consumer_model()
            defaults["model"] = {"path": pair_model, **({"adapter": pair_adapter} if pair_adapter else {}),
                                 "fingerprint": e.consumer_fingerprint}  # weights changed since are refused
            defaults["tokenizer"] = e.tokenizer  # the consumer's folder's, else the producer's (scd pair add)
    store_dir = Path(store) if store else (e.store_dir() if e else None)
    if quick and store_dir is None:
        from tools.assets.registry import default_store

        store_dir = default_store(builtin=True)
    if store_dir is not None:  # serve what the store holds for this consumer, unless the settings list methods
        defaults["artifact_store"] = str(store_dir)
        defaults["methods"] = served_methods(store_dir, name or defaults.get("name") or "strong")
    mod = {"path": model, **({"adapter": adapter} if adapter else {})} if model else None
    s = _load_settings(ConsumerSettings, config, set_, defaults, name=name, model=mod, server=server or None,
                       artifact_store=store, whole={"model.path": ("model", "tokenizer")})
    _serve(load_engine, build_server, s)


@serve_app.command("producer")
def serve_producer(
    consumer: list[str] = typer.Option([], help="NAME=HOST:PORT of a consumer (repeatable); a registered pair's "
                                                "NAME brings its producer model, tokenizer and artifacts."),
    model: Optional[str] = typer.Option(None, help="Model folder (default: the registered pairs' producer)."),
    store: Optional[str] = typer.Option(None, help="Artifact store directory (default: each pair's store)."),
    host: Host = None, port: Port = None, config: Config = None, set_: Sets = [], verbose: Verbose = False,  # noqa: B006
) -> None:
    """Serve the producer: prefills with the base model and streams the cache to consumers."""
    setup_logging(verbose, service=True)
    from producer_service.server import build_server, load_engine
    from producer_service.settings import ProducerSettings

    _note_missing_store(store)
    consumers, producers, offered = {}, set(), ["oracle", "raw", "quant", "scd-reuse", "scd", "auto"]
    pair_gives: dict = {}  # what a registered pair gives a consumer: a default that a file, variable or --set beats
    for c in consumer:
        if "=" not in c:
            raise typer.BadParameter(f"--consumer {c!r} must look like NAME=HOST:PORT")
        n, addr = c.split("=", 1)
        if n in consumers:
            raise typer.BadParameter(f"--consumer {n!r} is given twice; give each consumer once")
        consumers[n] = {"address": addr}
        e = _registered(n)
        if e is not None:
            producers.add((e.producer, e.producer_fingerprint))
            pair_gives[n] = {"tokenizer": e.tokenizer}
        if store:
            store_dir = Path(store)
        elif e is not None:
            store_dir = e.store_dir()
        else:
            from tools.assets.registry import default_store

            store_dir = default_store(builtin=True)
        from tools.assets.registry import profile_files

        profiled = profile_files(check_store(store_dir), n)
        if (store_dir / n / "meta.json").exists() or profiled:
            pair_gives.setdefault(n, {})["artifacts"] = str(store_dir / n)  # its artifacts and profiles
            offered += [k for k in profiled if k not in offered]  # baselines profiled for this pair (auto is)
    defaults: dict = {"methods": offered, **({"consumers": pair_gives} if pair_gives else {})}
    if model is None and len(producers) <= 1:  # a default: a file, variable or --set model.path beats it
        if producers:
            path, fingerprint = producers.pop()
            defaults["model"] = {"path": path, "fingerprint": fingerprint}  # weights changed since are refused
        else:
            from tools.assets.models import producer_dir

            defaults["model"] = {"path": str(producer_dir())}
    s = _load_settings(ProducerSettings, config, set_, defaults, model={"path": model} if model else None,
                       server={k: v for k, v in (("host", host), ("port", port)) if v is not None} or None,
                       consumers=consumers or None, whole={"model.path": ("model",)},
                       hint=(f"the registered consumers have different producers ({sorted(p for p, _ in producers)}); "
                             "one producer serves consumers of one base model: give --model")
                       if len(producers) > 1 else "")
    _serve(load_engine, build_server, s)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text (wrapped in the consumer's chat template)."),
    producer: str = typer.Option("127.0.0.1:50051", help="HOST:PORT of the producer."),
    consumer: str = typer.Option("strong", "--consumer", "--pair", help="Consumer (pair) name; several, comma-"
                                 "separated (a,b), fan the prompt out: one base prefill, each its own answer."),
    method: str = typer.Option("", help="Transfer method (default: the producer's); a method with settings is "
                               "KIND:KEY=VALUE;KEY=VALUE (scd:block_tokens=0.35)."),
    param: list[str] = typer.Option([], help="Method setting KEY=VALUE (repeatable)."),
    max_new_tokens: int = typer.Option(64, min=1, max=2**32 - 1, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, callback=finite_in(0.0), help="0 is greedy."),
    top_p: float = typer.Option(1.0, callback=finite_in(0.0, 1.0), help="Nucleus mass, above 0 and at most 1."),
    stop: list[str] = typer.Option([], help="Stop string: the answer ends before it (repeat for several, up to 16)."),
    seed: Optional[int] = typer.Option(None, min=0, max=2**64 - 1, help="Sampling seed (default: a fresh one per "
                                       "request)."),
    native_prefix: bool = typer.Option(True, help="Consumer uses its own K/V for the template prefix."),
    timeout: float = typer.Option(120.0, callback=finite_in(0.001, 1e6), help="Deadline in seconds."),
    token: Optional[str] = typer.Option(None, envvar="SCD_TOKEN", callback=bearer_token,
                                        help="Bearer token (or env SCD_TOKEN)."),
    tls_ca: Optional[Path] = typer.Option(None, help="PEM CA to verify a TLS producer."),
) -> None:
    """Send a prompt to the producer and print the consumer's tokens as they stream (with several
    consumers, each one's answer once it is complete)."""
    import grpc

    from shared.config import check_grpc_target, consumer_list
    from tools import client

    try:
        check_grpc_target(producer, "127.0.0.1:50051")
    except ValueError as e:
        raise typer.BadParameter(f"--producer: {e}") from None
    if top_p == 0:  # the protocol's 0 means "unset" (1.0): the opposite of what a nucleus of 0 asks for
        raise typer.BadParameter("--top-p must be above 0 (at most 1); for greedy decoding leave --temperature at 0")
    try:
        names = consumer_list(consumer)  # the rule of HTTP's model
    except ValueError:
        raise typer.BadParameter(f"expected consumer names separated by commas, each once; got {consumer!r}") from None
    from shared.codecs import parse_variant, same_setting

    try:
        method, params = parse_variant(method)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    given: set[str] = set()
    for p in param:
        key, eq, value = p.partition("=")
        key = key.strip()
        if not (eq and key):
            raise typer.BadParameter(f"--param takes KEY=VALUE (block_tokens=0.35), got {p!r}")
        if key in given:
            raise typer.BadParameter(f"--param {key} is given twice; give each setting once")
        if not same_setting(params.get(key, value), value):
            raise typer.BadParameter(f"--param {p!r} contradicts --method {method}:{key}={params[key]}")
        given.add(key)
        params[key] = value

    ca = None
    if tls_ca is not None:
        from shared.errors import ConfigError
        from shared.rpc.security import read_ca

        try:
            ca = read_ca(str(tls_ca), "--tls-ca")
        except ConfigError as e:
            raise typer.BadParameter(str(e)) from None

    midline: set[str] = set()  # answers streamed onto the terminal's line: an error goes on the next one

    def one(name: str, stream_out: bool):
        req = client.request(prompt, name, method, max_new_tokens, temperature, top_p, tuple(stop), seed,
                             native_prefix, params)

        def show(ev) -> None:
            print(ev.text, end="", flush=True)
            if ev.text:
                midline.add(name)
        try:
            return client.generate(producer, req, timeout, on_event=show if stream_out else None, token=token,
                                   root_certificates=ca)
        except grpc.RpcError as e:
            return e

    if len(names) == 1:
        results = {names[0]: one(names[0], True)}
    else:  # concurrently: the producer shares one prefill between them
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(names)) as pool:
            results = dict(zip(names, pool.map(lambda n: one(n, False), names)))
    failed = False
    for name, res in results.items():
        if len(names) > 1:
            typer.echo(f"--- {name}")
            if not isinstance(res, grpc.RpcError):
                print(res.text, end="")
        if isinstance(res, grpc.RpcError):
            typer.echo(f"{chr(10) if name in midline else ''}error: {client.explain(producer, res, ca)}", err=True)
            failed = True
            continue
        t = res.timings
        print()
        typer.echo(f"[{t.method}] TTFT {t.ttft_ms:.0f} ms | {t.wire_bytes:,} bytes on the wire | "
                   f"prefill {t.prefill_ms:.0f} ms, encode {t.encode_ms:.0f} ms, reconstruct {t.reconstruct_ms:.0f} "
                   f"ms | {t.completion_tokens} tokens at {t.decode_tokens_per_s:.1f} tok/s | finish "
                   f"{res.finish_reason}")
        if t.auto_reason:
            typer.echo(f"auto chose {t.auto_reason}")
    if failed:
        raise typer.Exit(1)


@app.command()
def demo(
    pair: str = typer.Option("strong", help="A registered pair."),
    methods: str = typer.Option("oracle,raw,scd", help="Comma-separated transfer methods."),
    max_new_tokens: int = typer.Option(24, min=1, help="Tokens of each method's answer."),
    data_file: Optional[Path] = typer.Option(None, "--data", help="Ask the first test prompt of this JSONL instead."),
) -> None:
    """Start a consumer and a producer on localhost, stream a real answer per method, shut down."""
    from tools import demo as d
    from tools.cli.common import check_data, entry, known_methods, name_list

    names = known_methods(name_list(methods))  # before two services start (the producer refused a bad one)
    check_data(data_file, "test", pair=pair)
    from tools.assets.registry import calibration_missing

    e = entry(pair)
    if why := calibration_missing(names, e.store_dir(), pair):  # it answered with the others, then stopped
        fail(f"{why} (oracle, raw and quant need none)")
    from tools.data.user import DataFileError

    try:
        d.run(e, names, max_new_tokens, data_file=data_file)
    except DataFileError as e:  # a prompt of the test split that cannot be asked (the file's line said)
        fail(str(e))
    except d.Refused as e:
        fail(f"the services refused the request of method {e}", 1)
    except (RuntimeError, TimeoutError) as e:  # a service that did not start (its own error is printed above)
        fail(str(e), 1)
