"""The ``scd`` command line: one module per command group (pairs, assets, serving, calibration,
evaluation, benchmarks), registered on one Typer app."""

from __future__ import annotations

from tools.cli import assets, bench, calibrate, evaluate, pair, serve  # noqa: F401  (registers the commands)
from tools.cli.app import app


def main() -> None:
    app()


__all__ = ["app", "main"]
