"""The consumer's admission controller: concurrency and memory bounds, a bounded FIFO queue,
RESOURCE_EXHAUSTED past it, and every grant released on every exit path (done, error, cancel)."""

import asyncio

import pytest

from consumer_service.admission import AdmissionController
from shared.errors import InvalidRequest, ResourceExhausted
from shared.metrics import Metrics


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_over_budget_request_is_refused_before_anything_is_held():
    a = AdmissionController(4, 4, budget=100)
    with pytest.raises(InvalidRequest, match="budget"):  # it would never fit: not "retry later"
        run(a.acquire(101, 1))
    assert a.held == 0 and a.active == 0


def test_queue_then_reject_then_fifo_wakeup():
    async def go():
        m = Metrics("consumer")
        a = AdmissionController(max_concurrent=1, max_queue=1, budget=0, metrics=m)
        order = []
        first = a.slot(10, 5)
        await first.__aenter__()
        assert m.value("inflight_requests") == 1 and m.value("cache_bytes_held") == 10

        async def second():
            async with a.slot(20, 5):
                order.append("second")

        t = asyncio.create_task(second())
        while a.queued == 0:
            await asyncio.sleep(0)
        assert m.value("queue_length") == 1
        with pytest.raises(ResourceExhausted, match="capacity"):
            await a.acquire(5, 5)  # queue full
        order.append("first done")
        await first.__aexit__(None, None, None)
        await t
        assert order == ["first done", "second"]
        assert a.active == 0 and a.held == 0 and a.queued == 0 and m.value("cache_bytes_held") == 0
        assert a.peak_active == 1 and a.peak_held == 20

    run(go())


def test_budget_is_binding_and_released_on_error_and_cancellation():
    async def go():
        a = AdmissionController(max_concurrent=10, max_queue=10, budget=100)
        with pytest.raises(RuntimeError):
            async with a.slot(60, 1):
                raise RuntimeError("boom")
        assert a.held == 0 and a.active == 0

        hold = a.slot(60, 1)
        await hold.__aenter__()
        waiter = asyncio.create_task(a.acquire(60, 5))  # 60 + 60 > 100: waits
        while a.queued == 0:
            await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert a.queued == 0 and a.held == 60
        with pytest.raises(ResourceExhausted, match="waited"):
            await a.acquire(60, 0.05)  # times out in the queue
        assert a.queued == 0 and a.held == 60
        await hold.__aexit__(None, None, None)
        assert a.held == 0 and a.active == 0 and a.peak_held <= 100

    run(go())


@pytest.mark.parametrize("code,status,retry", [("RESOURCE_EXHAUSTED", 429, "1"), ("UNAVAILABLE", 503, "1"),
                                               ("INVALID_ARGUMENT", 400, None), ("INTERNAL", 500, None),
                                               ("FAILED_PRECONDITION", 400, None)])
def test_http_errors_worth_retrying_say_when(code, status, retry):
    """A 429 (at capacity) or 503 carries Retry-After, which OpenAI's clients honour; errors that
    a retry cannot fix do not. FAILED_PRECONDITION is a 400, as Google's mapping of gRPC codes has it
    (412 is HTTP's answer to a conditional header, which no route takes; OpenAI's clients raise
    their BadRequestError for a 400)."""
    import grpc

    from shared.rpc.http import error_response

    r = error_response(getattr(grpc.StatusCode, code), "x")
    assert r.status_code == status and r.headers.get("retry-after") == retry
