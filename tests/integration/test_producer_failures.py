"""The producer's own failures end the request at once with a status, on both services: an encode
that raises must not leave the consumer's call open until the deadline."""

from __future__ import annotations

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
