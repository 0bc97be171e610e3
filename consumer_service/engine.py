"""Consumer engine: validates a stream's header, reconstructs each layer as it arrives, decodes.

Torch work runs on one worker thread (``run``), which keeps the event loop free and device use
serial."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from consumer_service.settings import ConsumerSettings
from shared.codecs import CODECS, CodecContext, DecodeJob, DecodeSession, check_enabled, make_method
from shared.errors import (
    ConfigError,
    FingerprintMismatch,
    InvalidPayload,
    InvalidRequest,
    PreconditionFailed,
    UnknownMethod,
)
from shared.generation import Generator, Sampling
from shared.model.fingerprint import weights_fingerprint
from shared.model.hf_adapter import ModelAdapter
from shared.model.prompt import PromptFormat
from shared.rpc import scd_pb2 as pb
from shared.rpc.wire import PROTOCOL_VERSION
from shared.worker import TorchWorker

log = logging.getLogger(__name__)


@dataclass
class Request:
    """One in-flight transfer on the consumer."""

    header: pb.Header
    session: DecodeSession
    sampling: Sampling
    t_first_frame: float = field(default_factory=time.perf_counter)
    reconstruct_ms: float = 0.0
    fallback: str = ""  # why the consumer recomputes the prefill itself ("" = it uses the transfer)


class ConsumerEngine(TorchWorker):
    """Runs on one torch worker thread (``run``)."""

    def __init__(self, settings: ConsumerSettings, model, tokenizer=None):
        check_enabled(settings.methods)
        self.settings = settings
        self.adapter = ModelAdapter(model)
        self.tokenizer = tokenizer
        self.fingerprint = weights_fingerprint(model)
        self.ctx = CodecContext(self.adapter)
        self.producer_fingerprint = settings.producer_fingerprint
        if any("artifacts" in CODECS[m].requires for m in settings.methods):
            self._load_artifacts()
        for m in settings.methods:
            if "profile" in CODECS[m].requires:
                self._load_profile(m)
        TorchWorker.__init__(self, f"consumer-{settings.name}")
        self.format = PromptFormat(tokenizer) if tokenizer is not None else None
        self.stop_ids = frozenset(self.format.stop_ids if self.format else ())
        self.prefix_ids: list[int] = []
        self.prefix_keys: tuple[torch.Tensor, ...] = ()
        self.prefix_values: tuple[torch.Tensor, ...] = ()
        if self.format is not None and self.format.prefix_ids:
            self._prepare_native_prefix()

    def _load_artifacts(self) -> None:
        """The pair's consumer-side artifacts; they also pin the producer this consumer accepts."""
        from pathlib import Path

        from shared.artifacts import store
        from shared.codecs.scd import PairArtifacts

        s = self.settings
        cross = [m for m in s.methods if "artifacts" in CODECS[m].requires]
        if not s.artifact_store:
            raise ConfigError(f"methods {cross} need calibration artifacts: set artifact_store (or drop them from "
                              "methods)")
        meta, tensors = store.load(Path(s.artifact_store) / s.name, "consumer", s.producer_fingerprint,
                                   self.fingerprint)
        self.ctx.artifacts = PairArtifacts(meta, tensors, "consumer")
        self.producer_fingerprint = self.producer_fingerprint or meta.producer_fingerprint

    def _load_profile(self, kind: str) -> None:
        from shared.artifacts import store

        if not self.settings.artifact_store:
            raise ConfigError(f"method {kind!r} needs its profile from the artifact store: set artifact_store")
        self.ctx.profiles[kind] = store.load_profile(self.settings.artifact_store, self.settings.name, kind,
                                                     self.settings.producer_fingerprint, self.fingerprint)

    def _prepare_native_prefix(self) -> None:
        """The consumer's own K/V for the fixed chat-template prefix, computed once."""
        self.prefix_ids = list(self.format.prefix_ids)
        state = self.adapter.prefill(self.prefix_ids)
        self.prefix_keys, self.prefix_values = state.keys, state.values

    # ------------------------------------------------------------------ header
    def incompatibility(self, h: pb.Header) -> tuple[str, str] | None:
        """(reason, actionable message) when the stream does not match what this consumer loaded."""
        s = self.settings
        if h.protocol_version != PROTOCOL_VERSION:
            side = "producer" if h.protocol_version < PROTOCOL_VERSION else "consumer"
            return "protocol", (f"protocol version {h.protocol_version} from the producer; this consumer speaks "
                                f"{PROTOCOL_VERSION}: update the {side}")
        cls = CODECS[h.method]
        if h.method_version != cls.version:
            side = "producer" if h.method_version < cls.version else "consumer"
            return "method_version", (f"method {h.method!r} version {h.method_version} from the producer; this "
                                      f"consumer has version {cls.version}: update the {side}")
        producer_fp = h.pair_fingerprint.split(":")[0]
        if self.producer_fingerprint and producer_fp != self.producer_fingerprint:
            return "fingerprint", (
                f"stream made by producer weights {producer_fp!r}; consumer {s.name!r} accepts "
                f"{self.producer_fingerprint!r}: point the producer at the right model or recalibrate the pair "
                "and update the consumer's artifacts")
        if h.n_layers != self.adapter.n_layers:
            return "layers", (f"stream has {h.n_layers} layers; the consumer model has {self.adapter.n_layers}: the "
                              "producer is serving another model family; fix the producer's consumers setting")
        return None

    def open(self, h: pb.Header) -> Request:
        s = self.settings
        if h.consumer and h.consumer != s.name:
            raise InvalidRequest(f"stream addressed to consumer {h.consumer!r}; this is {s.name!r}")
        if h.method not in s.methods:
            raise UnknownMethod(f"method {h.method!r} is not enabled on consumer {s.name!r}; enabled: {list(s.methods)}")
        bad = self.incompatibility(h)
        if bad is not None and s.fallback != "recompute":
            raise (FingerprintMismatch if bad[0] == "fingerprint" else PreconditionFailed)(bad[1])
        n_prompt = len(h.prompt_ids)
        if not 2 <= n_prompt <= s.max_prompt_tokens:
            raise InvalidRequest(f"prompt has {n_prompt} tokens; this consumer takes 2 to {s.max_prompt_tokens}")
        vocab = self.adapter.config.vocab_size
        if max(h.prompt_ids) >= vocab:
            raise InvalidRequest(f"prompt token id {max(h.prompt_ids)} is outside the vocabulary (size {vocab})")
        if h.n_tokens != n_prompt - 1:
            raise InvalidPayload(f"header n_tokens={h.n_tokens}; expected prompt length - 1 = {n_prompt - 1}")
        sampling = self.sampling(h.sampling)
        if bad is not None:  # fallback: prefill the prompt with our own model, ignore the frames
            log.warning("request %s: %s; recomputing the prefill (fallback=recompute)", h.request_id, bad[1])
            from shared.codecs.oracle import Oracle

            job = DecodeJob(prompt_ids=list(h.prompt_ids), n_tokens=n_prompt - 1, start=0)
            return Request(h, Oracle(Oracle.Config(), self.ctx).start(job), sampling, fallback=bad[0])
        start = 0
        if h.native_prefix and h.prefix_len:
            p = h.prefix_len
            if p > len(self.prefix_ids) or list(h.prompt_ids[:p]) != self.prefix_ids[:p] or p >= n_prompt:
                raise InvalidRequest("native_prefix is set but the prompt does not start with this consumer's "
                                     "chat-template prefix; send native_prefix=false")
            start = p
        method = make_method(h.method, self.ctx, dict(h.params))
        job = DecodeJob(
            prompt_ids=list(h.prompt_ids), n_tokens=h.n_tokens, start=start,
            prefix_keys=tuple(k[:, :, :start] for k in self.prefix_keys) if start else (),
            prefix_values=tuple(v[:, :, :start] for v in self.prefix_values) if start else (),
            params=dict(h.params),
        )
        return Request(h, method.start(job), sampling)

    def cache_estimate(self, req: Request) -> int:
        """Bytes the request's cache will hold at its longest: (prompt + max_new_tokens) positions."""
        a = self.adapter
        per_token = a.n_layers * 2 * a.n_kv_heads * a.head_dim * torch.empty((), dtype=a.dtype).element_size()
        return (len(req.header.prompt_ids) + req.sampling.max_new_tokens) * per_token

    def sampling(self, sp: pb.SamplingParams) -> Sampling:
        s = self.settings
        n = sp.max_new_tokens or s.default_max_new_tokens
        if n > s.max_new_tokens:
            raise InvalidRequest(f"max_new_tokens={n}; this consumer allows at most {s.max_new_tokens}")
        try:
            return Sampling(max_new_tokens=n, temperature=sp.temperature, top_p=sp.top_p or 1.0,
                            stop=tuple(sp.stop), seed=sp.seed)
        except ValueError as e:
            raise InvalidRequest(f"invalid sampling settings: {e}".replace("\n", "; ")) from None

    # ------------------------------------------------------------------ decode
    def add_layer(self, req: Request, layer: int, tensors) -> None:
        t0 = time.perf_counter()
        req.session.add_layer(layer, tensors)
        req.reconstruct_ms += (time.perf_counter() - t0) * 1e3

    def generator(self, req: Request) -> Generator:
        t0 = time.perf_counter()
        cache = req.session.finish()
        req.reconstruct_ms += (time.perf_counter() - t0) * 1e3
        return Generator(self.adapter, cache, int(req.header.prompt_ids[-1]), req.sampling, self.tokenizer,
                         self.stop_ids)
