"""Thin gRPC servicer: a client's Generate becomes the engine's encoded layers framed onto a Transfer
stream to the consumer, whose token events are relayed back. Translation, relay and error mapping
only; the engine prepares, prefills and encodes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator

import grpc

from producer_service.engine import ProducerEngine, StreamStats
from shared.config import BENCH_HOLD_METADATA
from shared.domain import GenerateRequest, TokenEvent
from shared.errors import NotReady, PeerError
from shared.memory import release_freed
from shared.metrics import Metrics, log_request
from shared.rpc import convert
from shared.rpc import scd_pb2 as pb
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.diagnose import HTTP1, socket_problem
from shared.rpc.errors import grpc_errors, status_for
from shared.rpc.security import auth_metadata, read_ca
from shared.rpc.server import OPTIONS
from shared.rpc.wire import PROTOCOL_VERSION, StreamTotals, header_frame, layer_frames

log = logging.getLogger(__name__)

# A consumer that restarts is used again within a second or two of coming back: gRPC's default
# reconnect backoff grows to two minutes, during which every request would fail with UNAVAILABLE.
PEER_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                ("grpc.max_reconnect_backoff_ms", 2000)]


NOT_A_CONSUMER = "not an SCD consumer"
ANOTHER_CONSUMER = "another consumer:"
WRONG_TOKEN = "refuses the producer's token (give both services the same security.token)"
_SETTINGS_CODES = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED", "FAILED_PRECONDITION", "UNIMPLEMENTED",
                             "INTERNAL"})
"""The codes a consumer refuses a stream with when the producer's settings for it are wrong."""
NOT_PROBED = "not probed yet"
FRAMES_CALL_OFF_S = 5.0
"""How long a request's end waits for its stream's frames to stop (their prefill called off, if pending)."""


@dataclasses.dataclass
class _Seen:
    """What a request's log line reports also when it fails or is called off."""

    totals: StreamTotals = dataclasses.field(default_factory=StreamTotals)  # what went to the consumer
    prompt_tokens: int | None = None  # known once the request is prepared


