"""Which release a service runs: `scd --version`, `/health` and `scd_<svc>_build_info` (an operator
with services of two image versions in one fleet had no way to tell them apart)."""

from __future__ import annotations

import asyncio
from importlib.metadata import version

import httpx2 as httpx
from fastapi import FastAPI
from typer.testing import CliRunner

from shared.metrics import Metrics
from shared.rpc.http import add_metrics_routes
from shared.rpc.wire import PROTOCOL_VERSION
from tools.cli import app

INSTALLED = version("scd-serve")


def test_scd_version_prints_the_installed_release_and_protocol():
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"scd-serve {INSTALLED} (wire protocol {PROTOCOL_VERSION})"


def test_health_and_metrics_say_the_release():
    metrics = Metrics("consumer")
    web = FastAPI()
    add_metrics_routes(web, metrics)

    async def get(path: str):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=web), base_url="http://t") as c:
            return await c.get(path)

    health = asyncio.run(get("/health"))
    assert health.status_code == 200 and health.json()["version"] == INSTALLED
    text = asyncio.run(get("/metrics")).text
    assert f'scd_consumer_build_info{{protocol="{PROTOCOL_VERSION}",version="{INSTALLED}"}} 1.0' in text, text[:400]
