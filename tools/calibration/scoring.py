"""Scoring a transfer method on the validation set exactly as it is served.

Calibration, profiling and ablations all ask one question: how close to the Oracle is the consumer
when a given method, with given artifacts, carries the prompt? ``Scorer`` answers it with the
registered method itself: the producer side's ``encode_layer`` on each validation prompt's prefill,
the consumer side's decode session (native prefix, RoPE, the cache), then the teacher-forced KL of
the Oracle's answer. Candidate artifacts are built as they are saved (fp16 tensors), so what
calibration selects is what the services run.

Two parts of a configuration are expensive and shared by many configurations: SCD's REUSE layers
(the same maps in every candidate) and a recomputed block (the same block in every candidate that
has it). ``ScoredSCD`` and ``ScoredDroidSpeak`` are the served methods with those two hooks
memoized per validation prompt (``KVMemo``, on disk); the memoized values are computed by the
same served code, so memoizing changes nothing but the time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from shared.artifacts.meta import ArtifactMeta
from shared.codecs import CodecContext, DecodeJob, TransferMethod, make_method
from shared.codecs.aligner import Aligner
from shared.codecs.scd import SCD, PairArtifacts, SCDSession
from shared.codecs.selective_recompute import DroidSpeak, DroidSpeakSession
from shared.model.hf_adapter import ModelAdapter
from shared.rpc.wire import layer_frames
from tools.calibration.memory import release_memory
from tools.calibration.selection import ValPrompt
from tools.calibration.spill import KVMemo
from tools.eval.metrics import kl_top1


class _MemoBlocks:
    """A block session whose recomputed blocks come from the method's memo (per prompt, by block)."""

    def run_block(self, h, block):
        method, (a, b) = self.method, block
        memo: KVMemo | None = getattr(method, "memo", None)
        if memo is None:
            return super().run_block(h, block)

        def compute():
            first = super(_MemoBlocks, self).run_block(h, block)
            return {a: first, **self._block_kv}  # the block's other layers (and its exit layer, if any)

        tag = f"block-{a}-{b}" + ("-exit" if b in getattr(method, "exit_layers", ()) else "")
        kv = memo.get(tag, method.scope, compute, keep=block in method.keep_blocks)
        self._block_kv.update({l: x for l, x in kv.items() if l != a})
        return kv[a]


class _ScoredSCDSession(_MemoBlocks, SCDSession):
    pass


class _ScoredDroidSpeakSession(_MemoBlocks, DroidSpeakSession):
    pass


class ScoredSCD(SCD):
    """The served SCD, with its REUSE layers and its PATCH block memoized per validation prompt.
    ``reuse`` is the memo of the REUSE decode of every layer (a plain SCD of the same maps computes
    it), or None to decode REUSE layers afresh (e.g. for other ranks)."""

    Session = _ScoredSCDSession

    def __init__(self, cfg, ctx, memo: KVMemo | None = None, reuse: Callable[[int], Mapping] | None = None,
                 keep_blocks=()):
        super().__init__(cfg, ctx)
        self.memo, self.reuse, self.keep_blocks, self.scope = memo, reuse, set(keep_blocks), 0

    def _memoized(self, layer: int) -> bool:
        return (self.reuse is not None and self.block_at(layer) is None and layer not in self.patch
                and layer not in self.exit_layers and layer not in self.fallback)

    def encode_layer(self, state, layer, start):
        if self._memoized(layer):
            return {}  # the consumer side takes this REUSE layer from the memo
        return super().encode_layer(state, layer, start)

    def schema(self, layer, job):
        return {} if self._memoized(layer) else super().schema(layer, job)

    def _reuse(self, layer, tensors):
        if not self._memoized(layer):
            return super()._reuse(layer, tensors)
        return self.reuse(self.scope)[layer]


class ScoredDroidSpeak(DroidSpeak):
    """The served DroidSpeak with its recomputed blocks memoized per validation prompt."""

    Session = _ScoredDroidSpeakSession

    def __init__(self, cfg, ctx, memo: KVMemo | None = None, keep_blocks=()):
        super().__init__(cfg, ctx)
        self.memo, self.keep_blocks, self.scope = memo, set(keep_blocks), 0