class ProducerServicer(pbg.ProducerServicer):
    def __init__(self, engine: ProducerEngine, metrics: Metrics | None = None):
        self.engine = engine
        self.metrics = metrics or Metrics("producer")
        self.metrics.prefill_cache_bytes.set_function(lambda: engine.prefill_cache_nbytes)
        engine.live_tasks = self.metrics.live_tasks
        for consumer, stale in engine.stale.items():
            self.metrics.auto_stale_points.labels(consumer).set(len(stale))
        sec = engine.settings.security
        self._peer_creds = sec.peer_credentials()
        self._peer_md = auth_metadata(sec.bearer())  # the producer sends its own token to its consumers
        self._peer_ca = read_ca(sec.peer_ca, "security.peer_ca") if sec.peer_ca else None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._probe: asyncio.Task | None = None
        # the last probe's status of each consumer: "serving", "unavailable", NOT_A_CONSUMER,
        # ANOTHER_CONSUMER..., WRONG_TOKEN, ... (consumer_status_now); NOT_PROBED until the first probe
        # answers (not ready: nothing says the consumer is there); empty when probes are off
        probes = bool(engine.settings.health_probe_s)
        self.consumer_status: dict[str, str] = {n: NOT_PROBED for n in engine.settings.consumers} if probes else {}
        self._count_up()
        self._calls: set = set()  # consumer calls in flight
        self._shed: set = set()  # ... that shed_inflight() ended

    async def shed_inflight(self) -> None:
        """End every request in flight with UNAVAILABLE ("shutting down; retry"): called when a
        stopping server's grace is over, so that each client gets an answer it can act on rather
        than a connection cut mid-response."""
        for call in list(self._calls):
            self._shed.add(call)
            call.cancel()

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            opts = OPTIONS + PEER_OPTIONS
            if self._peer_creds is not None:
                self._channels[address] = grpc.aio.secure_channel(address, self._peer_creds, options=opts)
            else:
                self._channels[address] = grpc.aio.insecure_channel(address, options=opts)
        return self._channels[address]

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        for ch in self._channels.values():
            await ch.close()

    # ------------------------------------------------------------------ readiness per consumer
    async def consumer_status_now(self, name: str, address: str) -> str:
        """``name``'s status at ``address``: "serving", "unavailable", NOT_A_CONSUMER (a gRPC server that
        knows no scd.v1.Consumer, or has no health service: the address is wrong, and no retry will
        help), ANOTHER_CONSUMER and the name of the one that answers, WRONG_TOKEN, or a consumer that
        speaks another protocol version or runs a model of another depth."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            r = await health_pb2_grpc.HealthStub(self.channel(address)).Check(
                health_pb2.HealthCheckRequest(service="scd.v1.Consumer"), timeout=2.0)
            if r.status != health_pb2.HealthCheckResponse.SERVING:
                return "unavailable"
            info = await pbg.ConsumerStub(self.channel(address)).Info(pb.InfoRequest(), timeout=2.0,
                                                                       metadata=self._peer_md or None)
            if info.name != name:
                return f"{ANOTHER_CONSUMER} {info.name!r}"
            if info.protocol_version != PROTOCOL_VERSION:  # every request would be refused: say so before
                side = "consumer" if info.protocol_version < PROTOCOL_VERSION else "producer"
                return f"speaks protocol {info.protocol_version}, this producer {PROTOCOL_VERSION} (update the {side})"
            if info.producer_fingerprint and info.producer_fingerprint != self.engine.fingerprint:
                return (f"accepts streams of producer weights {info.producer_fingerprint!r} only, this producer's are "
                        f"{self.engine.fingerprint!r} (serve the pair's producer model, recalibrate the pair for this "
                        f"one, or fix consumers.{name}.address)")
            if info.n_layers != self.engine.adapter.n_layers:
                return (f"has {info.n_layers} layers, this producer's model {self.engine.adapter.n_layers}: another "
                        f"model family (fix consumers.{name}.address or the producer's model)")
            return "serving"
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:  # its health is open; its Info is not
                return WRONG_TOKEN
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
                return NOT_A_CONSUMER
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                # not down but misaddressed (its HTTP port) or TLS on one side only: say which
                problem = await asyncio.to_thread(socket_problem, address, self._peer_ca, "security.peer_ca",
                                                  "consumer")
                if problem is not None and problem.lasting:
                    return problem.said
            return "unavailable"

    async def _misconfigured(self, name: str, address: str, code: str) -> str | None:
        """Why a consumer's refusal (status ``code``) is the producer's settings' fault, or None: the
        consumer at the address refuses its token, is another consumer or no consumer, runs another
        model or protocol. Asked only of the codes such a refusal takes (a bad request stays the client's)."""
        if code not in _SETTINGS_CODES:
            return None
        status = await self.consumer_status_now(name, address)
        if status in ("serving", "unavailable"):
            return None
        if status == NOT_A_CONSUMER:
            return (f"the server at {address} is {NOT_A_CONSUMER} (it has no scd.v1.Consumer/Transfer); the producer's "
                    f"consumers.{name}.address is wrong")
        said = f"is {status}" if status.startswith(ANOTHER_CONSUMER) else status
        return f"the consumer at the producer's consumers.{name}.address ({address}) {said}"

    async def probe_once(self, health=None) -> dict[str, bool]:
        """Each consumer's gRPC health, now; published on ``health`` when given."""
        s = self.engine.settings
        names = list(s.consumers)
        statuses = dict(zip(names, await asyncio.gather(*(self.consumer_status_now(n, s.consumers[n].address)
                                                          for n in names))))
        for name, status in statuses.items():  # each change logged once, with where to look
            before = self.consumer_status.get(name)
            before = None if before == NOT_PROBED else before  # None: the first probe
            if status != (before or "serving"):
                # a misconfiguration, or a consumer that went down, is a warning; one not up yet at the
                # producer's start (the order two services start in) and one that comes back are not
                warn = status not in ("serving", "unavailable") or before == "serving"
                (log.warning if warn else log.info)(
                    "consumer %r at %s: %s%s", name, s.consumers[name].address, status,
                    f" (fix consumers.{name}.address)" if status == NOT_A_CONSUMER or
                    status.startswith((ANOTHER_CONSUMER, HTTP1)) else "")
        self.consumer_status = statuses
        self._count_up()
        if health is not None:
            for service, code in self.health_statuses().items():
                await health.set(service, code)
        return self.consumers_ready

    def _count_up(self) -> None:
        for name, ok in self.consumers_ready.items():
            self.metrics.consumer_up.labels(name).set(ok)

    def health_statuses(self) -> dict[str, int]:
        """The producer's gRPC health as the last probe left it: per consumer (``scd.v1.Producer/NAME``:
        NOT_SERVING before the first probe, UNKNOWN when probes are off) and overall (``""``,
        ``scd.v1.Producer``: SERVING while a consumer is, or when nothing is probed)."""
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse
        ready = self.consumers_ready
        out = {f"scd.v1.Producer/{name}": status.UNKNOWN if name not in ready else
               status.SERVING if ready[name] else status.NOT_SERVING for name in self.engine.settings.consumers}
        overall = status.SERVING if self.ready() else status.NOT_SERVING
        return {**out, "": overall, "scd.v1.Producer": overall}

    def start_probes(self, health) -> None:
        period = self.engine.settings.health_probe_s
        if not period:
            return

        async def loop():
            while True:
                try:
                    await self.probe_once(health)
                except Exception:  # noqa: BLE001 - a failed round leaves the last statuses; logged
                    log.exception("consumer health probe failed")
                await asyncio.sleep(period)

        self._probe = asyncio.create_task(loop())

    @property
    def consumers_ready(self) -> dict[str, bool]:
        """Whether each consumer served at the last probe (False before the first; empty: probes off)."""
        return {name: status == "serving" for name, status in self.consumer_status.items()}

    def ready(self) -> bool:
        """At least one consumer serves (any configured one when probes are off); none configured: not ready."""
        if not self.engine.settings.consumers:
            return False
        return not self.consumers_ready or any(self.consumers_ready.values())

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
        if not request.request_id:  # one id for the stream, the consumer's log and the request log
            request = dataclasses.replace(request, request_id=uuid.uuid4().hex)
        method, outcome, fallback = request.method or self.engine.settings.default_method, "cancelled", "none"
        method = method.partition(":")[0]  # the kind of a method with settings (scd:block_tokens=0.35)
        if method not in self.engine.settings.methods:  # a bounded set of metric labels
            method = "unknown"
        t0, first, last, sent = time.perf_counter(), None, None, 0
        seen = _Seen()
        try:
            async for ev in self._generate(request, time_remaining, hold, seen):
                first = first or time.perf_counter()
                sent += 1
                if ev.timings is not None:
                    last = ev.timings
                    fallback = "recompute" if last.fallback_recompute else fallback
                yield ev
            outcome = "ok"
        except Exception as e:
            outcome = status_for(e)[0].name.lower()
            raise
        finally:
            m.inflight.dec()
            m.requests.labels(method, outcome, fallback).inc()
            if self.engine.settings.access_log:
                log_request(request.request_id, consumer=request.consumer, method=last.method if last else method,
                            outcome=outcome, prompt_tokens=last.prompt_tokens if last else seen.prompt_tokens or "-",
                            completion_tokens=last.completion_tokens if last else sent if first else "-",
                            ttft_ms=(first - t0) * 1e3 if first else "-", wire_bytes=seen.totals.wire_bytes,
                            total_ms=(time.perf_counter() - t0) * 1e3)
            release_freed()  # the request's prefill state and frames go back to the system

    async def _generate(self, request: GenerateRequest, time_remaining: float | None, hold: bool,
                        seen: "_Seen"):
        eng, m, totals = self.engine, self.metrics, seen.totals
        t0, t0_unix = time.perf_counter(), time.time()
        p = eng.prepare(request)
        seen.prompt_tokens = len(p.prompt_ids)
        remaining = min(time_remaining or eng.settings.default_deadline_s, eng.settings.max_deadline_s)
        late = p.method.decides_after_prefill  # its settings for this prompt are known after the prefill only

        def header():  # built when sent: it carries the method's settings as settled by then
            return header_frame(eng.header(p, request.request_id, t0_unix + remaining))

        stats = StreamStats()
        sent = {"trailer": 0}
        failed: list[Exception] = []

        async def frames():
            try:
                if not late:  # before the prefill: the consumer admits meanwhile
                    yield totals.add(header())
                async for item in eng.layers(p, stats, hold):
                    if item is None:  # the prefill is done, the method settled
                        if late:
                            yield totals.add(header())
                            if stats.resettled:
                                m.resettled.labels(request.consumer, p.method.kind).inc()
                        continue
                    for f in layer_frames(item.layer, item.tensors, compression=eng.settings.compression):
                        yield totals.add(f)
                sent["trailer"] = 1
                yield totals.add(totals.trailer(stats.encode_ms, stats.prefill_ms))
            except Exception as e:  # noqa: BLE001 - our own prefill or encode failed: gRPC would only stop reading
                failed.append(e)  # this iterator and leave the call open until its deadline; end it, and fail
                call.cancel()  # the request with this error below

        # set while frames() is not running: not started, at a yield, or ended. A request ends only once it
        # is, its prefill called off, before the client hears of the end: gRPC's task that pulls the frames
        # is cancelled by call.cancel() only while the call is open, and a consumer that refused the
        # stream may have closed it already; that task then pulled the next frame, running the prefill of
        # a refused request (seen in CI as test_a_prefill_nobody_waits_for_any_more_is_called_off)
        idle, puller = asyncio.Event(), list[asyncio.Task]()  # puller: the task that pulls the frames
        idle.set()

        async def tracked():
            idle.clear()
            if (me := asyncio.current_task()) is not None:
                puller.append(me)
            try:
                async for f in frames():
                    idle.set()
                    yield f
                    idle.clear()
            finally:
                idle.set()

        md = self._peer_md + (((BENCH_HOLD_METADATA, "1"),) if hold else ())
        call = pbg.ConsumerStub(self.channel(p.address)).Transfer(tracked(), timeout=remaining, metadata=md or None)
        self._calls.add(call)
        kind = p.method.kind
        if p.auto is not None:
            m.auto_choices.labels(request.consumer, p.auto.label).inc()
        ttft = None
        try:
            async for pev in call:
                if pev.HasField("error"):  # the consumer failed the request: its status, whatever the transport says
                    wrong = await self._misconfigured(request.consumer, p.address, pev.error.code)
                    if wrong is not None:
                        raise PeerError("INTERNAL", f"consumer {request.consumer!r}: {wrong}")
                    raise PeerError(pev.error.code, f"consumer {request.consumer!r}: {pev.error.message}",
                                    param=pev.error.param or None)
                ev = convert.event_from_pb(pev)
                if ttft is None:
                    ttft = (time.perf_counter() - t0) * 1e3
                    m.ttft.labels(kind).observe(ttft / 1e3)
                    m.consumer_ttft.labels(request.consumer).observe(ttft / 1e3)
                if ev.timings is not None:
                    t = ev.timings
                    t.ttft_ms, t.prefill_ms, t.encode_ms = ttft, stats.prefill_ms, stats.encode_ms
                    t.wire_bytes, t.payload_bytes = totals.wire_bytes, totals.payload_bytes
                    t.auto_reason = p.auto.reason if p.auto else ""
                    t.method_identity = p.identity
                    if not t.fallback_recompute:
                        eng.links.observe(request.consumer, totals.wire_bytes, t.transfer_ms)
                yield ev
            if failed:  # the call ended quietly after we cancelled it
                raise failed[0]
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as e:
            if failed:
                raise failed[0] from None
            task = asyncio.current_task()
            if call in self._shed and not (task and task.cancelling()):
                raise NotReady("the producer is shutting down (its grace period is over); retry the request") from None
            if isinstance(e, asyncio.CancelledError):
                raise
            code = e.code()
            msg = e.details() or code.name
            if code == grpc.StatusCode.UNAVAILABLE:
                status = await self.consumer_status_now(request.consumer, p.address)
                if status in ("serving", "unavailable"):
                    msg = f"unreachable or gone mid-stream ({msg}); retry, or check the consumer's health"
                else:  # the address or the TLS settings are wrong: the producer's fault, and no retry helps
                    code, msg = grpc.StatusCode.INTERNAL, (f"the producer's consumers.{request.consumer}.address "
                                                           f"({p.address}) {status}")
            elif (wrong := await self._misconfigured(request.consumer, p.address, code.name)) is not None:
                # another gRPC service at the address (it answers UNIMPLEMENTED, or gRPC's core INTERNAL when the
                # refusal crosses the frames being sent), a consumer that refuses the producer's token, another
                # consumer, another model: the producer's fault, not the client's (who could not fix it)
                code, msg = grpc.StatusCode.INTERNAL, wrong
            raise PeerError(code.name, f"consumer {request.consumer!r}: {msg}") from None
        finally:
            call.cancel()
            if puller and not puller[0].done():  # it feeds this call only: cancelled, it calls off the prefill
                puller[0].cancel()  # it waits for, or never pulls the next frame (which would start one)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(idle.wait(), FRAMES_CALL_OFF_S)
            self._calls.discard(call)
            self._shed.discard(call)
            m.frames.labels(kind).inc(1 + totals.n_chunks + sent["trailer"])  # header, chunks, trailer
            m.wire_bytes.labels(kind).inc(totals.wire_bytes)
            m.consumer_bytes.labels(request.consumer).inc(totals.wire_bytes)
            m.by_consumer.labels(request.consumer, kind).inc()
            if p.method.transfers_layers and stats.prefill_ms:
                m.prefills.labels("shared" if stats.prefill_shared else "run").inc()
            m.encode.labels(kind).observe(stats.encode_ms / 1e3)
