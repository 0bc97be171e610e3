"""The side-by-side evaluation harness: every method judged on the consumer, against the Oracle,
on the same prompts, with the producer prefill and the Oracle computed once per prompt. Every
method, the Oracle and raw transfer included, runs as the services run it (``codec_method``): the
registered method's encode, the wire's frames (bytes counted from them), its decode session."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from shared.model.hf_adapter import ModelAdapter, PrefillState, clone_cache
from shared.model.prompt import PromptFormat
from tools.data import Item
from tools.eval.metrics import kl_top1, rel_err, token_f1

MAX_NEW_TOKENS = 32


@dataclass
class Context:
    """What a method sees for one prompt."""

    item: Item
    producer: PrefillState  # producer prefill over prompt[:-1]
    consumer: PrefillState  # consumer's own prefill (the Oracle's K/V), pre-RoPE
    prefix_len: int  # leading tokens whose K/V the consumer holds natively (0 = native prefix off)


@dataclass
class MethodResult:
    cache: object  # DynamicCache on the consumer
    bytes: int = 0
    encode_ms: float = 0.0
    reconstruct_ms: float = 0.0
    resettled: bool = False  # the method changed its settings for this prompt after the prefill
    served: str = ""  # what ``auto`` chose for this prompt (a point's label)


Method = Callable[[Context, ModelAdapter], MethodResult]


def methods(kinds, producer_ctx, consumer_ctx, params: dict[str, dict] | None = None) -> dict[str, Method]:
    """Runners for registered method kinds (name -> runner), each with its settings from ``params``."""
    return {k: codec_method(k, producer_ctx, consumer_ctx, (params or {}).get(k)) for k in kinds}


@dataclass
class Acc:
    kl: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    agree_f1: list[float] = field(default_factory=list)
    task_f1: list[float] = field(default_factory=list)
    nll: float = 0.0
    nll_tokens: int = 0
    bytes_per_token: list[float] = field(default_factory=list)
    encode_ms: list[float] = field(default_factory=list)
    reconstruct_ms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    resettled: int = 0

    def summary(self, oracle_ppl: float | None) -> dict:
        ppl = math.exp(self.nll / self.nll_tokens) if self.nll_tokens else None  # nothing to score it on: unknown
        n_tok = max(1, sum(self.tokens))
        out = {
            "n": len(self.kl),
            "kl": statistics.fmean(self.kl),
            "kl_by_kind": {k: statistics.fmean(x for x, kk in zip(self.kl, self.kinds) if kk == k)
                           for k in dict.fromkeys(self.kinds)},
            "kl_by_length": {b: statistics.fmean(x for x, n in zip(self.kl, self.lengths) if length_bucket(n) == b)
                             for b in sorted(dict.fromkeys(map(length_bucket, self.lengths)), key=_bucket_order)},
            "top1": statistics.fmean(self.top1),
            "agree_f1": statistics.fmean(self.agree_f1) if self.agree_f1 else None,
            "task_f1": statistics.fmean(self.task_f1) if self.task_f1 else None,
            "ppl": ppl,
            "delta_ppl_pct": 100 * (ppl / oracle_ppl - 1) if oracle_ppl and ppl else None,  # unknown without either
            "bytes_per_token": statistics.fmean(self.bytes_per_token),
            "encode_ms": statistics.fmean(self.encode_ms),
            "reconstruct_ms": statistics.fmean(self.reconstruct_ms),
            "encode_ms_per_token": sum(self.encode_ms) / n_tok,
            "reconstruct_ms_per_token": sum(self.reconstruct_ms) / n_tok,
            "resettled": self.resettled,
        }
        return out


LENGTH_EDGES = (512, 1024, 2048, 4096, 8192)
"""Prompt lengths (tokens) that bound the buckets ``kl_by_length`` reports."""


def length_bucket(n_tokens: int) -> str:
    """The bucket of a prompt of ``n_tokens``: "<=512", "513-1024", ..., ">8192"."""
    lo = 0
    for edge in LENGTH_EDGES:
        if n_tokens <= edge:
            return f"<={edge}" if lo == 0 else f"{lo + 1}-{edge}"
        lo = edge
    return f">{lo}"


def _bucket_order(label: str) -> int:
    digits = label.lstrip("<=>").split("-")[0]
    return int(digits) + (label.startswith(">"))


def evaluate(
    producer: ModelAdapter,
    consumer: ModelAdapter,
    fmt: PromptFormat,
    items: Sequence[Item],
    methods: dict[str, Method],
    native_prefix: bool,
    hidden_layers: Sequence[int] = (),
    residual_layers: Sequence[int] = (),
    max_new_tokens: int = MAX_NEW_TOKENS,
    progress: bool = True,
    generate: bool = True,
) -> dict:
    """Run every method on every item; returns {"methods": {name: metrics}, "layers": {...}}. ``fmt`` is
    the pair's prompt format: its stop ids end answers, its tokenizer decodes them. ``generate``:
    also decode each method's greedy answer (agreement and task F1); without it only the
    teacher-forced measures are taken."""
    stop, tok = fmt.stop_ids, fmt.tok
    accs = {name: Acc() for name in methods}
    rows = []
    k_err = [0.0] * consumer.n_layers
    v_err = [0.0] * consumer.n_layers
    for item in tqdm(items, desc="eval", disable=not progress):
        ctx_ids, last = item.prompt_ids[:-1], item.prompt_ids[-1]
        p_state = producer.prefill(ctx_ids, hidden_layers=hidden_layers, residual_layers=residual_layers)
        c_state = consumer.prefill(ctx_ids)
        for layer in range(consumer.n_layers):
            k_err[layer] += rel_err(p_state.keys[layer], c_state.keys[layer]) / len(items)
            v_err[layer] += rel_err(p_state.values[layer], c_state.values[layer]) / len(items)
        ctx = Context(item, p_state, c_state, item.prefix_len if native_prefix else 0)
        gold = fmt.answer_ids(item.answer) if item.answer else []
        reference = list(item.continuation_ids)

        o_cache = consumer.build_cache(c_state.keys, c_state.values)  # the reference: the consumer's own prefill
        o_toks = consumer.greedy(clone_cache(o_cache, consumer.config), last, max_new_tokens, stop)
        tf = reference or o_toks  # teacher-forced target: held-out continuation, else the Oracle's greedy
        o_lp = consumer.score(clone_cache(o_cache, consumer.config), last, tf)[: len(tf)]
        o_text = tok.decode(o_toks, skip_special_tokens=True)
        row: dict = {"id": item.id, "kind": item.kind, "tokens": len(item.prompt_ids), "meta": dict(item.meta),
                     "methods": {}}
        rows.append(row)
        for name, method in methods.items():
            r = method(ctx, consumer)
            lp = consumer.score(clone_cache(r.cache, consumer.config), last, tf)[: len(tf)]
            kl, top1 = kl_top1(o_lp, lp)
            acc = accs[name]
            acc.kl.append(float(kl.mean()))
            acc.top1.append(float(top1.mean()))
            acc.tokens.append(len(ctx_ids) - ctx.prefix_len)
            acc.kinds.append(str(item.meta.get("kind") or item.kind))  # a data file's own kind column, if any
            acc.lengths.append(len(item.prompt_ids))
            cell = row["methods"][name] = {"kl": acc.kl[-1], "top1": acc.top1[-1],
                                           "bytes_per_token": r.bytes / len(ctx_ids), "resettled": r.resettled,
                                           **({"served": r.served} if r.served else {})}
            if generate:
                toks = o_toks if name == "oracle" else consumer.greedy(clone_cache(r.cache), last, max_new_tokens, stop)
                text = tok.decode(toks, skip_special_tokens=True)
                acc.agree_f1.append(token_f1(text, o_text))
                cell["agree_f1"] = acc.agree_f1[-1]
                if item.answer:
                    acc.task_f1.append(token_f1(text, item.answer))
                    cell["task_f1"] = acc.task_f1[-1]
            target = gold or reference
            if target:
                glp = consumer.score(clone_cache(r.cache, consumer.config), last, target)[: len(target)]
                acc.nll -= float(glp.gather(1, torch.tensor(target).unsqueeze(1)).sum())
                acc.nll_tokens += len(target)
            acc.bytes_per_token.append(r.bytes / len(ctx_ids))
            acc.encode_ms.append(r.encode_ms)
            acc.reconstruct_ms.append(r.reconstruct_ms)
            acc.resettled += r.resettled
    oracle_ppl = accs["oracle"].summary(None)["ppl"] if "oracle" in accs else None
    depth = list(range(consumer.n_layers))
    summaries = {name: acc.summary(oracle_ppl) for name, acc in accs.items()}
    raw16 = consumer.n_layers * 2 * consumer.kv_dim * 2  # raw fp16 K/V bytes per token
    prefill_ms = summaries["oracle"]["reconstruct_ms"] if "oracle" in summaries else None  # its own prefill
    for m in summaries.values():
        m["bytes_vs_raw_fp16"] = m["bytes_per_token"] / raw16
        m["reconstruct_vs_prefill"] = m["reconstruct_ms"] / prefill_ms if prefill_ms else None
    return {
        "methods": summaries,
        "rows": rows,
        "layers": {"k_rel_err": k_err, "v_rel_err": v_err,
                   "k_growth_per_layer": _slope(depth, k_err), "v_growth_per_layer": _slope(depth, v_err)},
    }


def _slope(x: Sequence[float], y: Sequence[float]) -> float:
    mx, my = statistics.fmean(x), statistics.fmean(y)
    den = sum((a - mx) ** 2 for a in x)
    return sum((a - mx) * (b - my) for a, b in zip(x, y)) / den if den else 0.0


def codec_method(kind: str, producer_ctx, consumer_ctx, params: dict[str, str] | None = None) -> Method:
    """A registered transfer method run exactly as the services run it: producer-side encode of each
    layer, the wire's chunking and lz4 (bytes counted from the real frames), consumer-side decode."""
    from shared.codecs import DecodeJob, make_method
    from shared.rpc.wire import layer_frames

    served = make_method(kind, producer_ctx, params), make_method(kind, consumer_ctx, params)
    variants: dict[tuple, tuple] = {}

    def run(ctx: Context, consumer: ModelAdapter) -> MethodResult:
        n = ctx.producer.n_tokens
        start = ctx.prefix_len
        job = DecodeJob(prompt_ids=list(ctx.item.prompt_ids), n_tokens=n, start=start,
                        prefix_keys=tuple(k[:, :, :start] for k in ctx.consumer.keys),
                        prefix_values=tuple(v[:, :, :start] for v in ctx.consumer.values))
        enc, dec = served
        t0 = time.perf_counter()
        settled = enc.settings_for(ctx.producer, start) if enc.decides_after_prefill else None
        nbytes, enc_ms, rec_ms = 4 * len(ctx.item.prompt_ids), (time.perf_counter() - t0) * 1e3, 0.0
        if settled is not None:  # as the producer serves it: both sides made anew with these settings
            key = tuple(sorted(settled.items()))
            if key not in variants:
                variants[key] = make_method(kind, producer_ctx, settled), make_method(kind, consumer_ctx, settled)
            enc, dec = variants[key]
        session = dec.start(job)
        if enc.transfers_layers:
            state = ctx.producer
            if not (set(enc.hidden_layers()) <= set(state.hidden)
                    and set(enc.residual_layers()) <= set(state.residual)):
                raise ValueError(f"{kind} needs hidden/residual states of layers {enc.hidden_layers()} / "
                                 f"{enc.residual_layers()}; pass them to evaluate()")
            for layer in range(consumer.n_layers):
                t0 = time.perf_counter()
                tensors = enc.encode_layer(state, layer, start)
                enc_ms += (time.perf_counter() - t0) * 1e3
                frames = layer_frames(layer, tensors)
                nbytes += sum(len(f.chunk.data) for f in frames)
                t0 = time.perf_counter()
                session.add_layer(layer, {k: v.cpu() for k, v in tensors.items()})
                rec_ms += (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        cache = session.finish()
        rec_ms += (time.perf_counter() - t0) * 1e3
        return MethodResult(cache, bytes=nbytes, encode_ms=enc_ms, reconstruct_ms=rec_ms, resettled=settled is not None)

    enc = served[0]
    run.hidden_layers, run.residual_layers, run.pin = enc.hidden_layers(), enc.residual_layers(), enc.pin
    run.calibration = enc.calibration  # what the producer side reads of the store (an operating point's pin)
    run.identity = enc.identity  # of the method as requested (a prompt's settled variant is served under it)
    return run
