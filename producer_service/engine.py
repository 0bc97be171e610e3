"""Producer engine: validates a request, tokenizes it with the consumer's prompt format, prefills the
base model and encodes each layer for the wire. Domain types in and out; no protobuf."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Gauge
from pydantic import ValidationError

from producer_service.settings import ProducerSettings
from shared.auto import AutoSettings, Choice, LinkEstimator, can_serve, choose, remake_hint, stale_points
from shared.codecs import CODECS, CodecContext, TransferMethod, make_method, requires, resolve_variant
from shared.config import field_errors, first_field
from shared.domain import EncodedLayer, GenerateRequest, StreamHeader
from shared.engine import Engine
from shared.errors import (
    MAX_ID_CHARS,
    ConfigError,
    InvalidRequest,
    NotFound,
    PreconditionFailed,
    SCDError,
    UnknownMethod,
    clip,
    usable_request_id,
)
from shared.generation import Sampling
from shared.model.hf_adapter import PrefillState
from shared.model.prompt import PromptFormat
from shared.rpc.wire import PROTOCOL_VERSION
from shared.tasks import spawn

log = logging.getLogger("scd.producer")


def check_ids(request_id: str) -> None:
    if request_id and not usable_request_id(request_id):  # empty: the service makes one
        raise InvalidRequest(f"request_id must be 1-{MAX_ID_CHARS} printable ASCII characters (or empty: the service "
                             f"makes one); got {clip(request_id)}", param="request_id")


def check_sampling(sp) -> None:
    """Numbers the wire carries in fixed-width fields, then the rules every consumer applies
    (``Sampling``: temperature, top_p, stop), before the prefill; the consumer checks
    ``max_new_tokens`` against its own limit."""
    import math
    import struct

    if not 0 <= sp.max_new_tokens < 2**32:
        raise InvalidRequest(f"max_new_tokens={sp.max_new_tokens}; send 1 to the consumer's limit (0: its default)",
                             param="max_new_tokens")
    if sp.seed is not None and not 0 <= sp.seed < 2**64:
        raise InvalidRequest(f"seed={sp.seed}; send 0 to 2^64 - 1", param="seed")
    for name in ("temperature", "top_p"):
        if not math.isfinite(getattr(sp, name)):
            raise InvalidRequest(f"{name} must be a finite number", param=name)
    if 0 < sp.top_p < 1e-37 and struct.unpack("f", struct.pack("f", sp.top_p))[0] == 0:  # the wire's top_p is a float32
        raise InvalidRequest(f"top_p={sp.top_p:g} is 0 in the wire's 32-bit float, which means unset (1.0); send at "
                             "least 1e-38 (so small a nucleus keeps the most likely token alone)", param="top_p")
    try:  # the consumer's own rules (top_p 0 is the wire's "unset": 1)
        Sampling(temperature=sp.temperature, top_p=sp.top_p or 1.0, stop=tuple(sp.stop))
    except ValidationError as e:
        raise InvalidRequest(f"invalid sampling settings: {'; '.join(field_errors(e))}",
                             param=first_field(e)) from None


@contextlib.contextmanager
def _settings_param(req: GenerateRequest):
    """A method setting's error names where the request gave it: ``method_params.KEY``, else the
    ``method`` label that carries it (``scd:KEY=VALUE``)."""
    try:
        yield
    except InvalidRequest as e:
        if e.param is not None:  # the setting's name, or a path into it ("patch_layers.0"); a name may hold dots
            key = next((k for k in req.method_params if e.param == k or e.param.startswith(f"{k}.")), None)
            e.param = f"method_params.{key}" if key is not None else "method"
        raise


def _covers(state: PrefillState, hidden: set[int], residual: set[int]) -> bool:
    """Whether a prefill state captured these hidden and residual layers."""
    return hidden <= state.hidden.keys() and residual <= state.residual.keys()


@dataclass
class Prepared:
    """A validated request: its token ids, native prefix, method and consumer address."""

    request: GenerateRequest
    prompt_ids: list[int]
    prefix_len: int
    method: TransferMethod
    address: str
    auto: Choice | None = None
    """Set when the request asked for ``auto``: what it chose and why."""
    identity: str = ""
    """The method as requested (``TransferMethod.identity``), before a ``decides_after_prefill`` method
    settles: what ``scd eval`` measured under that name; the final timings carry it."""


@dataclass
class StreamStats:
    """What the producer measured while streaming one request (for the trailer and the timings)."""

    prefill_ms: float = 0.0
    encode_ms: float = 0.0
    prefill_shared: bool = False
    """The prefill state came from the cache or from a concurrent request of the same prompt."""
    resettled: bool = False
    """The method's ``settings_for`` changed its settings for this prompt (e.g. SCD's block guard)."""


@dataclass
class _Inflight:
    """A prefill running for one or more concurrent requests of the same prompt."""

    task: asyncio.Future
    stop: threading.Event
    """Set when the prefill is called off: the worker's pass ends before its next layer."""
    waiters: int = 0


