"""Stopping a service: what SIGTERM's grace leaves running is answered, not cut off."""

from __future__ import annotations

import json

import grpc
import httpx2 as httpx
import pytest
from ops_common import PROMPT, TOKEN, gen, idle
from ops_support import wait_for


@pytest.mark.parametrize("stopping", ["producer", "consumer"])
def test_a_stopping_service_answers_the_requests_its_grace_did_not_finish(base, tok, monkeypatch, stopping):
    """SIGTERM gives requests in flight ``grace_s``; those still running then get UNAVAILABLE saying
    why (a 503, or a stream's final error event, or the gRPC status), not a connection cut mid-answer
    or uvicorn's plain-text 500. The consumer's decoding is held after its second token, so that no
    request can finish within the grace."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from ops_common import SEC, consumer

    from producer_service.engine import ProducerEngine
    from producer_service.settings import ProducerSettings
    from shared.generation import Generator
    from tools.inprocess import InProcessServices

    step, gate = Generator.step, threading.Event()

    def gated(self):
        out = step(self)
        if len(self.tokens) >= 2:
            gate.wait(30)
        return out

    def make_producer(addresses):
        s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, default_method="raw",
                                  consumers={n: {"address": a} for n, a in addresses.items()}, http={"port": 0},
                                  security=SEC)
        return ProducerEngine(s, base, tok)

    monkeypatch.setattr(Generator, "step", gated)
    why = "shutting down (its grace period is over); retry the request"
    body = {"model": "only", "prompt": PROMPT, "max_tokens": 3999, "method": "raw"}
    with InProcessServices([consumer("only", base, max_new_tokens=4000)], make_producer) as s, \
            ThreadPoolExecutor(2) as ex, httpx.Client(timeout=60, headers={"authorization": f"Bearer {TOKEN}"}) as c:
        try:
            url = f"http://127.0.0.1:{s.producer_server.http.port}/v1/completions"
            with c.stream("POST", url, json={**body, "stream": True}) as r:
                lines = r.iter_lines()
                assert r.status_code == 200 and next(lines).startswith("data: ")  # the stream has begun
                whole = ex.submit(c.post, url, json=body)  # these wait behind it
                grpc_call = ex.submit(gen, s, consumer="only", method="raw", max_new_tokens=3999, timeout=60)
                wait_for(lambda: s._servicer.metrics.value("inflight_requests") == 3, what="three requests in flight")
                server = s.producer_server if stopping == "producer" else s.consumer_servers["only"]
                s._run(server.stop(0.5))
                events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            assert "error" in events[-1] and why in events[-1]["error"]["message"], events[-1]
            assert events[-1]["error"]["code"] == "UNAVAILABLE"
            r2 = whole.result(30)
            assert r2.status_code == 503 and why in r2.json()["error"]["message"], r2.text[:300]
            with pytest.raises(grpc.RpcError) as ei:
                grpc_call.result(30)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and why in ei.value.details(), ei.value.details()
            if stopping == "consumer":
                assert "consumer 'only': the consumer is " + why in ei.value.details()
        finally:
            gate.set()
        wait_for(lambda: idle(s, "only"), what="the consumer to free every request")
