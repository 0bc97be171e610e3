"""A prefill that nobody waits for any more stops at its next layer (issue 58: a producer busy with a
cancelled prefill kept two torch threads running for minutes after SIGTERM)."""

import asyncio
import threading

import pytest

from producer_service.engine import ProducerEngine
from producer_service.settings import ProducerSettings
from shared.domain import GenerateRequest
from shared.model.hf_adapter import ModelAdapter, PrefillCalledOff
from shared.model.tiny import tiny_model

N_LAYERS = 8


def _layers_run(ad):
    ran = []
    for i, layer in enumerate(ad.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: ran.append(i))
    return ran


def test_stop_ends_the_pass_before_the_next_layer():
    ad = ModelAdapter(tiny_model("llama", n_layers=N_LAYERS))
    ran = _layers_run(ad)
    with pytest.raises(PrefillCalledOff):
        ad.prefill(list(range(3, 40)), stop=lambda: len(ran) >= 3)
    assert ran == [0, 1, 2]
    ran.clear()
    state = ad.prefill(list(range(3, 40)), stop=lambda: False)  # a stop that never says so changes nothing
    assert ran == list(range(N_LAYERS)) and len(state.keys) == N_LAYERS
    ran.clear()
    ad.prefill(list(range(3, 40)))  # and the hooks went with the pass
    assert ran == list(range(N_LAYERS))


def test_a_producer_prefill_called_off_stops_at_its_next_layer():
    model = tiny_model("llama", n_layers=N_LAYERS)
    s = ProducerSettings.load(model={"path": "-"}, server={"port": 0}, default_method="raw",
                              consumers={"c": {"address": "127.0.0.1:1"}})
    eng = ProducerEngine(s, model)
    ran, entered, release = _layers_run(eng.adapter), threading.Event(), threading.Event()

    def slow(_mod, _args):  # layer 1 waits until the request has gone
        if len(ran) == 2:
            entered.set()
            release.wait(30)

    eng.adapter.layers[1].register_forward_pre_hook(slow)
    real, ended = eng.prefill, threading.Event()

    def prefill(*a, **k):
        try:
            return real(*a, **k)
        finally:
            ended.set()

    eng.prefill = prefill

    async def go():
        p = eng.prepare(GenerateRequest(prompt=tuple(range(3, 40)), consumer="c", method="raw"))
        waiter = asyncio.ensure_future(eng.shared_prefill(p))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
        waiter.cancel()  # the only request waiting for it goes
        with pytest.raises(asyncio.CancelledError):
            await waiter
        release.set()
        await asyncio.get_running_loop().run_in_executor(None, ended.wait, 30)

    asyncio.run(go())
    assert ended.is_set() and ran == [0, 1], f"layers run after the prefill was called off: {ran}"
