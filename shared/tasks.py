"""Tasks that a request starts end with it: ``finish`` cancels them and waits for them, on every exit
path, so nothing a task holds (decoded layers, a queue, a stream) outlives its request, and a task's
own failure after the request's is retrieved, not logged as unhandled at garbage collection."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from prometheus_client import Gauge

RECANCEL_S = 0.5
"""How long ``finish`` waits for a cancelled task before it cancels it again."""


def spawn(coro: Coroutine[Any, Any, Any], live: Gauge | None = None) -> asyncio.Task:
    """A task of a request, counted in ``live`` (the services' ``live_tasks`` gauge) until it ends:
    a count that does not come back to its idle value is a task that outlived its request."""
    task = asyncio.ensure_future(coro)
    if live is not None:
        live.inc()
        task.add_done_callback(lambda _: live.dec())
    return task


async def finish(*tasks: asyncio.Future | None) -> None:
    """Cancel ``tasks`` (None entries skipped) and wait until each has ended. Their results and
    exceptions are dropped: the caller has its own outcome. A task still running after ``RECANCEL_S``
    is cancelled again (a cancellation can be lost in a library's await). If the caller itself is
    cancelled while waiting, the tasks still end before the cancellation goes on."""
    live = [t for t in tasks if t is not None]
    cancelled = False
    while pending := [t for t in live if not t.done()]:
        for t in pending:
            t.cancel()
        try:
            await asyncio.shield(asyncio.wait(pending, timeout=RECANCEL_S))
        except asyncio.CancelledError:
            cancelled = True  # our caller was cancelled: the tasks still end before it does
    for t in live:
        if not t.cancelled():
            with contextlib.suppress(BaseException):
                t.exception()  # retrieved: a fault after the request's own is not logged as unhandled
    if cancelled:
        raise asyncio.CancelledError
