"""The connector's two ends, without vLLM: a producer engine's ``Outgoing`` stream (one prompt's
frames, encoded layer by layer by a registered transfer method) and a consumer engine's
``Receiver`` (the frames checked as the consumer service checks them, each layer decoded to native,
rotated K/V as soon as it is in; the scheduler looks transfers up by key, the forward pass waits per
layer).

A transfer is keyed by a hash of the token ids it carries (``prompt_key``): a producer engine and a
consumer engine that see the same prompt agree on it without sharing request ids. The header's
``request_id`` carries the key, ``prompt_ids`` the transferred tokens plus the next one (the token the
consumer computes itself), ``n_tokens`` the transferred positions, as in ``Consumer.Transfer``.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from shared.codecs import CODECS, CodecContext, DecodeJob, make_method
from shared.domain import HeaderReceived, LayerReceived, SamplingRequest, StreamHeader, TrailerReceived
from shared.errors import (
    FingerprintMismatch,
    InvalidPayload,
    InvalidRequest,
    PreconditionFailed,
    ResourceExhausted,
    SCDError,
    UnknownMethod,
)
from shared.handshake import incompatibility, pin_mismatch
from shared.rpc import scd_pb2 as pb
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.diagnose import socket_problem, unreached, with_reason
from shared.rpc.errors import status_for
from shared.rpc.wire import PROTOCOL_VERSION, FrameDecoder, Limits, StreamTotals, header_frame, layer_frames

log = logging.getLogger(__name__)

SUPPORTED = ("raw", "quant", "scd-reuse")
"""Methods whose encode reads only a layer's K/V and whose decode needs only the consumer's geometry
and artifacts: what a connector, which sees the paged K/V and nothing else of the model, can run."""
WHY_NOT = {
    "scd": "its PATCH block runs the consumer's own decoder layers over the producer's residual-stream "
           "state; a vLLM connector sees only the paged K/V (no hidden states on the producer, no layers "
           "to run on the consumer)",
    "droidspeak": "it recomputes blocks of the consumer's layers from the producer's residual state, which "
                  "a connector cannot reach",
    "spectrum": "its per-token precision needs the producer's queries, which the paged cache does not hold",
    "ridge": "a layer's map reads other producer layers, so it cannot be encoded as each layer is saved",
    "oracle": "it transfers nothing: run the consumer engine without the connector",
}


def check_method(kind: str) -> None:
    """``UnknownMethod`` with the reason for a method the connector cannot run."""
    if kind in SUPPORTED:
        return
    if kind in WHY_NOT:
        raise UnknownMethod(f"method {kind!r} cannot run in the vLLM connector: {WHY_NOT[kind]}; use one of "
                            f"{list(SUPPORTED)} here, or the project's services for {kind!r}")
    raise UnknownMethod(f"unknown method {kind!r}; the vLLM connector runs {list(SUPPORTED)}")


def prompt_key(token_ids: Sequence[int]) -> str:
    """The key both engines compute for a transfer of these token ids."""
    return hashlib.sha256(torch.tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]


class AddressDoctor:
    """Why a push to a consumer engine's address failed, found once per address and ``ttl_s``: gRPC's
    transport words ("Socket closed", "Failed parsing HTTP/2", "Method not found!") become what
    answers there (nothing, an HTTP port, a TLS server, another gRPC service). The probe takes a few
    socket round trips, each up to ``timeout`` for a host that does not answer."""

    def __init__(self, ttl_s: float = 60.0, timeout: float = 2.0):
        self.ttl_s, self.timeout = ttl_s, timeout
        self._seen: dict[str, tuple[float, str]] = {}

    def explain(self, address: str, err: grpc.RpcError) -> str:
        if not unreached(err):
            return with_reason(None, err)
        now = time.monotonic()
        hit = self._seen.get(address)
        if hit is None or now - hit[0] > self.ttl_s:
            problem = socket_problem(address, None, None, "consumer engine", self.timeout,
                                     port_setting="listen in its kv_connector_extra_config")
            why = f"{address} {problem.said}" if problem else ""
            if not why and err.code() == grpc.StatusCode.UNIMPLEMENTED:
                why = (f"{address} is a gRPC server without scd.v1.KVReceiver (an SCD consumer service? the "
                       "connector pushes to a consumer engine's `listen` address)")
            hit = self._seen[address] = (now, why)
        return with_reason(hit[1], err)


class TransferFailed(SCDError):
    """A transfer the forward pass waited for failed or timed out; the connector reports its blocks."""


# ------------------------------------------------------------------------------ producer side
class LayerState:
    """What ``encode_layer`` reads of a prefill, one layer at a time: pre-RoPE K/V [1, H, T, D]."""

    def __init__(self, token_ids: Sequence[int]):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.residual: dict[int, torch.Tensor] = {}
        self.token_ids = torch.tensor([list(token_ids)])


class Outgoing:
    """One prompt's stream to a consumer engine's receiver: the header at once, each layer's frames
    as it is encoded, the trailer at ``close``, which waits for the receiver's verdict."""

    def __init__(self, stub: pbg.KVReceiverStub, method, header: StreamHeader, timeout_s: float):
        self.method, self.header = method, header
        self.state = LayerState(header.prompt_ids[:-1])
        self._q: queue.Queue = queue.Queue()
        self._totals = StreamTotals()
        self.encode_ms = 0.0
        self._q.put(self._totals.add(header_frame(header)))
        self._future = stub.Push.future(self._frames(), timeout=timeout_s)

    def _frames(self) -> Iterator[pb.KVFrame]:
        while (f := self._q.get()) is not None:
            yield f

    def add_layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Encode and send ``layer`` from its pre-RoPE K/V [1, H, T, D]."""
        t = time.perf_counter()
        self.state.keys[layer], self.state.values[layer] = keys, values
        tensors = self.method.encode_layer(self.state, layer, 0)
        del self.state.keys[layer], self.state.values[layer]
        self.encode_ms += 1e3 * (time.perf_counter() - t)
        for f in layer_frames(layer, tensors):
            self._q.put(self._totals.add(f))

    def close(self, timeout_s: float) -> pb.PushReply:
        """The trailer, then the receiver's answer (raises ``grpc.RpcError`` with its status)."""
        self._q.put(self._totals.trailer(self.encode_ms))
        self._q.put(None)
        return self._future.result(timeout=timeout_s)

    def abort(self) -> None:
        self._future.cancel()
        self._q.put(None)


