"""The installed package's version (``scd --version``, ``/health``, ``scd_<svc>_build_info``), so an
operator can tell which release each service of a fleet runs."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("scd-serve")
except PackageNotFoundError:  # run from a checkout that was never installed (pip install -e .)
    VERSION = "0+unknown"
