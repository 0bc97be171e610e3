"""``scd assets`` (the built-in models, data and pair registrations) and ``scd train-adapter``."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Optional

import typer

from tools.cli.app import app
from tools.cli.common import Verbose, fail, output_dir, output_file, setup_logging


@app.command()
def assets(
    force_data: bool = typer.Option(False, help="Rebuild the evaluation data even if present."),
    store: Optional[Path] = typer.Option(None, help="A shared artifact store (a mounted volume) to publish the "
                                                  "built-in pairs' committed artifacts into; files that differ are "
                                                  "replaced."),
    pair: Optional[list[str]] = typer.Option(
        None, "--pair", help="Only these built-in pairs' consumers (repeat, or comma-separate; default: all four). "
                             "A node that serves one consumer needs the producer model and that one (~0.5 GB each)."),
    verbose: Verbose = False,
) -> None:
    """Prepare every built-in asset (idempotent): the producer model, the consumers, the data splits,
    and the registration of the built-in pairs (strong, mild, code, verse)."""
    setup_logging(verbose)
    from tqdm import tqdm

    from shared.errors import SCDError
    from tools import data
    from tools.assets import registry
    from tools.assets.models import PAIRS, build_consumer, consumer_dir, convert_producer, load_tokenizer, producer_dir

    pairs = _chosen(pair, PAIRS)
    steps = [("producer model", convert_producer)] + [
        (f"consumer {p}", lambda p=p: build_consumer(p)) for p in pairs
    ]
    steps.append(("data splits", lambda: data.is_ready() and not force_data or data.build(load_tokenizer())))
    kept: list[str] = []  # a pair of the user's under a built-in name: left as it is, said at the end

    def register(p: str) -> None:
        try:
            registry.add(p, producer_dir(), consumer_dir(p), builtin=True, replace=True)
        except registry.UsersPair as e:
            kept.append(str(e))

    steps += [(f"register {p}", lambda p=p: register(p)) for p in pairs]
    from shared.paths import scd_home

    try:
        with _exclusive(scd_home() / "assets.lock"), tqdm(steps, desc="assets", unit="step") as bar:
            for name, fn in bar:
                bar.set_postfix_str(name)
                fn()
    except SCDError as e:
        fail(str(e))
    except OSError as e:  # a home that cannot be written: a read-only mount, a file in its place, a full disk
        fail(f"cannot prepare the assets under {scd_home()}: {e.strerror or e} ({e.filename or scd_home()}); set "
             "SCD_HOME to a writable folder with a few GB free")

    if kept:
        fail("the assets are prepared, but " + "; ".join(kept))
    if store is not None:
        from tools.assets.shared_store import publish

        try:
            written, current = publish(store)
        except OSError as e:
            fail(f"cannot publish the artifact store into {store}: {e}")
        typer.echo(f"artifact store {store}: {written} files written, {current} already current")
    typer.echo(f"assets ready under {scd_home()}; pairs registered in {registry.registry_path()}")


def _chosen(given: list[str] | None, builtin: tuple[str, ...]) -> tuple[str, ...]:
    """The built-in pairs ``--pair`` names (all when none), in their usual order; an unknown name is
    a usage error that lists the built-in ones (a pair of your own is added with ``scd pair add``)."""
    if not given:
        return builtin
    names = {n.strip() for g in given for n in g.split(",") if n.strip()}
    unknown = sorted(names - set(builtin))
    if unknown or not names:
        raise typer.BadParameter(f"{', '.join(map(repr, unknown)) or 'no pair'}: `scd assets` prepares the built-in "
                                 f"pairs {', '.join(builtin)}; a pair of your own is added with `scd pair add`",
                                 param_hint="--pair")
    return tuple(p for p in builtin if p in names)


@contextlib.contextmanager
def _exclusive(path: Path):
    """One ``scd assets`` at a time per SCD_HOME: two pods' init containers on one shared volume
    would otherwise convert into the same temporary folders. The second waits, then finds every
    step done (each is idempotent)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            typer.echo(f"waiting for another `scd assets` on {path.parent} to finish", err=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@app.command("train-adapter")
def train_adapter(
    pair: str = typer.Option(..., help="strong | mild | code | verse"),
    out: Optional[Path] = typer.Option(None, callback=output_dir,
                                       help="Output folder (default: artifacts/adapters/PAIR)."),
) -> None:
    """Train a built-in consumer's LoRA adapter from the producer (reproduces the committed adapters)."""
    setup_logging(True)
    from tools.assets.train import RECIPES, train

    if pair not in RECIPES:
        raise typer.BadParameter(f"expected one of {sorted(RECIPES)}, got {pair!r}")
    typer.echo(str(train(pair, out)))


@app.command("heldout")
def heldout(
    out: Path = typer.Option(..., "--out", callback=output_file, help="The JSONL file to write."),
    pair: str = typer.Option(..., help="A registered pair: its tokenizer sizes the passages."),
    tokens: str = typer.Option("1000", help="Passage lengths in tokens, comma-separated (from 2000 on, each "
                               "passage is a haystack with one planted sentence that the question asks for)."),
    kinds: str = typer.Option(",".join(("news", "docstrings", "licenses", "french")),
                              help="Kinds of text, comma-separated: news, docstrings, licenses, french, spanish, "
                                   "verse."),
    per_kind: int = typer.Option(10, min=1, help="Rows of each kind at each length."),
) -> None:
    """Write held-out text of several kinds that neither the built-in data nor calibration reads, as an
    operator's JSONL (score it whole: scd eval --data FILE --split all --rows-json ROWS)."""
    from shared.model.loading import load_tokenizer
    from tools.cli.common import entry
    from tools.data import heldout as ho

    try:
        lengths = tuple(int(x) for x in tokens.split(","))
    except ValueError:
        raise typer.BadParameter(f"--tokens takes whole numbers separated by commas (1000,3000), got "
                                 f"{tokens!r}") from None
    names = tuple(k.strip() for k in kinds.split(",") if k.strip())
    bad = [k for k in names if k not in ho.KINDS]
    if bad or not names:
        raise typer.BadParameter(f"--kinds {bad or kinds!r}: expected some of {', '.join(ho.KINDS)}")
    if any(n < 64 for n in lengths):
        raise typer.BadParameter("--tokens: passages of at least 64 tokens")
    tok = load_tokenizer(entry(pair).tokenizer)
    try:
        n = ho.write(out, tok, names, lengths, per_kind)
    except FileNotFoundError as e:
        fail(str(e))
    typer.echo(f"{out}: {n} rows ({', '.join(names)} at {', '.join(map(str, lengths))} tokens)")