def make_header(method, fingerprint: str, key: str, token_ids: Sequence[int], n_layers: int,
                deadline_s: float) -> StreamHeader:
    """The stream header of a transfer of ``token_ids[:-1]`` (the last is the one the consumer computes)."""
    return StreamHeader(
        request_id=key, method=method.kind, method_version=method.version, protocol_version=PROTOCOL_VERSION,
        pair_fingerprint=method.pair_fingerprint(fingerprint),
        n_layers=n_layers, n_tokens=len(token_ids) - 1, prompt_ids=tuple(int(t) for t in token_ids),
        params=method.cfg.wire_params(), sampling=SamplingRequest(), native_prefix=False, prefix_len=0,
        consumer="", deadline_unix=time.time() + deadline_s)


# ------------------------------------------------------------------------------ consumer side
@dataclass
class Received:
    """One transfer held by a receiver; its decoded layers are native, RoPE-rotated K/V [T, H, D]."""

    key: str
    n_tokens: int
    method: str
    nbytes: int  # what its decoded layers hold, charged against the receiver's budget
    state: str = "receiving"
    error: str = ""
    wire_bytes: int = 0
    used: float = field(default_factory=time.monotonic)  # arrival, then the end of its last load
    claims: int = 0  # loads reading it now (several requests may start with the same prompt)
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def claimed(self) -> bool:
        """A load is reading it: not to be evicted, expired or replaced."""
        return self.claims > 0

    def layer(self, i: int, timeout_s: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s K/V once decoded; ``TransferFailed`` if the transfer failed or it took too long."""
        end = time.monotonic() + timeout_s
        with self.cond:
            while i not in self.layers and self.state != "failed":
                left = end - time.monotonic()
                if left <= 0 or (self.state == "ready" and i not in self.layers):
                    raise TransferFailed(f"transfer {self.key}: layer {i} not received "
                                         f"({'timed out' if left <= 0 else 'the stream ended without it'})")
                self.cond.wait(min(left, 1.0))
            if self.state == "failed":
                raise TransferFailed(f"transfer {self.key} failed: {self.error}")
            return self.layers[i]

    def _set(self, **kw) -> None:
        with self.cond:
            for k, v in kw.items():
                setattr(self, k, v)
            self.cond.notify_all()


class Receiver:
    """A consumer engine's received transfers, by key: bounded in bytes (``RESOURCE_EXHAUSTED`` past
    ``max_bytes``), unclaimed ones dropped after ``ttl_s``. Checks every stream as the consumer service
    does: protocol and method versions, the producer's weights fingerprint (when this side knows it),
    the artifacts' pin, the layer count, every chunk's bounds and checksum, the trailer's totals. A
    transfer stays after a load, for later prompts with the same prefix, until ``ttl_s`` after its
    last use or until a new one needs its bytes (least recently used first)."""

    def __init__(self, model, ctx: CodecContext, methods: Sequence[str] = SUPPORTED,
                 producer_fingerprint: str | None = None, limits: Limits = Limits(), max_bytes: int = 2 << 30,
                 ttl_s: float = 120.0, max_tokens: int = 1 << 16, frame_timeout_s: float = 30.0):
        for m in methods:
            check_method(m)
        self.model, self.ctx, self.methods = model, ctx, tuple(methods)
        self.producer_fingerprint, self.limits = producer_fingerprint, limits
        self.max_bytes, self.ttl_s, self.max_tokens = max_bytes, ttl_s, max_tokens
        self.frame_timeout_s = frame_timeout_s
        """A stream that sends no frame for this long is cut and its transfer fails (its slot freed)."""
        self._held: dict[str, Received] = {}
        self._lock = threading.Lock()
        self.counters = {"pushes_ok": 0, "pushes_failed": 0, "layers_received": 0, "wire_bytes": 0}

    # ------------------------------------------------------------------ receiving
    def _check(self, h: StreamHeader) -> None:
        if h.method not in self.methods:
            if h.method in CODECS:
                check_method(h.method)
            raise UnknownMethod(f"method {h.method!r} is not enabled on this consumer engine; enabled: "
                                f"{list(self.methods)}")
        bad = incompatibility(h, self.model.n_layers, self.producer_fingerprint, "this consumer engine")
        if bad is not None:
            raise (FingerprintMismatch if bad[0] == "fingerprint" else PreconditionFailed)(bad[1])
        if not 0 < h.n_tokens <= self.max_tokens or h.n_tokens != len(h.prompt_ids) - 1:
            raise InvalidPayload(f"header n_tokens={h.n_tokens} with {len(h.prompt_ids)} prompt ids; expected "
                                 f"1 to {self.max_tokens} positions and prompt length - 1")
        if len(h.request_id) != 32 or h.request_id != prompt_key(h.prompt_ids[:-1]):
            raise InvalidRequest("header request_id must be the key of the transferred token ids "
                                 "(integrations.vllm_connector.transfers.prompt_key)")
        vocab = self.model.config.vocab_size
        if max(h.prompt_ids) >= vocab:
            raise InvalidRequest(f"prompt token id {max(h.prompt_ids)} is outside the vocabulary (size {vocab})")

    def _open(self, h: StreamHeader):
        self._check(h)
        method = make_method(h.method, self.ctx, dict(h.params))
        msg = pin_mismatch(h, method.pin(), "this consumer engine")
        if msg is not None:
            raise PreconditionFailed(msg)
        session = method.start(DecodeJob(prompt_ids=list(h.prompt_ids), n_tokens=h.n_tokens, start=0))
        m = self.model
        nbytes = 2 * m.n_layers * h.n_tokens * m.kv_dim * torch.empty((), dtype=m.dtype).element_size()
        t = Received(h.request_id, h.n_tokens, h.method, nbytes)
        if nbytes > self.max_bytes:  # no eviction makes room: not a retry later
            raise InvalidRequest(f"this transfer needs {nbytes:,} bytes ({h.n_tokens} positions), over the "
                                 f"receiver's whole budget of {self.max_bytes:,} (max_held_bytes): raise it or send "
                                 "shorter prompts")
        with self._lock:
            self._expire()
            old = self._held.get(t.key)
            # a load reads it, or it is arriving: replacing it would stop counting bytes still in use, and
            # hand its load's end (done, release) to the new one
            if old is not None and (old.claimed or old.state == "receiving"):
                raise PreconditionFailed(f"transfer {t.key} is held and {'being loaded' if old.claimed else 'arriving'}"
                                         "; it serves this prompt: no second push is needed")
            if old is not None:  # a newer transfer of the same prompt supersedes the old one
                del self._held[t.key]
            in_use = sum(x.nbytes for x in self._held.values() if x.claimed or x.state == "receiving")
            if in_use + nbytes > self.max_bytes:
                if old is not None:  # nothing is evicted for a transfer that would not fit anyway
                    self._held[old.key] = old
                held = sum(x.nbytes for x in self._held.values())
                raise ResourceExhausted(f"receiver holds {held:,} bytes of transfers, {in_use:,} of them in use; this "
                                        f"one needs {nbytes:,} and the budget is {self.max_bytes:,} (max_held_bytes): "
                                        "retry when a load ends")
            self._evict_for(nbytes)
            self._held[t.key] = t
        return t, session

    def push(self, frames: Iterable[pb.KVFrame]) -> pb.PushReply:
        """Receive one stream (a Push call); raises ``SCDError`` (mapped to a status) on a bad one."""
        decoder = FrameDecoder(self.limits, n_layers=self.model.n_layers)
        t: Received | None = None
        session = None
        try:
            for frame in frames:
                ev = decoder.feed(frame)
                if t is not None:
                    t.wire_bytes += frame.ByteSize()
                if isinstance(ev, HeaderReceived):
                    t, session = self._open(ev.header)
                    decoder.plan(session.schema)
                elif isinstance(ev, LayerReceived):
                    assert session is not None and t is not None
                    session.add_layer(ev.layer, ev.tensors)
                    k, v = session.entry(ev.layer)  # [1, H, T, D] rotated, on the engine's device and dtype
                    with t.cond:
                        t.layers[ev.layer] = (k[0].transpose(0, 1), v[0].transpose(0, 1))
                        t.cond.notify_all()
                    self._count("layers_received")
                elif isinstance(ev, TrailerReceived):
                    pass
            if t is None or not decoder.done:
                raise InvalidPayload("stream ended before its trailer")
            if len(t.layers) != self.model.n_layers:
                raise InvalidPayload(f"stream ended after {len(t.layers)} of {self.model.n_layers} layers")
            t._set(state="ready")
            self._count("pushes_ok")
            self._count("wire_bytes", t.wire_bytes)
            return pb.PushReply(layers=len(t.layers), wire_bytes=t.wire_bytes)
        except BaseException as e:
            self._count("pushes_failed")
            if t is not None:
                t._set(state="failed", error=str(e) or type(e).__name__, layers={})
            raise
        finally:
            decoder.close()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    # ------------------------------------------------------------------ the scheduler's and the forward pass's view
    def lookup(self, keys: Sequence[str]) -> list[pb.LookupEntry]:
        with self._lock:
            self._expire()
            return [pb.LookupEntry(key=k, n_tokens=t.n_tokens, state=t.state, error=t.error[:512])
                    for k in keys if (t := self._held.get(k)) is not None]

    def claim(self, key: str) -> Received | None:
        """The transfer a load will read, or None if it is not held. It is kept (not evicted, expired
        or replaced) until each load that claimed it calls ``done`` or ``release``."""
        with self._lock:
            t = self._held.get(key)
            if t is not None:
                t.claims += 1
            return t

    def done(self, key: str) -> None:
        """A load of ``key`` finished: the transfer stays held for later prompts that start with the same
        tokens (until ``ttl_s`` after its last use, or until a new transfer needs its bytes)."""
        with self._lock:
            t = self._held.get(key)
            if t is not None:
                t.claims, t.used = max(0, t.claims - 1), time.monotonic()

    def release(self, key: str) -> None:
        """A load of ``key`` failed: drop the transfer, once no other load reads it."""
        with self._lock:
            t = self._held.get(key)
            if t is not None:
                t.claims = max(0, t.claims - 1)
                if not t.claimed:
                    del self._held[key]

    def _expire(self) -> None:
        now = time.monotonic()
        for k in [k for k, t in self._held.items() if not t.claimed and now - t.used > self.ttl_s]:
            del self._held[k]

    def _evict_for(self, nbytes: int) -> int:
        """Drop unclaimed transfers, least recently used first, until ``nbytes`` more fit; the bytes held."""
        held = sum(x.nbytes for x in self._held.values())
        for t in sorted((x for x in self._held.values() if not x.claimed and x.state != "receiving"),
                        key=lambda x: x.used):
            if held + nbytes <= self.max_bytes:
                break
            del self._held[t.key]
            held -= t.nbytes
        return held


class ReceiverServicer(pbg.KVReceiverServicer):
    """The gRPC face of a ``Receiver`` (sync server: vLLM's worker is not an event loop)."""

    def __init__(self, receiver: Receiver):
        self.receiver = receiver

    def Push(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        """One stream; a watchdog cuts it when no frame arrives for ``frame_timeout_s`` (a stalled or
        trickling producer must not hold a receiver thread and a transfer slot)."""
        last, done, stalled = [time.monotonic()], threading.Event(), threading.Event()
        limit = self.receiver.frame_timeout_s

        def frames():
            for f in request_iterator:
                last[0] = time.monotonic()
                yield f
            if stalled.is_set():
                raise TimeoutError(f"no frame for {limit:g} s (frame_timeout_s): the stream was cut")

        def watch():
            while not done.wait(min(0.5, limit / 4)):
                if time.monotonic() - last[0] > limit:
                    stalled.set()
                    context.cancel()
                    return

        threading.Thread(target=watch, daemon=True, name="scd-receiver-watchdog").start()
        try:
            return self.receiver.push(frames())
        except Exception as e:  # noqa: BLE001 - every error becomes a status
            if stalled.is_set() and not isinstance(e, TimeoutError):
                e = TimeoutError(f"no frame for {limit:g} s (frame_timeout_s): the stream was cut")
            code, msg = status_for(e)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("receiver: unhandled error")
            context.abort(code, msg)
        finally:
            done.set()

    def Lookup(self, request, context):  # noqa: N802
        if len(request.keys) > 64:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"at most 64 keys per lookup; got {len(request.keys)}")
        return pb.LookupReply(entries=self.receiver.lookup(list(request.keys)))


def serve_receiver(receiver: Receiver, address: str, limits: Limits = Limits()) -> tuple[grpc.Server, int]:
    """Start the receiver's gRPC server on ``address`` (``host:port``; port 0 picks one)."""
    from concurrent.futures import ThreadPoolExecutor

    opts = [("grpc.max_receive_message_length", limits.max_chunk_bytes + (1 << 20)),
            ("grpc.max_send_message_length", 4 << 20)]
    server = grpc.server(ThreadPoolExecutor(max_workers=8, thread_name_prefix="scd-receiver"), options=opts)
    pbg.add_KVReceiverServicer_to_server(ReceiverServicer(receiver), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    server.start()
    return server, port