class Scorer:
    """Teacher-forced quality of a transfer method on the validation prompts ``vps``."""

    def __init__(self, producer: ModelAdapter, consumer: ModelAdapter, vps: list[ValPrompt],
                 kinds: Sequence[str] = ()):
        self.producer, self.consumer, self.vps = producer, consumer, vps
        self.kinds = list(kinds) or ["all"] * len(vps)
        """The kind of text of each validation prompt (e.g. ``qa``, ``lm``): ``kl`` also keeps the
        mean per kind of its last call (``last_by_kind``), for bounds that must hold on each."""
        if len(self.kinds) != len(vps):
            raise ValueError(f"{len(self.kinds)} kinds for {len(vps)} validation prompts")
        self.last_by_kind: dict[str, float] = {}

    def cache(self, enc: TransferMethod, dec: TransferMethod, i: int):
        """The consumer's cache for prompt i when ``enc``/``dec`` carry it (positions [0, n-1))."""
        vp = self.vps[i]
        for m in (enc, dec):
            if hasattr(m, "scope"):
                m.scope = i
        n = len(vp.ids) - 1
        job = DecodeJob(prompt_ids=list(vp.ids), n_tokens=n, start=vp.start,
                        prefix_keys=tuple(k for k, _ in vp.prefix_kv) if vp.start else (),
                        prefix_values=tuple(v for _, v in vp.prefix_kv) if vp.start else ())
        session = dec.start(job)
        if enc.transfers_layers:
            for layer in range(self.consumer.n_layers):
                session.add_layer(layer, enc.encode_layer(vp.state, layer, vp.start))
        return session.finish()

    def logprobs(self, enc: TransferMethod, dec: TransferMethod, i: int) -> torch.Tensor:
        vp = self.vps[i]
        return self.consumer.score(self.cache(enc, dec, i), vp.ids[-1], vp.target)[: len(vp.target)]

    def kl(self, enc: TransferMethod, dec: TransferMethod) -> float:
        """Mean KL(Oracle || method) over the validation prompts, nats per token."""
        kls = []
        for i, vp in enumerate(self.vps):
            kls.append(float(kl_top1(vp.oracle_lp, self.logprobs(enc, dec, i))[0].mean()))
            release_memory()  # each prompt's cache is freed here; keep its pages from piling up
        self.last_by_kind = {k: sum(x for x, kk in zip(kls, self.kinds) if kk == k) / self.kinds.count(k)
                             for k in dict.fromkeys(self.kinds)}
        return sum(kls) / len(kls)

    def pair(self, kind: str, params: dict[str, Any] | None = None, producer_ctx: CodecContext | None = None,
             consumer_ctx: CodecContext | None = None) -> tuple[TransferMethod, TransferMethod]:
        """A registered method's producer and consumer sides for this pair."""
        pctx = producer_ctx or CodecContext(self.producer)
        cctx = consumer_ctx or CodecContext(self.consumer)
        return make_method(kind, pctx, params), make_method(kind, cctx, params)

    def bytes_per_token(self, enc: TransferMethod, layer: int, i: int = 0) -> float:
        """Wire bytes per transferred token of one layer, counted from its real frames (lz4 included)."""
        vp = self.vps[i]
        tensors = enc.encode_layer(vp.state, layer, vp.start)
        return sum(len(f.chunk.data) for f in layer_frames(layer, tensors)) / max(1, len(vp.ids) - 1 - vp.start)


# ------------------------------------------------------------------------------ SCD candidates
def reuse_tensors(maps: list[tuple], code: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(producer, consumer) artifact tensors of REUSE maps, in fp16 as saved: per layer the encoder
    and producer mean, the decoder and consumer mean, of the joint [K|V] code or the K and V codes."""
    names = ("kv",) if code == "joint" else ("k", "v")
    prod, cons = {}, {}
    for l, layer_maps in enumerate(maps):
        for kv, mp in zip(names, layer_maps):
            prod[f"enc.{kv}.{l}"], prod[f"mu_p.{kv}.{l}"] = mp.enc.half(), mp.mu_p.half()
            cons[f"dec.{kv}.{l}"], cons[f"mu_c.{kv}.{l}"] = mp.dec.half(), mp.mu_c.half()
    return prod, cons


def patch_tensors(pcas: dict[int, tuple], aligners: dict[int, Aligner]) -> tuple[dict, dict]:
    """(producer, consumer) tensors of PATCH layers: the PCA projection and mean, the aligner."""
    prod, cons = {}, {}
    for l, aligner in aligners.items():
        wh, mu_h, _ = pcas[l]
        prod[f"wh.{l}"], prod[f"mu_h.{l}"] = wh.half(), mu_h.half()
        for k, v in aligner.state_dict().items():
            cons[f"align.{l}.{k}"] = v.half()
    return prod, cons


def linear_aligner(sol: torch.Tensor) -> Aligner:
    """An aligner that is only the least-squares linear map ``[u, 1] @ sol`` (no MLP correction)."""
    r, d = sol.shape[0] - 1, sol.shape[1]
    a = Aligner(r, d, 1)
    with torch.no_grad():
        a.linear.weight.copy_(sol[:-1].T)
        a.linear.bias.copy_(sol[-1])
        a.up.weight.zero_()
        a.up.bias.zero_()
    return a.eval()


def scd_sides(scorer: Scorer, meta: ArtifactMeta, prod: dict, cons: dict, memo: KVMemo | None = None,
              reuse: Callable[[int], Mapping] | None = None, keep_blocks=(),
              block_tokens: float = 1.0) -> tuple[ScoredSCD, ScoredSCD]:
    """The producer and consumer sides of SCD with candidate artifacts (``meta`` says which layers
    are patched and which block is recomputed)."""
    cfg = SCD.Config(block_tokens=block_tokens)
    p = ScoredSCD(cfg, CodecContext(scorer.producer, PairArtifacts(meta, prod, "producer")), memo, reuse, keep_blocks)
    c = ScoredSCD(cfg, CodecContext(scorer.consumer, PairArtifacts(meta, cons, "consumer")), memo, reuse, keep_blocks)
    return p, c


def droidspeak_sides(scorer: Scorer, blocks: list[tuple[int, int]], memo: KVMemo | None = None,
                     keep_blocks=()) -> tuple[ScoredDroidSpeak, ScoredDroidSpeak]:
    cfg = DroidSpeak.Config(blocks=[list(b) for b in blocks])
    return (ScoredDroidSpeak(cfg, CodecContext(scorer.producer), memo, keep_blocks),
            ScoredDroidSpeak(cfg, CodecContext(scorer.consumer), memo, keep_blocks))
