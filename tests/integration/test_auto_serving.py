"""``auto`` end to end on a tiny pair: the operating table measured by the real calibration step,
then served: the producer chooses per request, says why, counts it, and refuses what it cannot do."""

import grpc
import pytest
import torch
from ops_common import SEC, TOKEN
from ops_support import tiny_tokenizer

from consumer_service.engine import ConsumerEngine
from consumer_service.settings import ConsumerSettings
from producer_service.engine import ProducerEngine
from producer_service.settings import ProducerSettings
from shared.artifacts import store
from shared.codecs import CodecContext
from shared.model.fingerprint import weights_fingerprint
from shared.model.hf_adapter import ModelAdapter
from shared.model.prompt import PromptFormat
from shared.model.tiny import perturbed, tiny_model
from tools import client
from tools.data import Item
from tools.inprocess import InProcessServices

PROMPT = torch.randint(3, 256, (130,), generator=torch.Generator().manual_seed(8)).tolist()


@pytest.fixture(scope="module")
def pair_store(tmp_path_factory):
    """The tiny pair and a store holding its operating table, measured by ``operating_table``."""
    from tools.calibration.auto import operating_table

    base = tiny_model("llama", n_layers=4)
    cons = perturbed(base, 0.05)
    tok = tiny_tokenizer()
    g = torch.Generator().manual_seed(3)
    val = [Item(id=f"v{i}", kind="qa" if i % 2 else "lm", prefix_len=0,
                prompt_ids=torch.randint(3, 256, (128,), generator=g).tolist()) for i in range(4)]
    p, c = ModelAdapter(base), ModelAdapter(cons)
    table = operating_table(p, c, PromptFormat(tok), val, CodecContext(p), CodecContext(c),
                            candidates=("raw", "quant", "quant:bits=8", "scd"), progress=False)
    out = tmp_path_factory.mktemp("store")
    store.save_profile(out, "tiny", "auto", table, weights_fingerprint(base), weights_fingerprint(cons))
    return base, cons, tok, out, table


def test_the_table_holds_every_candidate_the_pair_can_serve_side_by_side(pair_store):
    *_, table = pair_store
    assert [p["label"] for p in table["points"]] == ["raw", "quant", "quant:bits=8"]
    assert "scd" in table["report"]["skipped"] and "artifacts" in table["report"]["skipped"]["scd"]
    pts = {p["label"]: p for p in table["points"]}
    assert set(pts["raw"]["kl_by_kind"]) == {"qa", "lm"} and table["raw_kl"] == pts["raw"]["kl"] > 0
    assert pts["quant"]["bytes_per_token"] < pts["quant:bits=8"]["bytes_per_token"] < pts["raw"]["bytes_per_token"]
    assert pts["quant"]["params"] == {} and pts["quant:bits=8"]["params"] == {"bits": "8"}
    assert all(p["encode_ms_per_token"] > 0 for p in table["points"] if p["method"] == "quant")


@pytest.fixture(scope="module")
def svc(pair_store):
    base, cons, tok, out, _ = pair_store

    def consumer(name):
        s = ConsumerSettings.load(model={"path": "unused"}, server={"port": 0}, name=name,
                                  methods=["oracle", "raw", "quant"], security=SEC)
        return ConsumerEngine(s, cons, tok)

    def make_producer(addresses):
        eps = {"tiny": {"address": addresses["tiny"], "artifacts": str(out / "tiny")},
               "bare": {"address": addresses["bare"]}}
        s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, consumers=eps, security=SEC,
                                  methods=["oracle", "raw", "quant", "auto"], default_method="raw")
        return ProducerEngine(s, base, tok)

    with InProcessServices([consumer("tiny"), consumer("bare")], make_producer) as s:
        yield s


def _gen(svc, consumer="tiny", **params):
    req = client.request(PROMPT, consumer, method="auto", max_new_tokens=3, native_prefix=False, method_params=params)
    return client.generate(svc.producer_address, req, timeout=60, token=TOKEN)


