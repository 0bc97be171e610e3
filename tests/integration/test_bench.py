"""The TTFT benchmark's service features (warm prefill cache, no_pipelining) in-process, and ``scd bench``
in its smallest form over real network namespaces with tiny models (no timings asserted)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from consumer_service.engine import ConsumerEngine
from consumer_service.settings import ConsumerSettings
from producer_service.engine import ProducerEngine
from producer_service.settings import ProducerSettings
from shared import client
from shared.model.tiny import perturbed, tiny_model
from shared.rpc.inprocess import InProcessServices

PROMPT = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(9)).tolist()


@pytest.fixture(scope="module")
def services():
    base = tiny_model("llama", n_layers=4)
    cs = ConsumerSettings.load(model={"path": "unused"}, server={"port": 0}, name="c", methods=["oracle", "raw"])
    consumer = ConsumerEngine(cs, perturbed(base, 0.2))

    def make_producer(addresses):
        s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, default_method="raw",
                                  methods=["oracle", "raw"], prefill_cache_entries=2,
                                  consumers={n: {"address": a} for n, a in addresses.items()})
        return ProducerEngine(s, base)

    with InProcessServices([consumer], make_producer) as svc:
        yield svc


def _gen(svc, prompt=PROMPT, no_pipelining=False, **kw):
    req = client.request(prompt, "c", kw.pop("method", "raw"), max_new_tokens=kw.pop("n", 6), **kw)
    req.no_pipelining = no_pipelining
    return client.generate(svc.producer_address, req, timeout=60)


def test_prefill_cache_serves_a_repeated_prompt_identically(services):
    eng = services.producer_engine
    eng._prefills.clear()
    first = _gen(services)
    assert len(eng._prefills) == 1
    again = _gen(services)
    assert again.token_ids == first.token_ids
    assert again.timings.wire_bytes == first.timings.wire_bytes
    assert len(eng._prefills) == 1  # a hit, not a second entry
    others = [PROMPT[:-i] for i in (1, 2, 3)]
    for p in others:
        _gen(services, prompt=p, n=1)
    assert len(eng._prefills) == 2  # bounded: least recently used evicted
    assert (tuple(PROMPT[:-1]), (), ()) not in eng._prefills


def test_prefill_cache_off_by_default():
    assert ProducerSettings.load(model={"path": "unused"}).prefill_cache_entries == 0


def test_no_pipelining_gives_the_same_tokens_and_bytes(services):
    piped = _gen(services, method_params={"dtype": "float32"})
    held = _gen(services, method_params={"dtype": "float32"}, no_pipelining=True)
    assert held.token_ids == piped.token_ids
    assert held.timings.payload_bytes == piped.timings.payload_bytes > 0
    assert 0 < held.timings.wire_bytes - piped.timings.wire_bytes <= 8  # only the header's flag differs
    oracle = _gen(services, method="oracle", no_pipelining=True)
    assert len(oracle.token_ids) == 6 and oracle.timings.payload_bytes == 0
