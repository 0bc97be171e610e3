"""One mapper from domain exceptions to gRPC status codes, for coroutine and async-generator
handlers. Unexpected exceptions become INTERNAL with a generic message (and a logged traceback)."""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from shared import errors as E

log = logging.getLogger(__name__)

CODES: list[tuple[type[Exception], grpc.StatusCode]] = [
    (E.InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (E.InvalidPayload, grpc.StatusCode.INVALID_ARGUMENT),
    (E.NotFound, grpc.StatusCode.NOT_FOUND),
    (E.PreconditionFailed, grpc.StatusCode.FAILED_PRECONDITION),
    (E.ConfigError, grpc.StatusCode.FAILED_PRECONDITION),  # settings that cannot serve this request
    (E.DataLoss, grpc.StatusCode.DATA_LOSS),
    (E.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (E.NotReady, grpc.StatusCode.UNAVAILABLE),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


MAX_MESSAGE_CHARS = 1024


def _bounded(msg: str) -> str:
    return msg if len(msg) <= MAX_MESSAGE_CHARS else msg[: MAX_MESSAGE_CHARS - 16] + "... (truncated)"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message for ``exc``; messages are bounded (a status must fit its trailer)."""
    if isinstance(exc, E.PeerError):
        return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.UNKNOWN), _bounded(str(exc))
    for cls, code in CODES:
        if isinstance(exc, cls):
            return code, _bounded(str(exc))
    return grpc.StatusCode.INTERNAL, "internal error; see the service log"


def grpc_errors(fn):
    """Decorator: map domain exceptions raised by a servicer method to ``context.abort``. The abort
    happens after the except block: raised inside it, gRPC's abort exception carried the request's
    exception as its context, whose traceback held every frame of the failed request (its decoded
    layers, its cache), and gRPC keeps the abort exception with the call's state for a while: a
    consumer's memory grew by about 1 MB with every stream that failed mid-layer (issue 58)."""

    def _status(exc) -> tuple[grpc.StatusCode, str]:
        code, msg = status_for(exc)
        if isinstance(exc, E.PeerError):  # the peer's own failure, logged (with its traceback) where it happened
            if code == grpc.StatusCode.INTERNAL:
                log.warning("%s: relayed the peer's %s: %s", fn.__name__, exc.code, msg)
        elif code == grpc.StatusCode.INTERNAL:
            log.exception("unhandled error in %s", fn.__name__, exc_info=exc)
        return code, msg

    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def gen_wrapper(self, request, context):
            failed = None
            try:
                async for item in fn(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status
                failed = _status(exc)
            if failed is not None:
                await context.abort(*failed)

        return gen_wrapper

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        failed = None
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            failed = _status(exc)
        await context.abort(*failed)

    return wrapper
