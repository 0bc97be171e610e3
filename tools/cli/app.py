"""The ``scd`` Typer application; each command group lives in its own module of this package."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="SCD serve: semantic KV-cache transfer between a base model and its fine-tuned variants.")


def _version(value: bool) -> None:
    if value:
        from shared.rpc.wire import PROTOCOL_VERSION
        from shared.version import VERSION

        typer.echo(f"scd-serve {VERSION} (wire protocol {PROTOCOL_VERSION})")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the release and its wire protocol version, and exit.")) -> None:
    """SCD serve: semantic KV-cache transfer between a base model and its fine-tuned variants."""
