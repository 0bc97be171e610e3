"""Requests are held to the model's context (its config's max_position_embeddings) whatever the
prompt-length settings say: RoPE models compute past it without an error, answering badly."""

from __future__ import annotations

import pytest

from consumer_service.engine import ConsumerEngine
from consumer_service.settings import ConsumerSettings
from producer_service.engine import ProducerEngine
from producer_service.settings import ProducerSettings
from shared.domain import GenerateRequest, SamplingRequest, StreamHeader
from shared.errors import ConfigError, InvalidRequest
from shared.model.tiny import tiny_model
from shared.rpc.wire import PROTOCOL_VERSION

CONTEXT = 24


@pytest.fixture(scope="module")
def model():
    m = tiny_model("llama", n_layers=2)
    m.config.max_position_embeddings = CONTEXT  # no weight depends on it
    return m


def header(n_prompt: int, max_new: int) -> StreamHeader:
    return StreamHeader(request_id="r", method="raw", method_version=1, protocol_version=PROTOCOL_VERSION,
                        pair_fingerprint="0" * 16 + ":raw", n_layers=2, n_tokens=n_prompt - 1,
                        prompt_ids=tuple(range(3, 3 + n_prompt)), params={},
                        sampling=SamplingRequest(max_new_tokens=max_new), native_prefix=False, prefix_len=0,
                        consumer="c", deadline_unix=0.0)


def test_the_consumer_refuses_a_prompt_and_answer_past_the_context(model):
    s = ConsumerSettings.load(model={"path": "unused"}, name="c", methods=["raw"], max_prompt_tokens=4096)
    eng = ConsumerEngine(s, model)
    try:
        assert eng.prompt_limit() == (CONTEXT, "the model's context")
        with pytest.raises(InvalidRequest, match=rf"takes 2 to {CONTEXT} \(the model's context\)"):
            eng.open(header(CONTEXT + 1, 1))
        with pytest.raises(InvalidRequest, match=r"ask for at most 4 new tokens"):
            eng.open(header(CONTEXT - 4, 5))
        eng.open(header(CONTEXT - 4, 4))  # fits exactly
    finally:
        eng.close()


def test_the_producer_refuses_a_prompt_past_the_context(model):
    s = ProducerSettings.load(model={"path": "unused"}, consumers={"c": {"address": "127.0.0.1:1"}},
                              default_method="raw")
    eng = ProducerEngine(s, model)
    try:
        with pytest.raises(InvalidRequest, match=rf"the limit is {CONTEXT} \(the model's context\)"):
            eng.prepare(GenerateRequest(prompt=tuple(range(3, 3 + CONTEXT + 1)), consumer="c", method="raw"))
        assert eng.prepare(GenerateRequest(prompt=tuple(range(3, 3 + CONTEXT)), consumer="c", method="raw"))
    finally:
        eng.close()
    s = ProducerSettings.load(model={"path": "unused"}, consumers={"c": {"address": "127.0.0.1:1"}},
                              default_method="raw", max_prompt_tokens=10)
    eng = ProducerEngine(s, model)
    try:
        with pytest.raises(InvalidRequest, match=r"the limit is 10 \(max_prompt_tokens\)"):
            eng.prepare(GenerateRequest(prompt=tuple(range(3, 14)), consumer="c", method="raw"))
    finally:
        eng.close()


def test_the_default_answer_length_follows_a_lower_limit():
    base = {"model": {"path": "unused"}}
    assert ConsumerSettings.load(**base, max_new_tokens=9).default_max_new_tokens == 9
    assert ConsumerSettings.load(overrides=["max_new_tokens=9"], **base).default_max_new_tokens == 9
    assert ConsumerSettings.load(**base).default_max_new_tokens == 64
    with pytest.raises(ConfigError, match=r"default_max_new_tokens \(20\) must be at most max_new_tokens \(9\)"):
        ConsumerSettings.load(overrides=["max_new_tokens=9", "default_max_new_tokens=20"], **base)


def test_both_services_take_one_rule_for_a_clients_request_id(model):
    """The producer's gRPC request and the consumer's stream header take what HTTP's X-Request-Id takes:
    1-128 printable ASCII characters (an id goes back in an HTTP header, which is ASCII), or none."""
    import dataclasses

    bad = ["é", "a\tb", "x" * 129, "\x00"]
    ps = ProducerSettings.load(model={"path": "unused"}, consumers={"c": {"address": "127.0.0.1:1"}},
                               default_method="raw")
    cs = ConsumerSettings.load(model={"path": "unused"}, name="c", methods=["raw"])
    prod, cons = ProducerEngine(ps, model), ConsumerEngine(cs, model)
    try:
        for rid in bad:
            with pytest.raises(InvalidRequest, match="request_id must be 1-128 printable ASCII characters") as e:
                prod.prepare(GenerateRequest(prompt=(3, 4, 5), consumer="c", method="raw", request_id=rid))
            assert e.value.param == "request_id"
            with pytest.raises(InvalidRequest, match="request_id must be 1-128 printable ASCII characters"):
                cons.open(dataclasses.replace(header(4, 1), request_id=rid))
        for rid in ("", "req-1 (retry 2)", "x" * 128):
            assert prod.prepare(GenerateRequest(prompt=(3, 4, 5), consumer="c", method="raw", request_id=rid))
            cons.open(dataclasses.replace(header(4, 1), request_id=rid))
    finally:
        prod.close()
        cons.close()
