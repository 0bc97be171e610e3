"""Thin gRPC servicer: a client's Generate becomes a Transfer stream to the consumer, whose token
events are relayed back."""

from __future__ import annotations

import logging
import time
import uuid

import grpc

from producer_service.engine import ProducerEngine
from shared.errors import PeerError
from shared.rpc import scd_pb2 as pb
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.errors import grpc_errors
from shared.rpc.server import OPTIONS
from shared.rpc.wire import StreamTotals, layer_frames

log = logging.getLogger(__name__)


class ProducerServicer(pbg.ProducerServicer):
    def __init__(self, engine: ProducerEngine):
        self.engine = engine
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=OPTIONS)
        return self._channels[address]

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()

    @grpc_errors
    async def Generate(self, request, context):
        eng = self.engine
        t0, t0_unix = time.perf_counter(), time.time()
        p = eng.prepare(request)
        rid = request.request_id or uuid.uuid4().hex
        remaining = context.time_remaining() or eng.settings.default_deadline_s
        totals = StreamTotals()
        stats = {"prefill_ms": 0.0, "encode_ms": 0.0}

        async def frames():
            yield totals.add(pb.KVFrame(header=eng.header(p, request, rid, t0_unix + remaining, t0_unix)))
            t = time.perf_counter()
            state = await eng.run(eng.prefill, p)
            stats["prefill_ms"] = (time.perf_counter() - t) * 1e3
            if p.method.transfers_layers and request.no_pipelining:  # benchmark: encode all, then send
                held = []
                for layer in range(eng.adapter.n_layers):
                    tensors, ms = await eng.run(eng.encode_layer, p, state, layer)
                    stats["encode_ms"] += ms
                    held.extend(layer_frames(layer, tensors))
                for f in held:
                    yield totals.add(f)
            elif p.method.transfers_layers:
                for layer in range(eng.adapter.n_layers):  # each layer leaves as soon as it is encoded
                    tensors, ms = await eng.run(eng.encode_layer, p, state, layer)
                    stats["encode_ms"] += ms
                    for f in layer_frames(layer, tensors):
                        yield totals.add(f)
            del state
            yield totals.add(totals.trailer(stats["encode_ms"], stats["prefill_ms"]))

        call = pbg.ConsumerStub(self.channel(p.address)).Transfer(frames(), timeout=remaining)
        ttft = None
        try:
            async for ev in call:
                if ttft is None:
                    ttft = (time.perf_counter() - t0) * 1e3
                if ev.HasField("timings"):
                    t = ev.timings
                    t.ttft_ms, t.prefill_ms, t.encode_ms = ttft, stats["prefill_ms"], stats["encode_ms"]
                    t.wire_bytes, t.payload_bytes = totals.wire_bytes, totals.payload_bytes
                yield ev
        except grpc.aio.AioRpcError as e:
            code = e.code()
            msg = e.details() or code.name
            raise PeerError(code.name, f"consumer {request.consumer!r}: {msg}") from None
        finally:
            call.cancel()
