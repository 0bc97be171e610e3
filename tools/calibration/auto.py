"""``scd calibrate --method auto``: the pair's operating table. Every available method and setting
of ``CANDIDATES`` runs on the validation prompts through the evaluation harness (the served
encode, frames and decode), side by side with the Oracle: validation KL (overall and per kind of
text), wire bytes, encode and reconstruct time per token. ``shared.auto`` chooses from it per
request; ``auto_runner`` does the same choice in ``scd eval``."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from shared.auto import DEFAULT_LINK_MBPS, AutoSettings, can_serve, choose
from shared.codecs import CodecContext, make_method, parse_variant
from shared.errors import SCDError
from shared.model.hf_adapter import ModelAdapter
from shared.model.prompt import PromptFormat
from tools.eval.harness import Context, MethodResult, codec_method, evaluate

log = logging.getLogger(__name__)

CANDIDATES = ("raw", "quant:bits=8", "quant", "spectrum", "spectrum:budget=0.35", "ridge", "ridge:budget=0.5",
              "ridge:budget=0.4", "ridge:budget=0.3", "ridge:budget=0.48;fp16_share=0",
              "ridge:budget=0.4;fp16_share=0", "ridge:k_bits=8;v_bits=8", "ridge:k_bits=8;v_bits=6",
              "ridge:k_bits=8;v_bits=4", "ridge:k_bits=6;v_bits=6", "droidspeak", "scd-reuse", "scd",
              "scd:block_tokens=0.5", "scd:block_tokens=0.35")
"""Methods and settings scored; those the pair lacks artifacts or a profile for are skipped."""


def operating_table(producer: ModelAdapter, consumer: ModelAdapter, fmt: PromptFormat, val_items: Sequence,
                    pctx: CodecContext, cctx: CodecContext, candidates: Sequence[str] = CANDIDATES,
                    progress: bool = True) -> dict:
    """The profile payload: ``points`` (one per candidate that could be made), ``raw_kl``, the
    consumer's own prefill per token, and the candidates skipped with why."""
    runners, skipped, pins = {"oracle": codec_method("oracle", pctx, cctx)}, {}, {}
    for label in candidates:
        kind, params = parse_variant(label)
        try:
            runners[label] = codec_method(kind, pctx, cctx, params)
            pins[label] = runners[label].calibration()
        except SCDError as e:
            skipped[label] = str(e)
            log.info("auto: %s skipped (%s)", label, e)
    if "raw" not in runners:
        raise ValueError("the operating table needs raw transfer among the candidates (its KL is the bound)")
    hidden = sorted({l for r in runners.values() for l in getattr(r, "hidden_layers", ())})
    residual = sorted({l for r in runners.values() for l in getattr(r, "residual_layers", ())})
    res = evaluate(producer, consumer, fmt, val_items, runners, native_prefix=True, hidden_layers=hidden,
                   residual_layers=residual, progress=progress, generate=False)["methods"]
    points = []
    for label in runners:
        if label == "oracle":
            continue
        kind, params = parse_variant(label)
        m = res[label]
        points.append({"label": label, "method": kind, "params": params, "pin": pins[label], "kl": m["kl"],
                       "kl_by_kind": m["kl_by_kind"], "bytes_per_token": m["bytes_per_token"],
                       "encode_ms_per_token": m["encode_ms_per_token"],
                       "reconstruct_ms_per_token": m["reconstruct_ms_per_token"]})
    return {"points": points, "raw_kl": res["raw"]["kl"],
            "prefill_ms_per_token": res["oracle"]["reconstruct_ms_per_token"],
            "report": {"n": len(val_items), "skipped": skipped,
                       "raw_kl_by_kind": res["raw"]["kl_by_kind"]}}


def auto_runner(table: dict, pctx: CodecContext, cctx: CodecContext, params: dict[str, str] | None = None):
    """``auto`` in the evaluation harness: per prompt, the point ``shared.auto.choose`` picks (link
    rate from ``link_mbps``, default ``DEFAULT_LINK_MBPS``), run as the services run it. The
    runner's ``choices`` counts what it chose."""
    settings = AutoSettings.parse(params)
    rate = settings.link_mbps or DEFAULT_LINK_MBPS
    source = "setting" if settings.link_mbps else "default"
    cache: dict[str, object] = {}
    servable: dict[str, bool] = {}

    def usable(p: dict) -> bool:
        if p["label"] not in servable:
            servable[p["label"]] = can_serve(p, pctx)
        return servable[p["label"]]

    def run(ctx: Context, consumer: ModelAdapter) -> MethodResult:
        n = ctx.producer.n_tokens - ctx.prefix_len
        c = choose(table, n, rate, source, settings, usable=usable)
        if c.label not in cache:
            cache[c.label] = codec_method(c.method, pctx, cctx, c.params)
        run.choices[c.label] += 1
        out = cache[c.label](ctx, consumer)
        out.served = c.label
        return out

    run.choices = Counter()
    # the producer prefill must capture what any point may need
    points = [p for p in table["points"] if usable(p)]
    makers = [make_method(p["method"], pctx, p["params"]) for p in points]
    run.hidden_layers = sorted({l for m in makers for l in m.hidden_layers()})
    run.residual_layers = sorted({l for m in makers for l in m.residual_layers()})
    return run
