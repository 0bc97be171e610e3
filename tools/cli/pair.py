"""``scd pair``: register, list, show and remove producer/consumer pairs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from tools.cli.app import app
from tools.cli.common import check_store, fail, setup_logging

pair_app = typer.Typer(no_args_is_help=True, help="Register your own producer/consumer pairs (two folders, or a "
                                                  "folder and a LoRA adapter).")
app.add_typer(pair_app, name="pair")


@pair_app.command("add")
def add(
    name: str = typer.Argument(..., help="The pair's name (also the consumer's name when served)."),
    producer: Path = typer.Option(..., help="The base model's Hugging Face folder (safetensors)."),
    consumer: Optional[Path] = typer.Option(None, help="The fine-tuned model's folder."),
    consumer_adapter: Optional[Path] = typer.Option(None, help="Or: a LoRA adapter folder (peft) on the producer, "
                                                               "merged at load."),
    store: Optional[Path] = typer.Option(None, help="Artifact store for this pair (default: $SCD_HOME/store)."),
    replace: bool = typer.Option(False, "--replace", help="Overwrite a pair of the same name."),
) -> None:
    """Validate two folders (same architecture, same vocabulary, safetensors) and register the pair."""
    setup_logging(False)
    from shared.errors import SCDError
    from tools.assets import registry

    try:
        e = registry.add(name, producer, consumer, consumer_adapter, store, replace=replace)
    except (SCDError, OSError) as err:
        fail(str(err))
    typer.echo(f"registered pair {e.name!r}: {e.model_type}, {e.n_layers} layers, {e.n_kv_heads} KV heads x "
               f"{e.head_dim}; producer {e.producer_fingerprint}, consumer {e.consumer_fingerprint}; "
               f"store {e.store_dir()}")
    if e.producer_fingerprint == e.consumer_fingerprint:
        typer.echo("note: the consumer's weights are the producer's (same fingerprint): there is no drift to correct, "
                   "and raw transfer is already exact; give the fine-tuned model as --consumer if that was meant",
                   err=True)
    typer.echo(f"next: scd calibrate --pair {e.name} --data PROMPTS.jsonl")


@pair_app.command("list")
def list_(json_out: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """The registered pairs, one line each."""
    from shared.errors import SCDError
    from tools.assets import registry

    try:
        reg = registry.load()
    except SCDError as err:
        fail(str(err))
    if json_out:
        typer.echo(json.dumps({n: e.model_dump() for n, e in reg.pairs.items()}, indent=2))
        return
    if not reg.pairs:
        typer.echo(f"no pairs registered in {registry.registry_path()} (run `scd assets` or `scd pair add`)")
        return
    typer.echo(f"{'pair':<16}{'family':<9}{'layers':>7}{'kv':>4}  {'consumer':<10}stored")
    for n, e in sorted(reg.pairs.items()):
        have = ",".join(registry.stored(e)) or "-"
        typer.echo(f"{n:<16}{e.model_type:<9}{e.n_layers:>7}{e.n_kv_heads:>4}  "
                   f"{'adapter' if e.consumer_adapter else 'folder':<10}{have}")


@pair_app.command("show")
def show(name: str = typer.Argument(...),
         store: Optional[Path] = typer.Option(None, help="Look in this store.")) -> None:
    """A pair's architecture, dtype, fingerprints, folders, and which artifacts and profiles its store holds."""
    from shared.errors import SCDError
    from tools.assets import registry

    try:
        e = registry.get(name)
        have = registry.stored(e, check_store(Path(store) if store else e.store_dir()))
    except SCDError as err:
        fail(str(err))
    body = e.model_dump(exclude={"weights_stat"})
    body["stored"] = have
    for k, v in body.items():
        if k != "stored":
            typer.echo(f"{k:<22}{v}")
    typer.echo("stored" + ("" if have else f"                none in {store or e.store_dir()} (run `scd calibrate "
                                                f"--pair {name}`)"))
    for kind, info in have.items():
        state = ("UNREADABLE: not a JSON object (restore it or recalibrate)" if info.get("unreadable") else
                 "pinned to these weights" if info["pinned"] else "STALE: made for other weights")
        typer.echo(f"  {kind:<20}{state}  {info['path']}")


@pair_app.command("remove")
def remove(name: str = typer.Argument(...)) -> None:
    """Forget a pair (its folders and stored artifacts are left as they are)."""
    from shared.errors import SCDError
    from tools.assets import registry

    try:
        e = registry.remove(name)
    except SCDError as err:
        fail(str(err))
    typer.echo(f"removed pair {name!r} (its artifacts, if any, remain in {e.store_dir()})")
