"""A request that names no seed samples with a fresh one (OpenAI's behaviour: without a seed, two
samples differ); a seed that is given, 0 included, is kept end to end."""

from __future__ import annotations

from consumer_service.engine import ConsumerEngine
from consumer_service.settings import ConsumerSettings
from producer_service.openai_api import CompletionBody, to_request
from shared.domain import SamplingRequest
from shared.model.tiny import tiny_model
from shared.rpc import convert


def test_the_wire_tells_no_seed_from_seed_zero():
    for seed in (None, 0, 7, 2**64 - 1):
        assert convert.sampling_from_pb(convert.sampling_to_pb(SamplingRequest(seed=seed))).seed == seed
    assert to_request(CompletionBody(model="m", prompt="x", temperature=1.0), [1, 2]).sampling.seed is None
    assert to_request(CompletionBody(model="m", prompt="x", seed=0), [1, 2]).sampling.seed == 0


def test_the_consumer_draws_a_fresh_seed_only_when_none_is_given():
    s = ConsumerSettings.load(model={"path": "unused"}, name="c", methods=["raw"])
    eng = ConsumerEngine(s, tiny_model("llama", n_layers=2))
    try:
        drawn = {eng.sampling(SamplingRequest(temperature=1.0)).seed for _ in range(4)}
        assert len(drawn) == 4  # 63 random bits each
        assert eng.sampling(SamplingRequest(temperature=1.0, seed=0)).seed == 0
        assert eng.sampling(SamplingRequest(temperature=1.0, seed=5)).seed == 5
    finally:
        eng.close()
