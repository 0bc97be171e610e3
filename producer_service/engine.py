"""Producer engine: tokenizes, prefills the base model, encodes each layer for the wire."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from producer_service.settings import ProducerSettings
from shared.codecs import CODECS, CodecContext, TransferMethod, check_enabled, make_method
from shared.errors import ConfigError, InvalidRequest, NotFound, PreconditionFailed, UnknownMethod
from shared.model.fingerprint import weights_fingerprint
from shared.model.hf_adapter import ModelAdapter, PrefillState
from shared.model.prompt import PromptFormat
from shared.rpc import scd_pb2 as pb
from shared.rpc.wire import PROTOCOL_VERSION
from shared.worker import TorchWorker


@dataclass
class Prepared:
    prompt_ids: list[int]
    prefix_len: int
    method: TransferMethod
    address: str


class ProducerEngine(TorchWorker):
    """Runs on one torch worker thread (``run``)."""

    def __init__(self, settings: ProducerSettings, model, tokenizer=None):
        check_enabled(settings.methods)
        self.settings = settings
        self.adapter = ModelAdapter(model)
        self.tokenizer = tokenizer
        self.fingerprint = weights_fingerprint(model)
        self.ctxs = {name: self._context(name, ep.artifacts) for name, ep in settings.consumers.items()}
        TorchWorker.__init__(self, "producer")
        self._prefills: OrderedDict[tuple, PrefillState] = OrderedDict()  # used on the worker thread only
        self.format = PromptFormat(tokenizer) if tokenizer is not None else None
        self.prefix_ids: list[int] = self.format.prefix_ids if self.format else []
        self.formats = {name: self._format(ep.tokenizer) for name, ep in settings.consumers.items()}

    def _format(self, tokenizer: str | None) -> PromptFormat | None:
        """How text prompts for one consumer become ids: its pair's tokenizer and chat template (the
        model that answers), else the producer's own."""
        if tokenizer is None:
            return self.format
        from shared.model.loading import load_tokenizer

        fmt = PromptFormat(load_tokenizer(tokenizer))
        if fmt.tok.get_vocab() != (self.format.tok.get_vocab() if self.format else fmt.tok.get_vocab()):
            raise ConfigError(f"the tokenizer in {tokenizer} has another vocabulary than the producer's: the "
                              "consumer could not read the producer's token ids")
        return fmt

    def prompt_format(self, consumer: str) -> PromptFormat | None:
        return self.formats.get(consumer, self.format)

    def _context(self, consumer: str, artifacts: str | None) -> CodecContext:
        """The codec context for one consumer: the pair's SCD artifacts and baseline profiles found in
        its artifacts folder (``<store>/<pair>``) and beside it (``<store>/<pair>.<kind>.json``)."""
        if not artifacts:
            return CodecContext(self.adapter)
        from pathlib import Path

        from shared.artifacts import store
        from shared.codecs.scd import PairArtifacts

        ctx = CodecContext(self.adapter)
        folder = Path(artifacts)
        if (folder / "meta.json").exists():
            meta, tensors = store.load(folder, "producer", producer_fingerprint=self.fingerprint)
            ctx.artifacts = PairArtifacts(meta, tensors, "producer")
        for kind in (k for k, cls in CODECS.items() if "profile" in cls.requires):
            if (folder.parent / f"{folder.name}.{kind}.json").exists():
                ctx.profiles[kind] = store.load_profile(folder.parent, folder.name, kind, self.fingerprint)
        return ctx

    def prepare(self, req: pb.GenerateRequest) -> Prepared:
        s = self.settings
        if req.consumer not in s.consumers:
            raise NotFound(f"unknown consumer {req.consumer!r}; this producer knows {sorted(s.consumers)}")
        kind = req.method or s.default_method
        if kind not in s.methods:
            raise UnknownMethod(f"unknown transfer method {kind!r}; this producer offers {list(s.methods)}")
        ctx = self.ctxs[req.consumer]
        req_ = CODECS[kind].requires
        if ("artifacts" in req_ and ctx.artifacts is None) or ("profile" in req_ and kind not in ctx.profiles):
            how = f"--method {kind}" if "profile" in req_ else ""
            raise PreconditionFailed(f"method {kind!r} needs calibration artifacts for consumer {req.consumer!r}: run "
                                     f"`scd calibrate --pair {req.consumer} {how}`".rstrip() +
                                     f" and set consumers.{req.consumer}.artifacts")
        method = make_method(kind, ctx, dict(req.method_params))
        which = req.WhichOneof("prompt")
        if which == "text":
            if not req.text.strip():
                raise InvalidRequest("prompt text is empty; send a non-empty prompt")
            if len(req.text) > s.max_prompt_chars:
                raise InvalidRequest(f"prompt has {len(req.text)} characters; the limit is {s.max_prompt_chars}")
            fmt = self.prompt_format(req.consumer)
            if fmt is None:
                raise InvalidRequest("this producer has no tokenizer; send token_ids")
            ids, _ = fmt.encode(req.text)
        elif which == "token_ids":
            ids = list(req.token_ids.ids)
        else:
            raise InvalidRequest("no prompt: set text or token_ids")
        if len(ids) < 2:
            raise InvalidRequest(f"prompt has {len(ids)} token(s); at least 2 are needed")
        if len(ids) > s.max_prompt_tokens:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; the limit is {s.max_prompt_tokens}")
        vocab = self.adapter.config.vocab_size
        if max(ids) >= vocab:
            raise InvalidRequest(f"token id {max(ids)} is outside the vocabulary (size {vocab})")
        prefix = 0
        fmt = self.prompt_format(req.consumer)
        pre = fmt.prefix_ids if fmt else []
        if req.native_prefix and pre and ids[: len(pre)] == pre:
            prefix = len(pre)
        return Prepared(ids, prefix, method, s.consumers[req.consumer].address)

    def header(self, p: Prepared, req: pb.GenerateRequest, request_id: str, deadline: float, t0: float) -> pb.Header:
        return pb.Header(
            request_id=request_id, method=p.method.kind, method_version=p.method.version,
            protocol_version=PROTOCOL_VERSION,
            pair_fingerprint=f"{self.fingerprint}:{p.method.kind}.v{p.method.version}:{p.method.cfg.fingerprint()}",
            n_layers=self.adapter.n_layers, n_tokens=len(p.prompt_ids) - 1, dtype=getattr(p.method.cfg, "dtype", ""),
            prompt_ids=p.prompt_ids, params={k: str(v) for k, v in p.method.cfg.model_dump(exclude={"kind"}).items()},
            sampling=req.sampling, native_prefix=bool(p.prefix_len), prefix_len=p.prefix_len, consumer=req.consumer,
            deadline_unix=deadline, t_request_unix=t0, no_pipelining=req.no_pipelining,
        )

    def prefill(self, p: Prepared) -> PrefillState:
        """The base model's prefill of the prompt (all but its last token). With
        ``prefill_cache_entries`` > 0 the most recent states are kept, keyed by the token ids and the
        layers the method captures: a prompt prefilled once is served again without a prefill (the
        shared-prefill, specialized-decode pattern). Encoders only read the state."""
        if not p.method.transfers_layers:
            return None
        hidden, residual = tuple(p.method.hidden_layers()), tuple(p.method.residual_layers())
        key = (tuple(p.prompt_ids[:-1]), hidden, residual)
        cache, size = self._prefills, self.settings.prefill_cache_entries
        if size and key in cache:
            cache.move_to_end(key)
            return cache[key]
        state = self.adapter.prefill(p.prompt_ids[:-1], hidden_layers=hidden, residual_layers=residual)
        if size:
            cache[key] = state
            while len(cache) > size:
                cache.popitem(last=False)
        return state

    @staticmethod
    def encode_layer(p: Prepared, state: PrefillState, layer: int):
        t0 = time.perf_counter()
        out = p.method.encode_layer(state, layer, p.prefix_len)
        return out, (time.perf_counter() - t0) * 1e3
