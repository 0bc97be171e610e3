"""The producer's readiness per consumer (gRPC health ``scd.v1.Producer/<name>``, its overall status,
HTTP /health): what it says before, while and after its consumers serve. Every wait is a bounded
poll; the first probe is held by the test, not raced."""

from __future__ import annotations

import asyncio
import threading

import grpc
import httpx2 as httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ops_common import SEC, consumer
from ops_support import wait_for

from producer_service.engine import ProducerEngine
from producer_service.servicer import NOT_PROBED, ProducerServicer
from producer_service.settings import ProducerSettings
from tools.inprocess import InProcessServices

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _producer(base, tok, probe_s: float):
    def make(addresses):
        s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, default_method="raw",
                                  consumers={n: {"address": a} for n, a in addresses.items()}, http={"port": 0},
                                  security=SEC, health_probe_s=probe_s)
        return ProducerEngine(s, base, tok)
    return make


def _status(s, service: str = "") -> int:
    with grpc.insecure_channel(s.producer_address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def _up(s, consumer: str = "only") -> float | None:
    """scd_producer_consumer_up for ``consumer`` as /metrics shows it (None: no sample)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{s.producer_server.http.port}/metrics", headers={"Authorization": f"Bearer "
                     f"{SEC['token']}"}, timeout=10).raise_for_status().text
    return next((x.value for f in text_string_to_metric_families(text) for x in f.samples
                 if x.name == "scd_producer_consumer_up" and x.labels == {"consumer": consumer}), None)


def test_the_producer_reports_readiness_per_consumer(base, tok):
    """By Check and by Watch (the stream gRPC's client-side health checking reads; it failed UNKNOWN
    with a TypeError on both services: the interceptor took every streaming answer for a generator)."""
    with InProcessServices([consumer("only", base)], _producer(base, tok, 0.2)) as s:
        url = f"http://127.0.0.1:{s.producer_server.http.port}/health"
        wait_for(lambda: _status(s, "scd.v1.Producer/only") == SERVING, what="the consumer to be reported serving")
        assert httpx.get(url).json()["consumers"] == {"only": "serving"}
        assert _up(s) == 1.0
        ch = grpc.insecure_channel(s.producer_address)
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="scd.v1.Producer/only"),
                                                     timeout=60)
        assert next(watch).status == SERVING
        with grpc.insecure_channel(s.consumer_addresses["only"]) as cch:
            assert next(health_pb2_grpc.HealthStub(cch).Watch(health_pb2.HealthCheckRequest(), timeout=10)).status \
                == SERVING
        s._run(s.consumer_servers["only"].stop(0))  # its only consumer goes down
        assert next(watch).status == NOT_SERVING  # the watcher is told
        watch.cancel()
        ch.close()
        wait_for(lambda: _status(s) == NOT_SERVING, what="the producer to say so")
        assert _up(s) == 0.0
        assert _status(s, "scd.v1.Producer/only") == NOT_SERVING
        assert _status(s, "liveness") == SERVING  # not ready, but alive
        r = httpx.get(url)
        assert r.status_code == 503 and r.json()["consumers"] == {"only": "unavailable"}


def test_before_the_first_probe_answers_a_consumer_is_not_serving_not_unknown(base, tok, monkeypatch):
    """Until the first probe answered, a configured consumer's health service was NOT_FOUND (what a
    gRPC health client reads as "no such service") and the producer said SERVING overall, /health 200,
    though nothing yet said any consumer was there. Seen in CI as a readiness test that asked too early."""
    release = threading.Event()
    real = ProducerServicer.consumer_status_now

    async def held(self, name, address):  # the first probe waits until the test has looked
        await asyncio.to_thread(release.wait, 30)
        return await real(self, name, address)

    monkeypatch.setattr(ProducerServicer, "consumer_status_now", held)
    with InProcessServices([consumer("only", base)], _producer(base, tok, 0.2)) as s:
        url = f"http://127.0.0.1:{s.producer_server.http.port}/health"
        try:
            assert _status(s, "scd.v1.Producer/only") == NOT_SERVING
            assert _status(s) == NOT_SERVING and _status(s, "scd.v1.Producer") == NOT_SERVING
            assert _status(s, "liveness") == SERVING
            r = httpx.get(url)
            assert r.status_code == 503 and r.json()["consumers"] == {"only": NOT_PROBED}, r.text
            assert _up(s) == 0.0  # a sample from the start (an alert on it needs one)
        finally:
            release.set()
        wait_for(lambda: _status(s) == SERVING, what="the first probe to find the consumer")
        assert _status(s, "scd.v1.Producer/only") == SERVING
        assert httpx.get(url).json()["consumers"] == {"only": "serving"} and _up(s) == 1.0


def test_without_probes_the_producer_serves_and_a_consumer_is_unknown(base, tok):
    """health_probe_s = 0: always SERVING (as documented); each consumer's status is UNKNOWN (was NOT_FOUND)."""
    with InProcessServices([consumer("only", base)], _producer(base, tok, 0)) as s:
        assert _status(s) == SERVING
        assert _status(s, "scd.v1.Producer/only") == health_pb2.HealthCheckResponse.UNKNOWN
        r = httpx.get(f"http://127.0.0.1:{s.producer_server.http.port}/health")
        assert r.status_code == 200 and r.json()["consumers"] == {}, r.text
        assert _up(s) is None  # no probes: nothing to say


def test_a_producer_with_no_consumers_is_not_ready(base, tok, caplog):
    """It said SERVING and /health 200 with `"consumers": {}` while refusing every request."""
    import logging

    with caplog.at_level(logging.WARNING):
        with InProcessServices([], _producer(base, tok, 0.2)) as s:
            assert _status(s) == NOT_SERVING and _status(s, "liveness") == SERVING
            r = httpx.get(f"http://127.0.0.1:{s.producer_server.http.port}/health")
            assert r.status_code == 503 and r.json()["consumers"] == {}, r.text
    assert "no consumers configured" in caplog.text and "--consumer NAME=HOST:PORT" in caplog.text


def test_a_consumers_artifacts_folder_that_does_not_exist_is_named(base, tok, tmp_path, caplog):
    """It started and advised setting consumers.a.artifacts, the very setting given. (A warning, not a
    refusal: tools give every pair's <store>/<pair>, which calibration may fill later.)"""
    import logging

    s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, default_method="raw",
                              methods=["oracle", "raw", "scd"],
                              consumers={"a": {"address": "127.0.0.1:1", "artifacts": str(tmp_path / "nope" / "a")}})
    with caplog.at_level(logging.WARNING):
        eng = ProducerEngine(s, base, tok)
    said = caplog.text
    assert f"consumers.a.artifacts: {tmp_path / 'nope' / 'a'} does not exist" in said, said
    assert f"it reads consumers.a.artifacts, {tmp_path / 'nope' / 'a'}" in said and "for another consumer" not in said
    eng.close()
