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


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