def calibrate_how(kind: str) -> str:
    """The options of `scd calibrate --pair NAME` that make what ``kind`` needs (SCD's artifacts: none)."""
    return "" if kind in ("scd", "scd-reuse") else f" --method {kind}"


def calibrate_hint(consumer: str, *hows: str, artifacts: str | None = None) -> str:
    """What makes a consumer's missing artifacts or profiles (``hows``: each command's options), and how
    this producer then reads them (at start: it said only to set the folder, which a registered
    pair's producer finds itself). ``artifacts``: the folder the settings give, named as the place read."""
    runs = " and ".join(f"`scd calibrate --pair {consumer}{how}`" for how in dict.fromkeys(hows or ("",)))
    where = (f"it reads consumers.{consumer}.artifacts, {artifacts}, and the profiles beside it" if artifacts else
             f"it reads a registered pair's store; for another consumer set consumers.{consumer}.artifacts")
    return f"run {runs}, then restart the producer ({where}, when it starts)"


class ProducerEngine(Engine):
    """The base model's side of every request. Torch work runs on the engine's worker thread."""

    def __init__(self, settings: ProducerSettings, model, tokenizer=None):
        super().__init__(settings, model, tokenizer, "producer")
        self.settings: ProducerSettings = settings
        self.live_tasks: Gauge | None = None
        """The service's live-task gauge (its servicer sets it): running prefills are counted there."""
        if not settings.consumers:
            log.warning("no consumers configured: the producer is not ready (health NOT_SERVING, /health 503) and "
                        "refuses every request; give --consumer NAME=HOST:PORT or consumers.NAME.address")
        self.ctxs: dict[str, CodecContext] = {
            name: self.load_context(ep.artifacts, "producer", producer_fp=self.fingerprint)
            for name, ep in settings.consumers.items()}
        for name, ep in settings.consumers.items():  # given, so meant: a typo serves no calibrated method
            if ep.artifacts and not Path(ep.artifacts).is_dir() and not self.ctxs[name].profiles:
                log.warning("consumers.%s.artifacts: %s does not exist, nor any profile beside it (%s.<method>.json):"
                            " no calibrated method is served to %r (is it the pair's <store>/<pair>?)", name,
                            ep.artifacts, Path(ep.artifacts).name, name)
        self._prefills: OrderedDict[tuple, PrefillState] = OrderedDict()  # used on the worker thread only
        self.prefill_cache_nbytes = 0  # what the kept states hold (written on the worker thread only)
        self._inflight: dict[tuple, _Inflight] = {}  # prompt -> its prefill running now (event loop only)
        self.prefix_ids: list[int] = self.format.prefix_ids if self.format else []
        self.formats = {name: self._format(ep.tokenizer) for name, ep in settings.consumers.items()}
        self.links = LinkEstimator()  # per consumer: the link rate auto plans for
        self._servable: dict[tuple[str, str], bool] = {}  # (consumer, point label) -> auto may choose it
        self._served = {name: self._holds(name) for name in settings.consumers}  # the contexts are fixed
        self.stale: dict[str, dict[str, str]] = {}
        """Per consumer with an operating table: its points ``auto`` cannot serve as measured, with why."""
        for name in settings.consumers:
            self._check_table(name)
        self.capture = self._capture_union()
        """(hidden layers, residual layers) every prefill captures: what any method this producer
        offers, to any consumer, reads (``auto``: every point it may choose), so that a prompt asked
        with several methods, or fanned out to consumers served different ones, is prefilled once."""
        for name in settings.consumers:  # said at start: a request for them is refused until a recalibration
            short = [m for m in settings.methods if m not in self.servable(name)]
            if short:
                log.warning("consumer %r has no calibration for %s: requests for %s are refused; %s.%s", name,
                            ", ".join(short), "them" if len(short) > 1 else "it",
                            calibrate_hint(name, *map(calibrate_how, short),
                                           artifacts=settings.consumers[name].artifacts),
                            f" The default method {settings.default_method!r} is one of them: a request that names "
                            "no method is refused too" if settings.default_method in short else "")

    def _capture_union(self) -> tuple[frozenset[int], frozenset[int]]:
        hidden: set[int] = set()
        residual: set[int] = set()
        default_kind, default_params = resolve_variant(self.settings.default_method, {}, strict=False)
        for name in self.settings.consumers:
            ctx = self.ctxs[name]
            wanted = [(k, default_params if k == default_kind else {}) for k in self.servable(name) if k != "auto"]
            if "auto" in self.servable(name):
                wanted += [(p["method"], p["params"]) for p in ctx.profiles["auto"]["points"]
                           if p["method"] in self.settings.methods and self._usable(name, p)]
            for kind, params in wanted:
                try:
                    m = make_method(kind, ctx, params)
                except SCDError:  # refused per request with its reason; nothing to capture for it
                    continue
                hidden |= set(m.hidden_layers())
                residual |= set(m.residual_layers())
        if hidden or residual:
            log.info("every prefill captures the states the offered methods read: hidden %s, residual %s",
                     sorted(hidden) or "none", sorted(residual) or "none")
        return frozenset(hidden), frozenset(residual)

    def _check_table(self, consumer: str) -> None:
        """Said at start: how many points of the consumer's operating table ``auto`` can serve, and the
        stale ones by name with the command that remakes the table (a recalibration that forgot the
        table left ``auto`` on its worst points without a word)."""
        table = self.ctxs[consumer].profiles.get("auto")
        if table is None or "auto" not in self.settings.methods:
            return
        points = [p for p in table["points"] if p["method"] != "oracle" and p["method"] in self.settings.methods]
        stale = stale_points(table, self.ctxs[consumer], offered=self.settings.methods)
        self.stale[consumer] = stale
        for p in points:
            self._servable[(consumer, p["label"])] = p["label"] not in stale
        if stale:
            log.warning("consumer %r: %d of %d points of its operating table can be served; not: %s. auto chooses "
                        "among the others; %s, then restart the producer", consumer, len(points) - len(stale),
                        len(points), "; ".join(f"{k}: {v}" for k, v in stale.items()),
                        remake_hint(table.get("pair", consumer)))
        else:
            log.info("consumer %r: all %d points of its operating table can be served", consumer, len(points))

    def _format(self, tokenizer: str | None) -> PromptFormat | None:
        """How text prompts for one consumer become ids: its pair's tokenizer and chat template (the
        model that answers), else the producer's own."""
        if tokenizer is None:
            return self.format
        from shared.model.loading import load_tokenizer

        fmt = PromptFormat(load_tokenizer(tokenizer))
        if self.format is not None and fmt.tok.get_vocab() != self.format.tok.get_vocab():
            raise ConfigError(f"the tokenizer in {tokenizer} has another vocabulary than the producer's: the "
                              "consumer could not read the producer's token ids")
        return fmt

    def prompt_format(self, consumer: str) -> PromptFormat | None:
        return self.formats.get(consumer, self.format)

    # ------------------------------------------------------------------ requests
    def check_consumers(self, *names: str, param: str | None = None) -> None:
        """NotFound naming the consumers this producer does not know (``param``: the request field)."""
        if any(not n for n in names):  # proto3's unset string: a request that named no consumer
            raise InvalidRequest(f"the request names no consumer; set consumer (HTTP: model) to one of "
                                 f"{sorted(self.settings.consumers)}", param=param)
        unknown = [n for n in names if n not in self.settings.consumers]
        if len(names) == 1 and "," in names[0] and unknown:  # a fan-out is the HTTP API's (model: "a,b")
            raise InvalidRequest(f"consumer {clip(names[0])} names several consumers; a Generate call streams one "
                                 "consumer's answer: call Generate once per consumer (concurrent calls share the "
                                 "producer's prefill) or send model \"a,b\" to the OpenAI API", param=param)
        if unknown:
            said = clip(unknown[0]) if len(unknown) == 1 else f"{[clip(n) for n in unknown]}"
            raise NotFound(f"unknown consumer{'s' if len(unknown) > 1 else ''} {said}; this producer knows "
                           f"{sorted(self.settings.consumers)}", param=param)

    def prepare(self, req: GenerateRequest) -> Prepared:
        s = self.settings
        self.check_consumers(req.consumer, param="model")  # the field's name in an OpenAI body (gRPC: consumer)
        # a method with settings, KIND:KEY=VALUE;KEY=VALUE, as the CLI and the benchmarks write it; the
        # request's method_params win over default_method's settings
        kind, params = resolve_variant(req.method or s.default_method, dict(req.method_params), strict=bool(req.method))
        if kind not in s.methods:
            if kind in CODECS:  # a real method this producer was not set up to offer
                raise UnknownMethod(f"transfer method {kind!r} is not enabled on this producer (it offers "
                                    f"{list(s.methods)}); the operator adds it to the `methods` setting of the "
                                    "producer and of the consumer", param="method")
            raise UnknownMethod(f"unknown transfer method {clip(kind)}; this producer offers {list(s.methods)}",
                                param="method")
        check_ids(req.request_id)
        check_sampling(req.sampling)
        ctx = self.ctxs[req.consumer]
        with _settings_param(req):
            auto = AutoSettings.parse(params) if kind == "auto" else None
        if kind not in self.servable(req.consumer):
            self._refuse_uncalibrated(kind, req.consumer, defaulted=not req.method)
        fmt = self.prompt_format(req.consumer)
        if isinstance(req.prompt, str):
            if not req.prompt.strip():
                raise InvalidRequest("prompt text is empty; send a non-empty prompt", param="prompt")
            if len(req.prompt) > s.max_prompt_chars:
                raise InvalidRequest(f"prompt has {len(req.prompt)} characters; the limit is {s.max_prompt_chars}",
                                     param="prompt")
            if fmt is None:
                raise InvalidRequest("this producer has no tokenizer; send token_ids", param="prompt")
            ids, _ = fmt.encode(req.prompt)
        else:
            ids = list(req.prompt)
        if len(ids) == 1 and fmt is not None and fmt.doc_start_id is not None:
            ids = [fmt.doc_start_id, *ids]  # one token: it starts a document (the cache must hold one position)
        if not ids:
            raise InvalidRequest("prompt has no tokens; send text or at least one token id", param="prompt")
        if len(ids) < 2:
            raise InvalidRequest("prompt has 1 token and this producer's tokenizer has no document-start token to "
                                 "put before it; send at least 2 token ids", param="prompt")
        limit, why = self.prompt_limit()
        if len(ids) > limit:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; the limit is {limit} ({why})", param="prompt")
        vocab = self.adapter.config.vocab_size
        if max(ids) >= vocab or min(ids) < 0:
            bad = max(ids) if max(ids) >= vocab else min(ids)
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (0 to {vocab - 1})", param="prompt")
        pre = fmt.prefix_ids if fmt else []
        prefix = len(pre) if req.native_prefix and pre and ids[: len(pre)] == pre else 0
        choice = None
        if auto is not None:
            rate, source = self.links.estimate(req.consumer, auto.link_mbps or s.consumers[req.consumer].link_mbps)
            choice = choose(ctx.profiles["auto"], len(ids) - 1 - prefix, rate, source, auto,
                            usable=lambda p: self._usable(req.consumer, p), offered=s.methods)
            kind, params = choice.method, choice.params
        with _settings_param(req):
            method = make_method(kind, ctx, params)
        return Prepared(req, ids, prefix, method, s.consumers[req.consumer].address, choice,
                        method.identity(self.fingerprint))

    def servable(self, consumer: str) -> list[str]:
        """The offered methods whose artifacts or profile (``auto``: its operating table) this producer
        holds for ``consumer``."""
        return self._served[consumer]

    def _holds(self, consumer: str) -> list[str]:
        ctx = self.ctxs[consumer]

        def has(kind: str) -> bool:
            needs = requires(kind)
            return ("artifacts" not in needs or ctx.artifacts is not None) and ("profile" not in needs
                                                                               or kind in ctx.profiles)

        return [m for m in self.settings.methods if has(m)]

    def _refuse_uncalibrated(self, kind: str, consumer: str, defaulted: bool) -> None:
        what = "the operating table" if kind == "auto" else "calibration artifacts"
        how, given = calibrate_how(kind), self.settings.consumers[consumer].artifacts
        if defaulted:  # the request named no method: the client can name one the consumer is served
            raise PreconditionFailed(
                f"the request names no method and the producer's default, {kind!r}, needs {what} for consumer "
                f"{consumer!r}: name a method it is served ({', '.join(self.servable(consumer))}), or "
                + calibrate_hint(consumer, how, artifacts=given), param="method")
        raise PreconditionFailed(f"method {kind!r} needs {what} for consumer {consumer!r}: "
                                 + calibrate_hint(consumer, how, artifacts=given), param="method")

    def _usable(self, consumer: str, point: dict) -> bool:
        """Whether ``auto`` may choose this point for this consumer: its method can be made here and
        reads the artifacts it was measured with (checked once per point)."""
        key = (consumer, point["label"])
        if key not in self._servable:
            self._servable[key] = can_serve(point, self.ctxs[consumer])
        return self._servable[key]

    def header(self, p: Prepared, request_id: str, deadline_unix: float) -> StreamHeader:
        m = p.method
        return StreamHeader(
            request_id=request_id, method=m.kind, method_version=m.version, protocol_version=PROTOCOL_VERSION,
            pair_fingerprint=m.pair_fingerprint(self.fingerprint),
            n_layers=self.adapter.n_layers, n_tokens=len(p.prompt_ids) - 1, prompt_ids=tuple(p.prompt_ids),
            params=m.cfg.wire_params(), sampling=p.request.sampling, native_prefix=bool(p.prefix_len),
            prefix_len=p.prefix_len, consumer=p.request.consumer, deadline_unix=deadline_unix)

    # ------------------------------------------------------------------ torch work (worker thread)
    def prefill(self, p: Prepared, stop: Callable[[], bool] | None = None) -> tuple[PrefillState | None, bool]:
        """The base model's prefill of the prompt (all but its last token), keyed by the token ids
        alone: with ``prefill_cache_entries`` > 0 the most recent states are kept, and a state that
        lacks a layer the method captures is redone with both sets (so one state serves every
        consumer and method: the shared-prefill, specialized-decode pattern). Encoders only read it.
        Returns (state, whether it came from the cache)."""
        if not p.method.transfers_layers:
            return None, False
        key = tuple(p.prompt_ids[:-1])
        hidden, residual = set(p.method.hidden_layers()), set(p.method.residual_layers())
        hidden, residual = hidden | self.capture[0], residual | self.capture[1]  # (and a request's own settings')
        cache, size = self._prefills, self.settings.prefill_cache_entries
        old = cache.get(key)
        if old is not None and _covers(old, hidden, residual):
            cache.move_to_end(key)
            return old, True
        if old is not None:
            hidden, residual = hidden | old.hidden.keys(), residual | old.residual.keys()
        state = self.adapter.prefill(key, hidden_layers=sorted(hidden), residual_layers=sorted(residual),
                                     stop=stop)
        if old is not None:
            del cache[key]
            self.prefill_cache_nbytes -= old.nbytes
        if size and state.nbytes <= self.settings.prefill_cache_bytes:
            cache[key] = state
            self.prefill_cache_nbytes += state.nbytes
            while len(cache) > size or self.prefill_cache_nbytes > self.settings.prefill_cache_bytes:
                self.prefill_cache_nbytes -= cache.popitem(last=False)[1].nbytes
        return state, False

    def clear_prefill_cache(self) -> None:
        """Drop every kept prefill state (on the worker thread, or with no request running)."""
        self._prefills.clear()
        self.prefill_cache_nbytes = 0

    async def shared_prefill(self, p: Prepared) -> tuple[PrefillState | None, bool]:
        """``prefill``, once for concurrent requests of the same prompt: a request that arrives while
        the same prompt is being prefilled (another consumer of a fan-out, say) waits for that
        prefill instead of running its own, whatever ``prefill_cache_entries`` says. Returns (state,
        whether it was shared: cached or another request's)."""
        if not p.method.transfers_layers:
            return None, False
        key = tuple(p.prompt_ids[:-1])
        need = (set(p.method.hidden_layers()), set(p.method.residual_layers()))
        running = self._inflight.get(key)
        if running is not None:
            state, _ = await self._wait(key, running)
            if state is not None and _covers(state, *need):
                return state, True
        stop = threading.Event()
        entry = _Inflight(spawn(self.run(self.prefill, p, stop.is_set), self.live_tasks), stop)
        self._inflight[key] = entry
        entry.task.add_done_callback(lambda _: self._inflight.pop(key) if self._inflight.get(key) is entry else None)
        return await self._wait(key, entry)

    async def _wait(self, key: tuple, entry: _Inflight) -> tuple[PrefillState | None, bool]:
        """Wait for a prefill that other requests may be waiting for too. When the last of them goes
        (a consumer refused the request, the client left), the prefill is called off: the worker
        never starts it, or its result is dropped, rather than every refused request costing one."""
        entry.waiters += 1
        try:
            return await asyncio.shield(entry.task)
        except asyncio.CancelledError:
            if entry.waiters == 1 and not entry.task.done():
                if self._inflight.get(key) is entry:
                    del self._inflight[key]  # no later request may join a prefill being called off
                entry.stop.set()  # a pass that has started ends at its next layer
                entry.task.cancel()
            raise
        finally:
            entry.waiters -= 1

    @staticmethod
    def encode_layer(p: Prepared, state: PrefillState, layer: int) -> tuple[dict, float]:
        t0 = time.perf_counter()
        out = p.method.encode_layer(state, layer, p.prefix_len)
        return out, (time.perf_counter() - t0) * 1e3

    # ------------------------------------------------------------------ the stream
    def settle(self, p: Prepared, state: PrefillState) -> bool:
        """After the prefill, the method a ``decides_after_prefill`` method serves this prompt with
        (``p.method`` replaced); whether it changed."""
        params = p.method.settings_for(state, p.prefix_len)
        if params is None:
            return False
        p.method = make_method(p.method.kind, self.ctxs[p.request.consumer], params)
        log.debug("request %s: %s served with %s after the prefill", p.request.request_id, p.method.kind, params)
        return True

    async def layers(self, p: Prepared, stats: StreamStats, hold: bool = False
                     ) -> AsyncIterator[EncodedLayer | None]:
        """Prefill, then ``None`` (the method is settled for this prompt: a ``decides_after_prefill``
        method's header can go), then each layer as soon as it is encoded (so the wire carries layer
        l while l+1 encodes). ``hold`` (benchmarks only) encodes every layer before yielding any."""
        t = time.perf_counter()
        state, stats.prefill_shared = await self.shared_prefill(p)
        stats.prefill_ms = (time.perf_counter() - t) * 1e3
        if p.method.decides_after_prefill and state is not None:
            stats.resettled = await self.run(self.settle, p, state)
        yield None
        if not p.method.transfers_layers:
            return
        held = []
        for layer in range(self.adapter.n_layers):
            tensors, ms = await self.run(self.encode_layer, p, state, layer)
            stats.encode_ms += ms
            if hold:
                held.append(EncodedLayer(layer, tensors))
            else:
                yield EncodedLayer(layer, tensors)
        del state
        for item in held:
            yield item
