"""The two LoRA members added for the fleet (``code``, ``verse``): distinct real models of the same
producer, whose committed artifacts (made by the fast search) load against the prepared models and
serve SCD below raw transfer's KL on the first test prompts."""

import pytest

from shared.artifacts import store
from shared.codecs import CodecContext
from shared.codecs.scd import PairArtifacts
from shared.model.fingerprint import weights_fingerprint
from shared.model.hf_adapter import ModelAdapter
from shared.model.prompt import PromptFormat
from shared.paths import STORE_DIR
from tools import data
from tools.assets.models import PAIRS, consumer_dir, load_model, producer_dir
from tools.eval.harness import evaluate, methods


@pytest.fixture(scope="module")
def producer(real_assets):
    return ModelAdapter(load_model(producer_dir()))


def test_every_member_is_its_own_model(producer):
    fps = [weights_fingerprint(producer.model)] + [weights_fingerprint(load_model(consumer_dir(p))) for p in PAIRS]
    assert len(set(fps)) == len(PAIRS) + 1


@pytest.mark.parametrize("pair", ["code", "verse"])
def test_fast_searched_artifacts_serve_below_raw(producer, tokenizer, pair):
    consumer = ModelAdapter(load_model(consumer_dir(pair)))
    pfp, cfp = weights_fingerprint(producer.model), weights_fingerprint(consumer.model)
    folder = STORE_DIR / pair
    meta, pt = store.load(folder, "producer", pfp, cfp)  # checks the hashes and both fingerprints
    _, ct = store.load(folder, "consumer", pfp, cfp)
    assert meta.report["search"] == "fast" and meta.report["stage_seconds"]["total"] > 0
    pctx = CodecContext(producer, PairArtifacts(meta, pt, "producer"))
    cctx = CodecContext(consumer, PairArtifacts(meta, ct, "consumer"))
    items = data.load("qa", "test", 4)
    runners = methods(("oracle", "raw", "scd"), pctx, cctx)
    layers = list(range(producer.n_layers))
    res = evaluate(producer, consumer, PromptFormat(tokenizer), items, runners, True, layers, layers,
                   max_new_tokens=8, progress=False, generate=False)
    raw, scd = res["methods"]["raw"], res["methods"]["scd"]
    assert scd["kl"] < raw["kl"], (scd["kl"], raw["kl"])
    assert scd["bytes_per_token"] < 0.5 * raw["bytes_per_token"]
