"""Prometheus metrics of one service, on its own registry (several servers in one process, as in the
tests, never collide). Names are ``scd_<service>_...``; see docs/operations.md for the list."""

from __future__ import annotations

import json
import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """``service`` is ``producer`` or ``consumer``; every metric exists on both (a few stay at zero
    on one side: the producer has no cache memory, the consumer encodes nothing)."""

    def __init__(self, service: str):
        self.service = service
        self.registry = r = CollectorRegistry(auto_describe=True)
        p = f"scd_{service}_"
        from shared.rpc.wire import PROTOCOL_VERSION
        from shared.version import VERSION

        Info(p + "build", "The release this service runs and its wire protocol version", registry=r).info(
            {"version": VERSION, "protocol": str(PROTOCOL_VERSION)})
        self.requests = Counter(p + "requests", "Requests by transfer method and outcome (ok or a gRPC code "
                                "name, lower case) and whether the consumer recomputed the prefill",
                                ["method", "outcome", "fallback"], registry=r)
        self.ttft = Histogram(p + "ttft_seconds", "Request received -> first token", ["method"], buckets=_SECONDS,
                              registry=r)
        self.wire_bytes = Counter(p + "wire_bytes", "Serialized KV frame bytes sent (producer) or received "
                                  "(consumer)", ["method"], registry=r)
        self.frames = Counter(p + "frames", "KV frames sent (producer) or received (consumer)", ["method"],
                              registry=r)
        self.encode = Histogram(p + "encode_seconds", "Producer encode time per request (all layers)", ["method"],
                                buckets=_SECONDS, registry=r)
        self.reconstruct = Histogram(p + "reconstruct_seconds", "Consumer reconstruct time per request (all "
                                     "layers)", ["method"], buckets=_SECONDS, registry=r)
        self.inflight = Gauge(p + "inflight_requests", "Requests being served now (admitted ones on the consumer)",
                              registry=r)
        self.queue = Gauge(p + "queue_length", "Requests waiting for admission", registry=r)
        self.cache_bytes = Gauge(p + "cache_bytes_held", "Bytes reserved for reconstructed caches of admitted "
                                 "requests (consumer)", registry=r)
        self.cache_budget = Gauge(p + "cache_budget_bytes", "Cache memory budget (consumer; 0 = unbounded)",
                                  registry=r)
        self.fallbacks = Counter(p + "fallback_recompute", "Requests the consumer prefilled itself because the "
                                 "stream did not match what it loaded", ["reason"], registry=r)
        self.auth_failures = Counter(p + "auth_failures", "Requests refused for a missing or wrong bearer token",
                                     ["transport"], registry=r)
        self.http_responses = Counter(p + "http_responses", "HTTP answers by path (a served one, else 'other') "
                                      "and status code, refusals before a request reaches the engine included "
                                      "(producer)", ["path", "status"], registry=r)

        self.prefill_cache_bytes = Gauge(p + "prefill_cache_bytes", "Memory held by the kept prefill states "
                                         "(producer; prefill_cache_entries, prefill_cache_bytes)", registry=r)
        self.prefills = Counter(p + "prefills", "Base-model prefills of requests: run for the request, or shared "
                                "(cached, or another request's prefill of the same prompt; producer)", ["source"],
                                registry=r)
        self.by_consumer = Counter(p + "consumer_requests", "Requests by consumer and transfer method (producer: "
                                   "where it sent them)", ["consumer", "method"], registry=r)
        self.consumer_bytes = Counter(p + "consumer_wire_bytes", "KV frame bytes by consumer (producer)",
                                      ["consumer"], registry=r)
        self.consumer_ttft = Histogram(p + "consumer_ttft_seconds", "Request received -> first token, by consumer "
                                       "(producer)", ["consumer"], buckets=_SECONDS, registry=r)
        self.consumer_up = Gauge(p + "consumer_up", "1 while the consumer answered the last health probe as serving, "
                                 "else 0 (producer; 0 until the first probe; none when health_probe_s is 0)",
                                 ["consumer"], registry=r)
        self.auto_choices = Counter(p + "auto_choices", "What requests for the auto method were served with, by "
                                    "consumer (producer; the method label, settings included)", ["consumer", "choice"],
                                    registry=r)
        self.auto_stale_points = Gauge(p + "auto_stale_points", "Points of a consumer's operating table that auto "
                                       "cannot serve as they were measured (the artifacts changed since; producer, "
                                       "from start-up: rerun scd calibrate --method auto)", ["consumer"], registry=r)
        self.resettled = Counter(p + "resettled_requests", "Requests whose method changed its settings after the "
                                 "prefill, by consumer and method (producer; scd: a prompt unlike the calibration "
                                 "text served the whole block by the token-sparse block's guard)",
                                 ["consumer", "method"], registry=r)

        self.live_tasks = Gauge(p + "live_tasks", "Tasks that requests started (read-ahead, drain, fan-out, "
                                "prefill) and that have not ended yet: 0 when idle; one that stays above 0 with no "
                                "request in flight is a leak", registry=r)
        # the process's own: scd_<service>_process_resident_memory_bytes, _open_fds, _cpu_seconds_total, ...
        ProcessCollector(namespace=f"scd_{service}", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels) -> float:
        """Current value of one sample (0.0 when it was never set), e.g. ``value("inflight_requests")``."""
        v = self.registry.get_sample_value(f"scd_{self.service}_{name}", labels)
        return 0.0 if v is None else v


ACCESS_LOG = "scd.access"
"""The logger of the request log: one INFO line per finished request (settings ``access_log``)."""


def log_request(request_id: str, **fields) -> None:
    """One line, ``request=ID key=value ...`` (logfmt): a value with a space or a quote is quoted."""
    log = logging.getLogger(ACCESS_LOG)
    if not log.isEnabledFor(logging.INFO):
        return

    def value(v) -> str:
        if isinstance(v, float):
            v = f"{v:.1f}"
        v = str(v)
        v = v if len(v) <= 128 else v[:128] + "..."  # a request's own text, bounded
        return json.dumps(v) if not v or any(c in v for c in ' "=') or not v.isprintable() else v

    log.info("request=%s %s", value(request_id), " ".join(f"{k}={value(v)}" for k, v in fields.items()))
