"""Thin gRPC servicer: frames in, token events out; the engine does the work."""

from __future__ import annotations

import asyncio
import logging
import time

from consumer_service.engine import ConsumerEngine
from shared.errors import InvalidPayload
from shared.rpc import scd_pb2 as pb
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.errors import grpc_errors
from shared.rpc.wire import PROTOCOL_VERSION, FrameDecoder

log = logging.getLogger(__name__)


class ConsumerServicer(pbg.ConsumerServicer):
    def __init__(self, engine: ConsumerEngine):
        self.engine = engine

    async def _next(self, it):
        try:
            return await asyncio.wait_for(anext(it), self.engine.settings.frame_timeout_s)
        except StopAsyncIteration:
            raise InvalidPayload("the stream ended before its trailer; frames were lost") from None
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"no frame for {self.engine.settings.frame_timeout_s:.0f} s; request aborted and its memory freed"
            ) from None

    @grpc_errors
    async def Transfer(self, request_iterator, context):
        eng = self.engine
        it = request_iterator.__aiter__()
        dec = FrameDecoder(n_layers=eng.adapter.n_layers)
        kind, header = dec.feed(await self._next(it))
        req = eng.open(header)
        t_first = None  # first frame after the header: the transfer proper starts
        held = []  # no_pipelining (benchmark): layers wait for the trailer
        while True:
            out = dec.feed(await self._next(it))
            t_last = time.perf_counter()
            t_first = t_first or t_last
            if out is None:
                continue
            if out[0] == "layer":
                layer, tensors = out[1]
                if header.no_pipelining:
                    held.append((layer, tensors))
                else:
                    await eng.run(eng.add_layer, req, layer, tensors)
            elif out[0] == "trailer":
                break
        for layer, tensors in held:
            await eng.run(eng.add_layer, req, layer, tensors)
        gen = await eng.run(eng.generator, req)
        req.session = None  # the cache now lives in the generator only
        t_dec = time.perf_counter()
        first = None
        while not gen.finished:
            step = await eng.run(gen.step)
            if first is None:
                first = time.perf_counter()
            ev = pb.TokenEvent(text=step.text, token_id=step.token_id, index=len(gen.tokens) - 1,
                               finish_reason=step.finish_reason, request_id=header.request_id)
            if gen.finished:
                dt = time.perf_counter() - t_dec
                ev.timings.CopyFrom(pb.Timings(
                    reconstruct_ms=req.reconstruct_ms, transfer_ms=(t_last - t_first) * 1e3,
                    last_frame_to_first_token_ms=(first - t_last) * 1e3,
                    decode_tokens_per_s=len(gen.tokens) / dt if dt > 0 else 0.0,
                    prompt_tokens=len(header.prompt_ids), completion_tokens=len(gen.tokens), method=header.method,
                ))
            yield ev

    async def Info(self, request, context):
        e = self.engine
        return pb.ConsumerInfo(name=e.settings.name, model_fingerprint=e.fingerprint, methods=list(e.settings.methods),
                               n_layers=e.adapter.n_layers, protocol_version=PROTOCOL_VERSION)
