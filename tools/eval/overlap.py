"""Benchmark: how much of the consumer's reconstruction hides behind the transfer.

Both services run in-process on loopback. For each request the consumer reports when the first
and the last frame arrived, its reconstruction time, and when it produced the first token. If
reconstruction overlaps the transfer, the tail (last frame → first token) is only the last
layer's work plus one decode step, however long the stream."""

from __future__ import annotations

import json
import statistics
import time

from tools import client


def _prompt(tok, n_tokens: int) -> list[int]:
    from shared.model.prompt import PromptFormat
    from tools import data

    fmt = PromptFormat(tok)
    items = data.load("lm", "test", fmt=fmt) + data.load("qa", "test", fmt=fmt)
    ids = [t for it in items for t in it.prompt_ids]
    return ids[:n_tokens]


def run(pair: str = "strong", n_tokens: int = 1000, methods=("raw",), iters: int = 3, tiny: bool = False) -> dict:
    import torch

    from consumer_service.engine import ConsumerEngine
    from consumer_service.settings import ConsumerSettings
    from producer_service.engine import ProducerEngine
    from producer_service.settings import ProducerSettings
    from tools.inprocess import InProcessServices

    if tiny:
        from shared.model.tiny import perturbed, tiny_model

        base = tiny_model("llama")
        cons, tok = perturbed(base, 0.1), None
        prompt = torch.randint(0, 256, (n_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    else:
        from shared.model.loading import load_model, load_tokenizer
        from tools.assets import registry

        e = registry.get(pair)
        folder, adapter = e.consumer_model()
        base, cons, tok = load_model(e.producer), load_model(folder, adapter=adapter), load_tokenizer(e.tokenizer)
        prompt = _prompt(tok, n_tokens)
        store_dir = e.store_dir()
    from shared.codecs import CODECS

    if tiny:
        from shared.paths import STORE_DIR as store_dir
    cross = any(CODECS[m].cross_model for m in methods)
    store = {"artifact_store": str(store_dir)} if cross else {}
    cs = ConsumerSettings.load(model={"path": "-"}, name=pair, server={"port": 0}, methods=list(methods), **store)
    consumer = ConsumerEngine(cs, cons, tok)

    def make_producer(addrs):
        ps = ProducerSettings.load(model={"path": "-"}, server={"port": 0}, methods=list(methods),
                                   default_method=methods[0],
                                   consumers={n: {"address": a, **({"artifacts": str(store_dir / n)} if cross else {})}
                                              for n, a in addrs.items()})
        return ProducerEngine(ps, base, tok)

    rows = {}
    with InProcessServices([consumer], make_producer) as svc:
        for m in methods:
            client.generate(svc.producer_address, client.request(prompt, pair, m, max_new_tokens=1))  # warm-up
            runs = []
            for _ in range(iters):
                r = client.generate(svc.producer_address, client.request(prompt, pair, m, max_new_tokens=1))
                t = r.timings
                runs.append(dict(transfer_ms=t.transfer_ms, reconstruct_ms=t.reconstruct_ms,
                                 tail_ms=t.last_frame_to_first_token_ms,
                                 first_frame_to_token_ms=t.transfer_ms + t.last_frame_to_first_token_ms,
                                 ttft_ms=t.ttft_ms, wire_bytes=t.wire_bytes))
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            med["tail_share"] = med["tail_ms"] / med["first_frame_to_token_ms"]
            rec = med["reconstruct_ms"]
            med["hidden_reconstruct_share"] = max(0.0, 1 - med["tail_ms"] / rec) if rec else 0.0
            rows[m] = med
    print(f"overlap benchmark: pair={pair} prompt={len(prompt)} tokens, median of {iters} (after warm-up)")
    print(f"{'method':<8}{'transfer ms':>13}{'reconstr. ms':>14}{'tail ms':>10}{'1st frame→tok':>15}{'tail share':>12}")
    for m, r in rows.items():
        print(f"{m:<8}{r['transfer_ms']:>13.1f}{r['reconstruct_ms']:>14.1f}{r['tail_ms']:>10.1f}"
              f"{r['first_frame_to_token_ms']:>15.1f}{r['tail_share']:>12.2f}")
    out = {"pair": pair, "prompt_tokens": len(prompt), "iters": iters, "methods": rows, "time": time.time()}
    print(json.dumps(out))
    return out
