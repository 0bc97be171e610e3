"""Consumer engine: validates a stream's header, receives the frames' layers through a bounded
read-ahead queue and reconstructs each one on the torch worker as it arrives (so reconstruction
overlaps the transfer whatever HTTP/2 flow control does), then decodes, yielding token events.
Domain types in and out; no protobuf. Admission control and the service's metrics live here too."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

import torch
from pydantic import ValidationError

from consumer_service.admission import AdmissionController
from consumer_service.settings import ConsumerSettings
from shared.codecs import CODECS, DecodeJob, DecodeSession, make_method
from shared.config import field_errors, first_field
from shared.domain import (
    HeaderReceived,
    LayerReceived,
    SamplingRequest,
    Schema,
    StreamEvent,
    StreamHeader,
    Timings,
    TokenEvent,
    TrailerReceived,
)
from shared.engine import Engine
from shared.errors import (
    MAX_ID_CHARS,
    FingerprintMismatch,
    InvalidPayload,
    InvalidRequest,
    PreconditionFailed,
    UnknownMethod,
    clip,
    usable_request_id,
)
from shared.generation import Generator, Sampling, fresh_seed
from shared.handshake import incompatibility, pin_mismatch
from shared.metrics import Metrics
from shared.tasks import finish, spawn

log = logging.getLogger(__name__)


@dataclass
class Request:
    """One in-flight transfer on the consumer."""

    header: StreamHeader
    session: DecodeSession | None
    sampling: Sampling
    fallback: str = ""  # why the consumer recomputes the prefill itself ("" = it uses the transfer)
    reconstruct_ms: float = 0.0
    t_first: float | None = None  # first frame after the header (the transfer proper)
    t_last: float = 0.0  # last frame (the trailer)


@dataclass
class TransferRecord:
    """What the servicer and the engine share about one stream: the engine fills the method, the
    fallback and the schema the frames must follow once it has opened the request; the servicer
    counts the wire bytes that arrived."""

    method: str = "unknown"
    request_id: str = ""
    fallback: str = ""
    schema: Callable[[int], Schema] | None = None
    bytes_in: int = 0
    prompt_tokens: int | None = None  # from the header: the request log's, when no final timings came
    waited_s: float = 0.0  # time spent waiting for frames (not reconstructing), since data_from
    data_from: float | None = None
    """When the first frame after the header arrived (``time.perf_counter``). The producer sends its
    header before it prefills; the wait for its prefill is bounded by the frame lease, not by the
    minimum progress rate, which counts from here."""


class ConsumerEngine(Engine):
    """The fine-tuned model's side of every request. Torch work runs on the engine's worker thread."""

    def __init__(self, settings: ConsumerSettings, model, tokenizer=None, metrics: Metrics | None = None):
        super().__init__(settings, model, tokenizer, f"consumer-{settings.name}")
        self.settings: ConsumerSettings = settings
        s = settings
        self.metrics = metrics or Metrics("consumer")
        self.admission = AdmissionController(s.max_concurrent, s.max_queue, s.cache_budget_bytes, self.metrics)
        from pathlib import Path

        folder = Path(s.artifact_store) / s.name if s.artifact_store else None
        self.ctx = self.load_context(folder, "consumer", s.producer_fingerprint, self.fingerprint,
                                     require=tuple(m for m in s.methods if CODECS[m].requires))
        meta = getattr(self.ctx.artifacts, "meta", None)  # the artifacts also pin the producer accepted
        self.producer_fingerprint = s.producer_fingerprint or (meta.producer_fingerprint if meta else None)
        self.stop_ids = frozenset(self.format.stop_ids if self.format else ())
        self.prefix_ids: list[int] = []
        self.prefix_keys: tuple[torch.Tensor, ...] = ()
        self.prefix_values: tuple[torch.Tensor, ...] = ()
        if self.format is not None and self.format.prefix_ids:
            self._prepare_native_prefix(self.format.prefix_ids)

    def _prepare_native_prefix(self, prefix_ids: list[int]) -> None:
        """The consumer's own K/V for the fixed chat-template prefix, computed once."""
        self.prefix_ids = list(prefix_ids)
        state = self.adapter.prefill(self.prefix_ids)
        self.prefix_keys, self.prefix_values = state.keys, state.values

    # ------------------------------------------------------------------ header
    def incompatibility(self, h: StreamHeader) -> tuple[str, str] | None:
        """(reason, actionable message) when the stream does not match what this consumer loaded."""
        return incompatibility(h, self.adapter.n_layers, self.producer_fingerprint,
                               f"consumer {self.settings.name!r}")

    def open(self, h: StreamHeader) -> Request:
        s = self.settings
        if h.request_id and not usable_request_id(h.request_id):  # empty: the consumer makes one
            raise InvalidRequest(f"request_id must be 1-{MAX_ID_CHARS} printable ASCII characters (or empty); got "
                                 f"{clip(h.request_id)}", param="request_id")
        if h.consumer and h.consumer != s.name:
            raise PreconditionFailed(f"stream addressed to consumer {clip(h.consumer)}; this is {s.name!r}: the "
                                     "producer's address for it (its consumers setting) points at another consumer")
        if h.method not in s.methods:
            raise UnknownMethod(f"method {clip(h.method)} is not enabled on consumer {s.name!r}; enabled: "
                                f"{list(s.methods)}")
        bad = self.incompatibility(h)
        if bad is not None and s.fallback != "recompute":
            raise (FingerprintMismatch if bad[0] == "fingerprint" else PreconditionFailed)(bad[1])
        n_prompt = len(h.prompt_ids)
        limit, why = self.prompt_limit()
        if not 2 <= n_prompt <= limit:
            raise InvalidRequest(f"prompt has {n_prompt} tokens; this consumer takes 2 to {limit} ({why})",
                                 param="prompt")
        vocab = self.adapter.config.vocab_size
        if max(h.prompt_ids) >= vocab:
            raise InvalidRequest(f"prompt token id {max(h.prompt_ids)} is outside the vocabulary (size {vocab})",
                                 param="prompt")
        if h.n_tokens != n_prompt - 1:
            raise InvalidPayload(f"header n_tokens={h.n_tokens}; expected prompt length - 1 = {n_prompt - 1}")
        if h.prefix_len and not (h.native_prefix and h.prefix_len < n_prompt):
            raise InvalidPayload(f"header prefix_len={h.prefix_len} with native_prefix={str(h.native_prefix).lower()} "
                                 f"and {n_prompt} prompt tokens: a prefix is declared with native_prefix set and is "
                                 "shorter than the prompt")
        sampling = self.sampling(h.sampling)
        if self.context and n_prompt + sampling.max_new_tokens > self.context:
            raise InvalidRequest(f"the prompt's {n_prompt} tokens and max_new_tokens={sampling.max_new_tokens} pass "
                                 f"the model's context of {self.context} tokens; ask for at most "
                                 f"{max(self.context - n_prompt, 0)} new tokens or shorten the prompt",
                                 param="prompt")  # as OpenAI names it (context_length_exceeded)
        if bad is not None:  # fallback: prefill the prompt with our own model, ignore the frames
            return self._fallback(h, sampling, *bad)
        start = 0
        if h.native_prefix and h.prefix_len:
            p = h.prefix_len
            if p > len(self.prefix_ids) or list(h.prompt_ids[:p]) != self.prefix_ids[:p] or p >= n_prompt:
                raise InvalidRequest("native_prefix is set but the prompt does not start with this consumer's "
                                     "chat-template prefix; send native_prefix=false", param="native_prefix")
            start = p
        method = make_method(h.method, self.ctx, dict(h.params))
        msg = pin_mismatch(h, method.pin(), f"consumer {s.name!r}")
        if msg is not None:
            if s.fallback != "recompute":
                raise PreconditionFailed(msg)
            return self._fallback(h, sampling, "artifacts", msg)
        job = DecodeJob(
            prompt_ids=list(h.prompt_ids), n_tokens=h.n_tokens, start=start,
            prefix_keys=tuple(k[:, :, :start] for k in self.prefix_keys) if start else (),
            prefix_values=tuple(v[:, :, :start] for v in self.prefix_values) if start else (),
        )
        return Request(h, method.start(job), sampling)

    def _fallback(self, h: StreamHeader, sampling: Sampling, reason: str, why: str) -> Request:
        """The consumer prefills the prompt itself; the stream's frames are verified and dropped."""
        log.warning("request %s: %s; recomputing the prefill (fallback=recompute)", clip(h.request_id), why)
        from shared.codecs.oracle import Oracle

        job = DecodeJob(prompt_ids=list(h.prompt_ids), n_tokens=len(h.prompt_ids) - 1, start=0)
        return Request(h, Oracle(Oracle.Config(), self.ctx).start(job), sampling, fallback=reason)

    def cache_estimate(self, req: Request) -> int:
        """Bytes the request may hold, charged before anything is allocated: its cache at its
        longest ((prompt + max_new_tokens) positions) and the payload its method declares."""
        a = self.adapter
        per_token = a.n_layers * 2 * a.n_kv_heads * a.head_dim * torch.empty((), dtype=a.dtype).element_size()
        payload = req.session.max_transfer_bytes() if req.session is not None and not req.fallback else 0
        return (len(req.header.prompt_ids) + req.sampling.max_new_tokens) * per_token + payload

    def sampling(self, sp: SamplingRequest) -> Sampling:
        s = self.settings
        n = sp.max_new_tokens or s.default_max_new_tokens
        if n > s.max_new_tokens:
            raise InvalidRequest(f"max_new_tokens={n}; this consumer allows at most {s.max_new_tokens}",
                                 param="max_new_tokens")
        try:
            return Sampling(max_new_tokens=n, temperature=sp.temperature, top_p=sp.top_p or 1.0,
                            stop=tuple(sp.stop), seed=fresh_seed() if sp.seed is None else sp.seed)
        except ValidationError as e:
            raise InvalidRequest(f"invalid sampling settings: {'; '.join(field_errors(e))}",
                                 param=first_field(e)) from None

    # ------------------------------------------------------------------ torch work (worker thread)
    def add_layer(self, req: Request, layer: int, tensors) -> None:
        t0 = time.perf_counter()
        assert req.session is not None  # dropped only once the cache is built
        req.session.add_layer(layer, tensors)
        req.reconstruct_ms += (time.perf_counter() - t0) * 1e3

    def generator(self, req: Request) -> Generator:
        t0 = time.perf_counter()
        assert req.session is not None
        cache, logits = req.session.finish_for_decoding()
        req.session = None  # the cache now lives in the generator only
        req.reconstruct_ms += (time.perf_counter() - t0) * 1e3
        return Generator(self.adapter, cache, int(req.header.prompt_ids[-1]), req.sampling, self.tokenizer,
                         self.stop_ids, first_logits=logits)

    # ------------------------------------------------------------------ the stream
    def _progress_left(self, record: TransferRecord) -> float:
        """Seconds of waiting the stream may still use at the minimum progress rate."""
        s = self.settings
        if not s.min_progress_bytes_per_s or record.data_from is None:
            return float("inf")  # before the first frame after the header: the frame lease bounds the wait
        return s.progress_grace_s + record.bytes_in / s.min_progress_bytes_per_s - record.waited_s

    async def _next(self, events: AsyncIterator[StreamEvent], deadline: float,
                    record: TransferRecord | None = None) -> StreamEvent:
        """The next event, within the frame lease, the minimum progress rate and the request's deadline."""
        ev = await self._read(events, deadline, record)
        if ev is None:
            raise InvalidPayload("the stream ended before its trailer; frames were lost")
        return ev

    async def _end(self, events: AsyncIterator[StreamEvent], deadline: float, record: TransferRecord) -> None:
        """After the trailer: the stream must end there, within the same limits as a frame. A frame
        after it (which the decoder refuses) is a protocol violation like any other: InvalidPayload."""
        if await self._read(events, deadline, record, after_trailer=True) is not None:
            raise InvalidPayload("a frame arrived after the trailer; the trailer must be the last frame of a "
                                 "request's stream")

    async def _read(self, events: AsyncIterator[StreamEvent], deadline: float, record: TransferRecord | None = None,
                    after_trailer: bool = False) -> StreamEvent | None:
        """``_next``'s wait: the next event, or None at the end of the stream."""
        s = self.settings
        lease, left = s.frame_timeout_s + self._prefill_allowance(record), deadline - time.time()
        progress = self._progress_left(record) if record is not None else float("inf")
        if left <= 0:
            raise TimeoutError("the request's deadline passed; request aborted and its memory freed")
        if progress <= 0:
            raise TimeoutError(self._slow(record))
        t0 = time.perf_counter()
        err: BaseException | None = None
        try:
            # not wait_for: on Python 3.11 it loses a cancellation that meets a frame arriving, and the
            # reader of a request already ended went on waiting for frames (tests/integration/test_leaks.py)
            wait = min(lease, left, progress)
            async with asyncio.timeout(wait if math.isfinite(wait) else None):
                ev = await anext(events)
        except (StopAsyncIteration, asyncio.TimeoutError) as e:
            err = e
        finally:  # the wait since the stream's data began counts against the progress rate
            if record is not None and record.data_from is not None:
                record.waited_s += max(0.0, time.perf_counter() - max(t0, record.data_from))
        if err is None:
            return ev
        if isinstance(err, StopAsyncIteration):
            return None
        if left <= min(lease, progress):
            raise TimeoutError("the request's deadline passed while waiting for frames; request aborted and "
                               "its memory freed") from None
        if record is not None and self._progress_left(record) <= 0:
            raise TimeoutError(self._slow(record)) from None
        if after_trailer:
            raise TimeoutError(f"the stream did not end within {lease:g} s (frame_timeout_s) of its trailer: the "
                               "sender must close its side after the trailer; request aborted and its memory freed"
                               ) from None
        why = "frame_timeout_s" if lease == s.frame_timeout_s else \
            "frame_timeout_s + prefill_allowance_ms_per_token x prompt tokens: the producer's prefill"
        raise TimeoutError(f"no frame for {lease:g} s ({why}); request aborted and its memory freed") from None

    def _prefill_allowance(self, record: TransferRecord | None) -> float:
        """Seconds added to the frame lease while the producer may be prefilling: before the stream's
        first data frame, by the header's prompt length (before the header: the longest prompt taken)."""
        if record is not None and record.data_from is not None:
            return 0.0
        tokens = record.prompt_tokens if record is not None and record.prompt_tokens else self.prompt_limit()[0]
        return self.settings.prefill_allowance_ms_per_token * tokens / 1e3

    def _slow(self, record) -> str:
        return (f"the stream delivered {record.bytes_in:,} bytes in {record.waited_s:.1f} s of waiting, under "
                f"min_progress_bytes_per_s={self.settings.min_progress_bytes_per_s}; request aborted and its "
                "memory freed")

    async def transfer(self, events: AsyncIterator[StreamEvent], deadline: float, record: TransferRecord,
                       hold: bool = False) -> AsyncGenerator[TokenEvent, None]:
        """One request: its header, admission, the layers reconstructed as they arrive, then the
        decoded tokens. ``hold`` (benchmarks only) reconstructs after the trailer instead."""
        first = await self._next(events, deadline)
        if not isinstance(first, HeaderReceived):
            raise InvalidPayload("the stream must start with its header")
        h = first.header
        record.method = h.method if h.method in CODECS else "unknown"
        # 0: no deadline of its own. The decoder refused a non-finite or negative one; a far-future one is
        # capped here by the consumer's own (the call's gRPC deadline, or when the call has none
        # max_queue_wait_s + 4 x frame_timeout_s: see the servicer)
        if h.deadline_unix:
            deadline = min(deadline, h.deadline_unix)
        req = self.open(h)
        try:
            async with contextlib.aclosing(self._serve(req, events, deadline, record, hold)) as served:
                async for ev in served:
                    yield ev
        finally:  # what the request decoded goes now, even if a traceback still holds this frame
            req.session = None
            record.schema = None

    async def _serve(self, req: Request, events: AsyncIterator[StreamEvent], deadline: float,
                     record: TransferRecord, hold: bool) -> AsyncGenerator[TokenEvent, None]:
        record.fallback = req.fallback
        if req.fallback:
            self.metrics.fallbacks.labels(req.fallback).inc()
        else:
            assert req.session is not None
            record.schema = req.session.schema
        s = self.settings
        wait = max(0.0, min(s.max_queue_wait_s, deadline - time.time()))
        async with self.admission.slot(self.cache_estimate(req), wait):
            drain = end = None
            if req.fallback:  # the frames are verified and dropped while the consumer prefills itself
                drain = spawn(self._drain(events, deadline, record), self.metrics.live_tasks)
            else:
                await self._reconstruct(req, events, deadline, hold, record)
                # the trailer must end the stream: its end is awaited while decoding, and before the final
                # event (a frame after the trailer fails the request, its memory and slot freed)
                end = spawn(self._end(events, deadline, record), self.metrics.live_tasks)
            try:
                async for ev in self._decode(req, deadline):
                    if end is not None and (end.done() or ev.timings is not None):
                        await end  # raises what came after the trailer
                    yield ev
                if drain is not None:  # the answer is out; the call ends once the producer has sent it all
                    await drain
            finally:  # a fault after another one is retrieved there, not logged as unhandled
                await finish(drain, end)

    async def _drain(self, events, deadline: float, record: TransferRecord) -> None:
        """Read the rest of a stream the consumer does not use, so that the producer's call ends
        cleanly; a fault in it does not concern the answer (which does not depend on it)."""
        try:
            while not isinstance(await self._next(events, deadline, record), TrailerReceived):
                pass
            await self._end(events, deadline, record)
        except Exception as e:  # noqa: BLE001 - logged; the request is served from the consumer's own prefill
            log.info("request %s: the unused stream ended early or broke the protocol (%s)", record.method, e)

    async def _reconstruct(self, req: Request, events, deadline: float, hold: bool, record: TransferRecord) -> None:
        """A reader task pulls layers into a bounded queue while this loop reconstructs them on the
        worker: layer l+1 arrives while layer l is rebuilt."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.settings.read_ahead_layers)

        async def receive() -> None:
            try:
                while True:
                    ev = await self._next(events, deadline, record)
                    req.t_last = time.perf_counter()
                    req.t_first = req.t_first or req.t_last
                    await queue.put(ev)
                    if isinstance(ev, TrailerReceived):
                        return
            except asyncio.CancelledError:
                raise  # the request ended: the loop below is gone and nothing waits for the queue
            except Exception as e:  # noqa: BLE001 - handed to the reconstruct loop, which raises it
                await queue.put(e)

        reader = spawn(receive(), self.metrics.live_tasks)
        held: list[LayerReceived] = []
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    err, item = item, None
                    try:
                        raise err
                    finally:  # no frame of this request keeps its own exception (a cycle: the traceback holds
                        del err  # the frames, and they the request's layers, until the collector's next full pass)
                if isinstance(item, TrailerReceived):
                    break
                if not isinstance(item, LayerReceived):
                    raise InvalidPayload("a second header arrived inside the stream")
                if hold:
                    held.append(item)
                else:
                    await self.run(self.add_layer, req, item.layer, item.tensors)
            for item in held:
                await self.run(self.add_layer, req, item.layer, item.tensors)
        finally:  # the reader ends before the request does; what it queued goes with the queue
            await finish(reader)
            held.clear()
            while not queue.empty():
                queue.get_nowait()

    async def _decode(self, req: Request, deadline: float) -> AsyncGenerator[TokenEvent, None]:
        m, h = self.metrics, req.header
        gen = await self.run(self.generator, req)
        m.reconstruct.labels(h.method).observe(req.reconstruct_ms / 1e3)
        t_first = req.t_first or time.perf_counter()
        t_last = req.t_last or t_first
        t_dec = time.perf_counter()
        first, index = None, 0
        while not gen.finished:
            if time.time() > deadline:
                raise TimeoutError("the request's deadline passed during decoding; request aborted and its memory "
                                   "freed")
            step = await self.run(gen.step)
            if first is None:
                first = time.perf_counter()
                m.ttft.labels(h.method).observe(first - t_first)
            # the index counts events: an answer that stops at once is one event, index 0, no text
            ev = TokenEvent(text=step.text, token_id=step.token_id, index=index, finish_reason=step.finish_reason,
                            request_id=h.request_id)
            index += 1
            if gen.finished:
                dt = time.perf_counter() - t_dec
                ev.timings = Timings(
                    reconstruct_ms=req.reconstruct_ms, transfer_ms=(t_last - t_first) * 1e3,
                    last_frame_to_first_token_ms=(first - t_last) * 1e3,
                    decode_tokens_per_s=gen.sampled / dt if dt > 0 else 0.0, prompt_tokens=len(h.prompt_ids),
                    completion_tokens=gen.sampled, method=h.method, fallback_recompute=bool(req.fallback),
                    consumer_fingerprint=self.fingerprint)
            yield ev
