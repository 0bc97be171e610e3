"""The real SmolLM2 pair: assets load with plain from_pretrained, caches transfer exactly between
identical models, and the strong consumer really drifts."""

import pytest

from shared.codecs import CodecContext
from shared.model.fingerprint import weights_fingerprint
from shared.model.hf_adapter import ModelAdapter
from shared.model.prompt import PromptFormat
from tools import data
from tools.assets.models import consumer_dir, load_model, producer_dir
from tools.eval.harness import evaluate, methods


@pytest.fixture(scope="module")
def producer(real_assets):
    return ModelAdapter(load_model(producer_dir()))


@pytest.fixture(scope="module")
def strong(real_assets):
    return ModelAdapter(load_model(consumer_dir("strong")))


def test_consumers_are_distinct_models(producer, strong):
    mild = load_model(consumer_dir("mild"))
    fps = {weights_fingerprint(producer.model), weights_fingerprint(strong.model), weights_fingerprint(mild)}
    assert len(fps) == 3


def test_producer_sanity(producer, tokenizer):
    ids = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    cache = producer.build_cache(*_kv(producer.prefill(ids[:-1])))
    out = tokenizer.decode(producer.greedy(cache, ids[-1], 3))
    assert "Paris" in out, out


def _kv(state):
    return state.keys, state.values


def test_raw_between_identical_models_is_exact(producer, tokenizer):
    items = data.load("qa", "test", 1)
    lossless = methods(("oracle", "raw"), CodecContext(producer), CodecContext(producer), {"raw": {"dtype": "float32"}})
    res = evaluate(producer, producer, PromptFormat(tokenizer), items, lossless, True,
                   max_new_tokens=8, progress=False)
    assert res["methods"]["raw"]["kl"] < 1e-6
    assert res["methods"]["raw"]["agree_f1"] == 1.0
    assert max(res["layers"]["v_rel_err"]) == 0.0


def test_strong_pair_drifts(producer, strong, tokenizer):
    items = data.load("qa", "test", 2)
    runners = methods(("oracle", "raw"), CodecContext(producer), CodecContext(strong))
    res = evaluate(producer, strong, PromptFormat(tokenizer), items, runners, False,
                   max_new_tokens=8, progress=False)
    assert res["methods"]["oracle"]["kl"] == 0.0
    assert res["methods"]["raw"]["kl"] > 0.02, res["methods"]["raw"]
    assert res["layers"]["v_rel_err"][-1] > res["layers"]["v_rel_err"][0]
