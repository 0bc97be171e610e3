"""Thin gRPC servicer: frames in, token events out. It turns the request's frames into typed stream
events (``wire.FrameDecoder``), hands them to the engine, turns the engine's token events into
messages, and counts frames and outcomes; errors map to status codes (``grpc_errors``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from consumer_service.engine import ConsumerEngine, TransferRecord
from shared.codecs import CODECS
from shared.config import BENCH_HOLD_METADATA
from shared.domain import HeaderReceived
from shared.errors import InvalidPayload, NotReady
from shared.memory import release_freed
from shared.metrics import log_request
from shared.rpc import convert
from shared.rpc import scd_pb2 as pb
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.errors import grpc_errors, status_for
from shared.rpc.server import GRACE_MARGIN_S
from shared.rpc.wire import PROTOCOL_VERSION, FrameDecoder, Limits

log = logging.getLogger(__name__)


SENDER_DONE_S = 1.0
"""After refusing a stream, how long the consumer reads on (and drops) what its sender still writes
before it ends the call: a gRPC client still writing when the call ended saw "INTERNAL: Internal
error from Core" instead of the status (grpc.aio, 45 of 200 streams refused at their header)."""


async def _sender_done(request_iterator) -> None:
    """Read and drop the rest of a refused stream until its sender stops (or ``SENDER_DONE_S``)."""
    with contextlib.suppress(Exception, asyncio.TimeoutError):
        async with asyncio.timeout(SENDER_DONE_S):
            async for _ in request_iterator:
                pass


class ConsumerServicer(pbg.ConsumerServicer):
    def __init__(self, engine: ConsumerEngine):
        self.engine = engine
        self.metrics, self.admission = engine.metrics, engine.admission
        self._active: set[asyncio.Task] = set()  # the tasks serving a Transfer
        self._shed: set[asyncio.Task] = set()  # ... that shed_inflight() ended

    async def shed_inflight(self) -> None:
        """End every request in flight with UNAVAILABLE ("shutting down; retry"), its memory and slot
        freed: called when a stopping server's grace is over (gRPC would cancel them without a word)."""
        for task in list(self._active):
            self._shed.add(task)
            task.cancel()

    async def _events(self, request_iterator, record: TransferRecord):
        """The request's frames as typed stream events; inner chunks of a layer yield nothing."""
        dec = FrameDecoder(Limits(max_stream_bytes=self.engine.settings.max_stream_bytes),
                           n_layers=self.engine.adapter.n_layers)
        m = self.metrics
        try:
            async for frame in request_iterator:
                ev = dec.feed(frame)
                if isinstance(ev, HeaderReceived):
                    record.method = ev.header.method if ev.header.method in CODECS else "unknown"
                    record.request_id = ev.header.request_id
                    record.prompt_tokens = len(ev.header.prompt_ids)
                size = frame.ByteSize()
                if record.data_from is None and not isinstance(ev, HeaderReceived) and frame.HasField("chunk"):
                    record.data_from = time.perf_counter()  # the stream's data begins (the producer has prefilled)
                record.bytes_in += size
                m.frames.labels(record.method).inc()
                m.wire_bytes.labels(record.method).inc(size)
                if ev is not None:
                    yield ev
                    if isinstance(ev, HeaderReceived):  # the engine has opened the request: what may follow
                        dec.plan(record.schema, discard=bool(record.fallback))
            if not dec.done:
                raise InvalidPayload("the stream ended before its trailer; frames were lost")
        finally:
            dec.close()

    @grpc_errors
    async def Transfer(self, request_iterator, context):
        s = self.engine.settings
        record = TransferRecord()
        md = dict(context.invocation_metadata() or ())
        hold = s.bench.hold_layers and md.get(BENCH_HOLD_METADATA) == "1"
        deadline = time.time() + (context.time_remaining() or s.max_queue_wait_s + s.frame_timeout_s * 4)
        outcome, t0, first, last, sent = "cancelled", time.perf_counter(), None, None, 0
        task = asyncio.current_task()
        if task is not None:
            self._active.add(task)
        try:
            events = self.engine.transfer(self._events(request_iterator, record), deadline, record, hold)
            async with contextlib.aclosing(events):
                async for ev in events:
                    first = first or time.perf_counter()
                    last = ev.timings or last
                    sent += 1
                    yield convert.event_to_pb(ev)
            outcome = "ok"
        except asyncio.CancelledError:
            if task is None or task not in self._shed:
                raise
            task.uncancel()
            outcome = "unavailable"
            message = "the consumer is shutting down (its grace period is over); retry the request"
            yield pb.TokenEvent(error=pb.ErrorStatus(code="UNAVAILABLE", message=message))
            # the sender ends its call on that event; ended here first, the stopping server would close the
            # connection at once, and a sender still writing frames may then see only "Stream removed
            # (sendmsg: Broken pipe)" (seen in CI). Its end (a cancel, raised here) is awaited, a moment at most
            await asyncio.sleep(GRACE_MARGIN_S / 2)
            raise NotReady(message) from None
        except Exception as e:
            code, message = status_for(e)
            outcome = code.name.lower()
            if code != grpc.StatusCode.INTERNAL:  # in band first: a sender still writing may see only a transport error
                yield pb.TokenEvent(error=pb.ErrorStatus(code=code.name, message=message,
                                                         param=getattr(e, "param", None) or ""))
                if code != grpc.StatusCode.DEADLINE_EXCEEDED:  # (a stalled sender would not stop)
                    await _sender_done(request_iterator)
            raise
        finally:
            self._active.discard(task)  # type: ignore[arg-type]
            self._shed.discard(task)  # type: ignore[arg-type]
            self.metrics.requests.labels(record.method, outcome, record.fallback or "none").inc()
            if s.access_log:
                log_request(record.request_id or "-", method=record.method, outcome=outcome,
                            fallback=record.fallback or "none",  # an aborted answer: what was known and sent
                            prompt_tokens=last.prompt_tokens if last else record.prompt_tokens or "-",
                            completion_tokens=last.completion_tokens if last else sent if first else "-",
                            ttft_ms=(first - t0) * 1e3 if first else "-", bytes_in=record.bytes_in,
                            reconstruct_ms=last.reconstruct_ms if last else "-",
                            total_ms=(time.perf_counter() - t0) * 1e3)
            release_freed()  # what the request held goes back to the system, not to the allocator's arenas

    async def Info(self, request, context):
        e = self.engine
        return pb.ConsumerInfo(name=e.settings.name, model_fingerprint=e.fingerprint, methods=list(e.settings.methods),
                               n_layers=e.adapter.n_layers, protocol_version=PROTOCOL_VERSION,
                               producer_fingerprint=(e.producer_fingerprint or "") if e.settings.fallback == "fail"
                               else "")  # fallback=recompute serves any producer's stream (with its own prefill)
