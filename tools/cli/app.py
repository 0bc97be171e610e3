"""The ``scd`` Typer application; each command group lives in its own module of this package."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="SCD serve: semantic KV-cache transfer between a base model and its fine-tuned variants.")
