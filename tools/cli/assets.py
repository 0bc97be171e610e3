"""``scd assets`` (the built-in models, data and pair registrations) and ``scd train-adapter``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tools.cli.app import app
from tools.cli.common import fail, setup_logging


@app.command()
def assets(
    force_data: bool = typer.Option(False, help="Rebuild the evaluation data even if present."),
    verbose: bool = typer.Option(False, "-v", "--verbose"),
) -> None:
    """Prepare every built-in asset (idempotent): the producer model, the consumers, the data splits,
    and the registration of the built-in pairs (strong, mild, code, verse)."""
    setup_logging(verbose)
    from tqdm import tqdm

    from shared.errors import SCDError
    from tools import data
    from tools.assets import registry
    from tools.assets.models import PAIRS, build_consumer, consumer_dir, convert_producer, load_tokenizer, producer_dir

    steps = [("producer model", convert_producer)] + [
        (f"consumer {p}", lambda p=p: build_consumer(p)) for p in PAIRS
    ]
    steps.append(("data splits", lambda: data.is_ready() and not force_data or data.build(load_tokenizer())))
    steps += [(f"register {p}", lambda p=p: registry.add(p, producer_dir(), consumer_dir(p), builtin=True,
                                                          replace=True)) for p in PAIRS]
    try:
        with tqdm(steps, desc="assets", unit="step") as bar:
            for name, fn in bar:
                bar.set_postfix_str(name)
                fn()
    except SCDError as e:
        fail(str(e))
    from shared.paths import scd_home

    typer.echo(f"assets ready under {scd_home()}; pairs registered in {registry.registry_path()}")


@app.command("train-adapter")
def train_adapter(
    pair: str = typer.Option(..., help="strong | mild | code | verse"),
    out: Optional[Path] = typer.Option(None, help="Output folder (default: artifacts/adapters/PAIR)."),
) -> None:
    """Train a built-in consumer's LoRA adapter from the producer (reproduces the committed adapters)."""
    setup_logging(True)
    from tools.assets.train import RECIPES, train

    if pair not in RECIPES:
        raise typer.BadParameter(f"expected one of {sorted(RECIPES)}, got {pair!r}")
    typer.echo(str(train(pair, out)))
