"""Thin gRPC servicer: a client's Generate becomes the engine's encoded layers framed onto a Transfer
stream to the consumer, whose token events are relayed back. Translation, relay and error mapping
only; the engine prepares, prefills and encodes."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator

import grpc

from producer_service.engine import ProducerEngine, StreamStats
from shared.config import BENCH_HOLD_METADATA
from shared.domain import GenerateRequest, TokenEvent
from shared.errors import PeerError
from shared.metrics import Metrics
from shared.rpc import convert
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.errors import grpc_errors, status_for
from shared.rpc.security import auth_metadata
from shared.rpc.server import OPTIONS
from shared.rpc.wire import StreamTotals, header_frame, layer_frames

log = logging.getLogger(__name__)


class ProducerServicer(pbg.ProducerServicer):
    def __init__(self, engine: ProducerEngine, metrics: Metrics | None = None):
        self.engine = engine
        self.metrics = metrics or Metrics("producer")
        sec = engine.settings.security
        self._peer_creds = sec.peer_credentials()
        self._peer_md = auth_metadata(sec.bearer())  # the producer sends its own token to its consumers
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            if self._peer_creds is not None:
                self._channels[address] = grpc.aio.secure_channel(address, self._peer_creds, options=OPTIONS)
            else:
                self._channels[address] = grpc.aio.insecure_channel(address, options=OPTIONS)
        return self._channels[address]

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()

    @grpc_errors
    async def Generate(self, request, context):
        md = dict(context.invocation_metadata() or ())
        hold = self.engine.settings.bench.hold_layers and md.get(BENCH_HOLD_METADATA) == "1"
        events = self.generate(convert.request_from_pb(request), context.time_remaining(), hold)
        async with contextlib.aclosing(events):
            async for ev in events:
                yield convert.event_to_pb(ev)

    async def generate(self, request: GenerateRequest, time_remaining: float | None = None,
                       hold: bool = False) -> AsyncGenerator[TokenEvent, None]:
        """Token events of one request; raises domain errors (PeerError for the consumer's). Shared by
        the gRPC Generate and the HTTP front. Closing the generator (a client that went away)
        cancels the consumer's call, which frees the request there."""
        m = self.metrics
        m.inflight.inc()
        method, outcome, fallback = request.method or self.engine.settings.default_method, "cancelled", "none"
        if method not in self.engine.settings.methods:
            method = "unknown"
        try:
            async for ev in self._generate(request, time_remaining, hold):
                if ev.timings is not None and ev.timings.fallback_recompute:
                    fallback = "recompute"
                yield ev
            outcome = "ok"
        except Exception as e:
            outcome = status_for(e)[0].name.lower()
            raise
        finally:
            m.inflight.dec()
            m.requests.labels(method, outcome, fallback).inc()

    async def _generate(self, request: GenerateRequest, time_remaining: float | None, hold: bool):
        eng, m = self.engine, self.metrics
        t0, t0_unix = time.perf_counter(), time.time()
        p = eng.prepare(request)
        remaining = min(time_remaining or eng.settings.default_deadline_s, eng.settings.max_deadline_s)
        header = eng.header(p, request.request_id or uuid.uuid4().hex, t0_unix + remaining)
        totals, stats = StreamTotals(), StreamStats()
        sent = {"trailer": 0}

        async def frames():
            yield totals.add(header_frame(header))  # before the prefill: the consumer admits meanwhile
            async for item in eng.layers(p, stats, hold):
                for f in layer_frames(item.layer, item.tensors):
                    yield totals.add(f)
            sent["trailer"] = 1
            yield totals.add(totals.trailer(stats.encode_ms, stats.prefill_ms))

        md = self._peer_md + (((BENCH_HOLD_METADATA, "1"),) if hold else ())
        call = pbg.ConsumerStub(self.channel(p.address)).Transfer(frames(), timeout=remaining, metadata=md or None)
        kind = p.method.kind
        ttft = None
        try:
            async for pev in call:
                ev = convert.event_from_pb(pev)
                if ttft is None:
                    ttft = (time.perf_counter() - t0) * 1e3
                    m.ttft.labels(kind).observe(ttft / 1e3)
                if ev.timings is not None:
                    t = ev.timings
                    t.ttft_ms, t.prefill_ms, t.encode_ms = ttft, stats.prefill_ms, stats.encode_ms
                    t.wire_bytes, t.payload_bytes = totals.wire_bytes, totals.payload_bytes
                yield ev
        except grpc.aio.AioRpcError as e:
            code = e.code()
            msg = e.details() or code.name
            if code == grpc.StatusCode.UNAVAILABLE:
                msg = f"unreachable or gone mid-stream ({msg}); retry, or check the consumer's health"
            raise PeerError(code.name, f"consumer {request.consumer!r}: {msg}") from None
        finally:
            call.cancel()
            m.frames.labels(kind).inc(1 + totals.n_chunks + sent["trailer"])  # header, chunks, trailer
            m.wire_bytes.labels(kind).inc(totals.wire_bytes)
            m.encode.labels(kind).observe(stats.encode_ms / 1e3)