def test_auto_plans_for_the_link_and_says_what_it_chose_and_why(svc, pair_store):
    """The point served is the table's fastest within the bound for this prompt at the link rate
    asked for: on a crawling link the fewest bytes, on a very fast one the least measured compute."""
    from shared.auto import expected_ms

    *_, table = pair_store
    raw_kl = table["raw_kl"]
    bound = 0.5 * raw_kl if any(p["kl"] <= 0.5 * raw_kl for p in table["points"]) else raw_kl
    within = [p for p in table["points"] if p["kl"] <= bound]
    n = len(PROMPT) - 1  # no native prefix: every position crosses
    metrics = svc._servicer.metrics
    for rate, said in ((0.1, "0.1"), (1e6, "1000000")):  # a rate under 1 Mbit/s as given (it said "0 Mbit/s")
        want = min(within, key=lambda p: expected_ms(p, n, rate))["label"]
        before = metrics.value("auto_choices_total", consumer="tiny", choice=want)
        got = _gen(svc, link_mbps=str(rate))
        assert got.timings.auto_reason.startswith(want + ":"), (rate, got.timings.auto_reason)
        assert f" {said} Mbit/s (setting)" in got.timings.auto_reason and "bound" in got.timings.auto_reason
        assert got.timings.method == want.split(":")[0] and len(got.token_ids) == 3
        assert metrics.value("auto_choices_total", consumer="tiny", choice=want) == before + 1
    slow = min(within, key=lambda p: expected_ms(p, n, 0.1))
    assert slow["bytes_per_token"] == min(p["bytes_per_token"] for p in within)
    plain = client.generate(svc.producer_address, client.request(PROMPT, "tiny", method="raw", max_new_tokens=3,
                                                                 native_prefix=False), timeout=60, token=TOKEN)
    assert plain.timings.auto_reason == ""


def test_auto_without_a_table_or_with_bad_settings_is_refused_clearly(svc):
    with pytest.raises(grpc.RpcError) as e:
        _gen(svc, consumer="bare")
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "run `scd calibrate --pair bare --method auto`, then restart the producer" in e.value.details()
    for bad, word in (({"link_mbps": "fast"}, "link_mbps"), ({"budget": "0.5"}, "max_kl_vs_raw")):
        with pytest.raises(grpc.RpcError) as e:
            _gen(svc, **bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and word in e.value.details()
    assert _gen(svc, link_mbps="1000000").timings.auto_reason  # the service kept running


def test_the_producer_says_at_start_which_points_are_stale_and_counts_them(pair_store, tmp_path, caplog):
    """A table measured with other artifacts than the store now holds: the producer names each
    stale point at start with the command that remakes the table, never chooses it, and the metric
    counts it (it was silent: auto fell back to the best point left)."""
    from producer_service.servicer import ProducerServicer

    base, cons, tok, out, table = pair_store
    edited = {**table, "points": [{**p, "pin": "recalibrated"} if p["label"] == "quant" else p
                                  for p in table["points"]]}
    store.save_profile(tmp_path, "tiny", "auto", edited, weights_fingerprint(base), weights_fingerprint(cons))
    s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, security=SEC, default_method="raw",
                              consumers={"tiny": {"address": "127.0.0.1:1", "artifacts": str(tmp_path / "tiny")}},
                              methods=["oracle", "raw", "quant", "auto"])
    with caplog.at_level("WARNING", logger="scd.producer"):
        engine = ProducerEngine(s, base, tok)
    assert list(engine.stale["tiny"]) == ["quant"]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "2 of 3 points of its operating table can be served" in said and "quant: stale" in said
    assert "scd calibrate --pair tiny --method auto" in said
    assert ProducerServicer(engine).metrics.value("auto_stale_points", consumer="tiny") == 1
