"""The producer's own failures end the request at once with a status, on both services: an encode
that raises must not leave the consumer's call open until the deadline."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import grpc
import httpx2 as httpx
import pytest
from ops_common import PROMPT, TOKEN, gen, http, idle
from ops_support import wait_for

H = {"Authorization": f"Bearer {TOKEN}"}


def test_an_encode_that_raises_fails_the_request_at_once(svc, monkeypatch):
    eng = svc.producer_engine
    real = eng.encode_layer

    def broken(p, state, layer):
        if layer == 1:
            raise RuntimeError("simulated encode failure")
        return real(p, state, layer)

    monkeypatch.setattr(eng, "encode_layer", broken)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as ei:
        gen(svc, timeout=60, consumer="chat", method="raw", max_new_tokens=4)
    assert ei.value.code() == grpc.StatusCode.INTERNAL, ei.value
    assert time.monotonic() - t0 < 30, "the request waited for its deadline"  # a hang, not a timing
    wait_for(lambda: idle(svc, "chat"), timeout=30, what="the consumer to free the request")
    r = httpx.post(http(svc) + "/v1/completions", headers=H, timeout=60,
                   json={"model": "chat", "prompt": PROMPT, "max_tokens": 4, "method": "raw"})
    assert r.status_code == 500 and r.json()["error"]["message"], r.text[:300]
    monkeypatch.setattr(eng, "encode_layer", real)
    assert gen(svc, consumer="chat", method="raw", max_new_tokens=2)  # the service keeps serving


@pytest.mark.parametrize("method,params", [("quant", {"group_size": "7"}), ("quant", {"group_size": "100000"})])
def test_a_group_size_the_model_cannot_take_is_invalid_argument(svc, method, params):
    with pytest.raises(grpc.RpcError) as ei:
        gen(svc, consumer="chat", method=method, method_params=params, max_new_tokens=2)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
    assert "must be a multiple of it" in ei.value.details()


@pytest.mark.parametrize("call_closed_first", [False, True])
def test_a_prefill_nobody_waits_for_any_more_is_called_off(svc, monkeypatch, call_closed_first):
    """Requests the consumer refuses at once (here: prompts over its 8-token limit) must not each
    cost a base prefill afterwards: while the worker is busy, eight of them are refused, and then
    at most the prefill already running completes. ``call_closed_first``: the consumer's call has
    ended (its status arrived) before the producer ends the request; gRPC's call.cancel() then no
    longer stopped the task pulling the frames, whose prefill ran (seen in CI under load)."""
    eng = svc.producer_engine
    real, go, calls = eng.adapter.prefill, threading.Event(), []
    if call_closed_first:
        import asyncio

        said = svc._servicer._misconfigured

        async def slow(*a):  # asked on the in-band refusal, before the request ends
            await asyncio.sleep(0.3)
            return await said(*a)

        monkeypatch.setattr(svc._servicer, "_misconfigured", slow)

    def held(*a, **k):
        calls.append(1)
        go.wait(30)  # the worker is busy until every request has been refused
        return real(*a, **k)

    monkeypatch.setattr(eng.adapter, "prefill", held)
    prompts = [[7 + i] + PROMPT[1:] for i in range(8)]  # distinct prompts: no prefill is shared
    try:
        with cf.ThreadPoolExecutor(8) as ex:
            futs = [ex.submit(gen, svc, consumer="short", method="raw", prompt=p, max_new_tokens=2) for p in prompts]
            errors = [f.exception(timeout=60) for f in futs]
    finally:
        go.set()
    assert all(isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.INVALID_ARGUMENT for e in errors), errors
    wait_for(lambda: not eng._inflight, timeout=30, what="the called-off prefills to be dropped")
    eng._pool.submit(lambda: None).result(timeout=60)  # one worker, first in first out: what was queued has run
    assert len(calls) <= 1, f"{len(calls)} prefills ran for 8 refused requests"
    monkeypatch.setattr(eng.adapter, "prefill", real)
    assert gen(svc, consumer="chat", method="raw", max_new_tokens=2)  # the worker serves the next request
