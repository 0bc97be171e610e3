"""A servicer's exception becomes the status a client reads; only the service's own unhandled error is
logged with its traceback (a peer's error relayed was logged where it happened)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from shared.errors import InvalidRequest, PeerError
from shared.rpc.errors import grpc_errors


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, message):
        self.code, self.message = code, message
        raise Aborted


class Servicer:
    def __init__(self, exc):
        self.exc = exc

    @grpc_errors
    async def Generate(self, request, context):
        yield 1
        raise self.exc


def run(exc) -> Context:
    async def main():
        ctx = Context()
        with pytest.raises(Aborted):
            async for _ in Servicer(exc).Generate(None, ctx):
                pass
        return ctx

    return asyncio.run(main())


@pytest.mark.parametrize("exc,code,traceback", [
    (RuntimeError("boom"), grpc.StatusCode.INTERNAL, True),
    (PeerError("INTERNAL", "consumer 'a': internal error; see the service log"), grpc.StatusCode.INTERNAL, False),
    (PeerError("NOT_FOUND", "no such model"), grpc.StatusCode.NOT_FOUND, False),
    (InvalidRequest("bad"), grpc.StatusCode.INVALID_ARGUMENT, False),
])
def test_the_status_and_what_is_logged(caplog, exc, code, traceback):
    with caplog.at_level(logging.INFO):
        ctx = run(exc)
    assert ctx.code == code
    assert any(r.exc_info for r in caplog.records) == traceback
    if isinstance(exc, PeerError) and code == grpc.StatusCode.INTERNAL:
        assert "relayed the peer's INTERNAL" in caplog.text
