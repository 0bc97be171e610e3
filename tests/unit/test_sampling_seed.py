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


def test_a_tiny_temperature_samples_the_most_likely_token_and_never_fails():
    import torch

    from shared.generation import Sampling, sample

    logits = torch.tensor([1.0, 3.0, 2.0, -50.0])
    for t in (1e-45, 1e-40, 5e-38, 1e-30, 1e-6):  # logits / t overflowed to inf, softmax to NaN
        s = Sampling(temperature=t, seed=1)
        assert sample(logits, s, torch.Generator().manual_seed(1)) == 1
        assert sample(logits, s.model_copy(update={"top_p": 0.5}), torch.Generator().manual_seed(1)) == 1


def test_a_top_p_the_wire_would_carry_as_unset_is_refused():
    import pytest

    from producer_service.engine import check_sampling
    from shared.errors import InvalidRequest

    for p in (1e-300, 1e-46):  # a float32 0 is the wire's "unset": the whole distribution, not the narrowest
        with pytest.raises(InvalidRequest, match="top_p") as e:
            check_sampling(SamplingRequest(temperature=1.0, top_p=p))
        assert e.value.param == "top_p"
    for p in (1e-44, 1e-38, 0.5, 1.0, 0.0):  # carried as given (0: unset)
        check_sampling(SamplingRequest(temperature=1.0, top_p=p))
        assert convert.sampling_to_pb(SamplingRequest(top_p=p)).top_p > 0 or p == 0
    with pytest.raises(InvalidRequest, match="top_p"):
        check_sampling(SamplingRequest(top_p=1e300))  # too large for a float32: the range check, not a crash
