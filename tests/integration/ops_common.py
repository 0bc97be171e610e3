"""What the operations and fault tests share: the services under test (a producer and one consumer
per policy: chat template, long answers, a pinned producer, the recompute fallback, a small
admission budget, a short frame lease), the token and the helpers."""

from __future__ import annotations

import torch

from consumer_service.engine import ConsumerEngine
from consumer_service.settings import ConsumerSettings
from producer_service.engine import ProducerEngine
from producer_service.settings import ProducerSettings
from shared.model.hf_adapter import ModelAdapter
from shared.model.tiny import perturbed
from shared.rpc import scd_pb2 as pb
from shared.rpc.wire import PROTOCOL_VERSION, StreamTotals, layer_frames
from tools import client
from tools.inprocess import InProcessServices

TOKEN = "t0ken-for-tests"
MD = (("authorization", f"Bearer {TOKEN}"),)
PROMPT = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
LOAD_NEW = 4
PER_TOKEN = 4 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x fp32
LOAD_BUDGET = 8 * (len(PROMPT) + LOAD_NEW) * PER_TOKEN  # room for exactly 8 load requests
SEC = {"token": TOKEN}


def consumer(name, model, tokenizer=None, **kw):
    s = ConsumerSettings.load(model={"path": "unused"}, server={"port": 0}, name=name, methods=["oracle", "raw"],
                              security=SEC, **kw)
    return ConsumerEngine(s, model, tokenizer)


def ops_services(base, tok):
    """The producer and the consumers the operations tests share (one per policy under test)."""
    consumers = [
        consumer("chat", base, tok),
        consumer("same", base, max_new_tokens=4000),
        consumer("picky", base, producer_fingerprint="0000000000000000"),
        consumer("picky-recompute", perturbed(base, 0.3), producer_fingerprint="0000000000000000",
                  fallback="recompute"),
        consumer("small", base, max_concurrent=32, max_queue=4, cache_budget_bytes=LOAD_BUDGET),
        consumer("lease", base, frame_timeout_s=1.5, http={"port": 0}),
        consumer("trickle", base, min_progress_bytes_per_s=200_000, progress_grace_s=0.5),
        consumer("short", base, max_prompt_tokens=8),
    ]

    def make_producer(addresses):
        s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, default_method="raw",
                                  consumers={n: {"address": a} for n, a in addresses.items()}, http={"port": 0},
                                  security=SEC)
        return ProducerEngine(s, base, tok)

    return InProcessServices(consumers, make_producer)


def cons(svc, name):
    return svc.consumer_servers[name].servicer


def idle(svc, name):
    a = cons(svc, name).admission
    return a.active == 0 and a.held == 0 and a.queued == 0


def gen(svc, timeout=60, **kw):
    prompt = kw.pop("prompt", PROMPT)
    return client.generate(svc.producer_address, client.request(prompt, **kw), timeout=timeout, token=TOKEN)


def http(svc) -> str:
    return f"http://127.0.0.1:{svc.producer_server.http.port}"


def local_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def make_frames(svc, consumer, max_new=2, **header):
    """A valid raw stream of PROMPT for ``consumer``; ``header`` overrides header fields."""
    from shared.codecs import CodecContext, make_method

    ad = ModelAdapter(svc._consumers[0].adapter.model)
    m = make_method("raw", CodecContext(ad))
    state = ad.prefill(PROMPT[:-1])
    totals = StreamTotals()
    h = dict(request_id="x", method="raw", method_version=1, protocol_version=PROTOCOL_VERSION,
             pair_fingerprint="f:raw",
             n_layers=ad.n_layers, n_tokens=len(PROMPT) - 1, prompt_ids=PROMPT, consumer=consumer,
             sampling=pb.SamplingParams(max_new_tokens=max_new))
    h.update(header)
    out = [totals.add(pb.KVFrame(header=pb.Header(**h)))]
    for layer in range(ad.n_layers):
        out += [totals.add(f) for f in layer_frames(layer, m.encode_layer(state, layer, 0))]
    out.append(totals.trailer())
    return out
