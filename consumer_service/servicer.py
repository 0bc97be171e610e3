"""Thin gRPC servicer: frames in, token events out; the engine does the work."""

from __future__ import annotations

import asyncio
import logging
import time

from consumer_service.admission import AdmissionController
from consumer_service.engine import ConsumerEngine
from shared.codecs import CODECS
from shared.errors import InvalidPayload
from shared.metrics import Metrics
from shared.rpc import scd_pb2 as pb
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.errors import grpc_errors, status_for
from shared.rpc.wire import PROTOCOL_VERSION, FrameDecoder

log = logging.getLogger(__name__)


class ConsumerServicer(pbg.ConsumerServicer):
    def __init__(self, engine: ConsumerEngine, metrics: Metrics | None = None,
                 admission: AdmissionController | None = None):
        s = engine.settings
        self.engine = engine
        self.metrics = metrics or Metrics("consumer")
        self.admission = admission or AdmissionController(s.max_concurrent, s.max_queue, s.cache_budget_bytes,
                                                          self.metrics)

    async def _next(self, it, deadline: float):
        lease = self.engine.settings.frame_timeout_s
        left = deadline - time.time()
        if left <= 0:
            raise TimeoutError("the request's deadline passed; request aborted and its memory freed")
        try:
            return await asyncio.wait_for(anext(it), min(lease, left))
        except StopAsyncIteration:
            raise InvalidPayload("the stream ended before its trailer; frames were lost") from None
        except asyncio.TimeoutError:
            if left <= lease:
                raise TimeoutError("the request's deadline passed while waiting for frames; request aborted and "
                                   "its memory freed") from None
            raise TimeoutError(f"no frame for {lease:g} s (frame_timeout_s); request aborted and its memory freed"
                               ) from None

    @grpc_errors
    async def Transfer(self, request_iterator, context):
        eng, m, s = self.engine, self.metrics, self.engine.settings
        it = request_iterator.__aiter__()
        dec = FrameDecoder(n_layers=eng.adapter.n_layers)
        method, outcome, fallback = "unknown", "cancelled", ""
        deadline = time.time() + (context.time_remaining() or s.max_queue_wait_s + s.frame_timeout_s * 4)
        try:
            first = await self._next(it, deadline)
            kind, header = dec.feed(first)
            method = header.method if header.method in CODECS else "unknown"
            if header.deadline_unix:
                deadline = min(deadline, header.deadline_unix)
            req = eng.open(header)
            fallback = req.fallback
            if fallback:
                m.fallbacks.labels(fallback).inc()
            async with self.admission.slot(eng.cache_estimate(req), max(0.0, min(s.max_queue_wait_s,
                                                                                 deadline - time.time()))):
                async for ev in self._serve(req, dec, it, deadline, first.ByteSize()):
                    yield ev
            outcome = "ok"
        except Exception as e:
            outcome = status_for(e)[0].name.lower()
            raise
        finally:
            m.requests.labels(method, outcome, fallback or "none").inc()

    async def _serve(self, req, dec: FrameDecoder, it, deadline: float, header_bytes: int):
        eng, m, s = self.engine, self.metrics, self.engine.settings
        header = req.header
        method = header.method if header.method in CODECS else "unknown"
        m.frames.labels(method).inc()
        m.wire_bytes.labels(method).inc(header_bytes)
        t_first = t_last = time.perf_counter()  # first frame after the header: the transfer proper starts
        if not req.fallback:  # with the fallback the frames are not read: the producer's call ends with ours
            t_first = None
            raw_bytes = 0
            held = []  # no_pipelining (benchmark): layers wait for the trailer
            pipelined = not header.no_pipelining
            while True:
                frame = await self._next(it, deadline)
                m.frames.labels(method).inc()
                m.wire_bytes.labels(method).inc(frame.ByteSize())
                if frame.HasField("chunk"):  # bounded before anything is allocated
                    raw_bytes += frame.chunk.raw_size
                    if raw_bytes > s.max_stream_bytes:
                        raise InvalidPayload(f"stream carries more than {s.max_stream_bytes:,} payload bytes "
                                             "(max_stream_bytes)")
                out = dec.feed(frame)
                t_last = time.perf_counter()
                t_first = t_first or t_last
                if out is None:
                    continue
                if out[0] == "layer":
                    layer, tensors = out[1]
                    if pipelined:
                        await eng.run(eng.add_layer, req, layer, tensors)
                    else:
                        held.append((layer, tensors))
                elif out[0] == "trailer":
                    break
            for layer, tensors in held:
                await eng.run(eng.add_layer, req, layer, tensors)
            del held
        gen = await eng.run(eng.generator, req)
        req.session = None  # the cache now lives in the generator only
        m.reconstruct.labels(method).observe(req.reconstruct_ms / 1e3)
        t_dec = time.perf_counter()
        first = None
        while not gen.finished:
            if time.time() > deadline:
                raise TimeoutError("the request's deadline passed during decoding; request aborted and its memory "
                                   "freed")
            step = await eng.run(gen.step)
            if first is None:
                first = time.perf_counter()
                m.ttft.labels(method).observe(first - t_first)
            ev = pb.TokenEvent(text=step.text, token_id=step.token_id, index=len(gen.tokens) - 1,
                               finish_reason=step.finish_reason, request_id=header.request_id)
            if gen.finished:
                dt = time.perf_counter() - t_dec
                ev.timings.CopyFrom(pb.Timings(
                    reconstruct_ms=req.reconstruct_ms, transfer_ms=(t_last - t_first) * 1e3,
                    last_frame_to_first_token_ms=(first - t_last) * 1e3,
                    decode_tokens_per_s=len(gen.tokens) / dt if dt > 0 else 0.0,
                    prompt_tokens=len(header.prompt_ids), completion_tokens=len(gen.tokens), method=header.method,
                    fallback_recompute=bool(req.fallback),
                ))
            yield ev

    async def Info(self, request, context):
        e = self.engine
        return pb.ConsumerInfo(name=e.settings.name, model_fingerprint=e.fingerprint, methods=list(e.settings.methods),
                               n_layers=e.adapter.n_layers, protocol_version=PROTOCOL_VERSION)
