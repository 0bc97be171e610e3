"""The fast search for a new consumer of an already-calibrated producer: the producer cache holds
exactly what the producer computes, the consumer's traces from it equal the full search's, and the
artifacts it writes are served like any other."""

import json
from types import SimpleNamespace

import pytest
import torch

from shared.artifacts import store
from shared.codecs import CodecContext
from shared.codecs.scd import PairArtifacts


def _prompts(seed: int):
    g = torch.Generator().manual_seed(seed)
    cal = [torch.randint(0, 256, (48,), generator=g).tolist() for _ in range(8)]
    val = [(torch.randint(0, 256, (40,), generator=g).tolist(), 0) for _ in range(4)]
    return cal, val


def _cfg(**kw):
    from tools.calibration.settings import CalibrationSettings

    return CalibrationSettings(**{"pair": "tiny", "r_kv": 40, "r_h": 32, "fast_prompts": 6, "fast_val": 4,
                                  "fast_screen": 2, "fast_stride": 1, "block_layers": 2, **kw})


def test_producer_cache_holds_the_producers_states_and_misses_on_other_prompts(tiny_pair, tmp_path):
    from tools.calibration.fast import producer_cache

    producer, _ = tiny_pair
    cal, val = _prompts(21)
    cache = producer_cache(producer, cal, val, _cfg(), tmp_path)
    assert not cache.ready
    cache.build(progress=False)
    assert cache.ready and not (cache.path.parent / (cache.path.name + ".tmp")).exists()
    sp = producer.prefill(cal[2][:-1], hidden_layers=range(producer.n_layers))
    k, v = cache.kv(2)
    assert all(torch.equal(k[l], sp.keys[l]) and torch.equal(v[l], sp.values[l]) for l in range(producer.n_layers))
    mom = cache.hidden_moments()
    assert mom[1].n == sum(len(p) - 1 for p in cal[:6])
    st = cache.val_states()[3]
    ref = producer.prefill(val[3][0][:-1], hidden_layers=[0, 3], residual_layers=[0, 3])
    assert st.n_tokens == len(val[3][0]) - 1 and st.n_layers == producer.n_layers
    assert torch.equal(st.residual[3], ref.residual[3]) and torch.equal(st.keys[0], ref.keys[0])
    assert torch.equal(st.hidden[0], ref.hidden[0])
    other = producer_cache(producer, cal[1:], val, _cfg(), tmp_path)
    assert other.path != cache.path and not other.ready


def test_consumer_traces_from_the_cache_equal_the_full_searchs(tiny_pair, tmp_path):
    from tools.calibration.fast import consumer_traces, producer_cache
    from tools.calibration.traces import collect

    producer, consumer = tiny_pair
    cal, val = _prompts(22)
    cache = producer_cache(producer, cal, val, _cfg(), tmp_path)
    cache.build(progress=False)
    fast = consumer_traces(cache, consumer, progress=False)
    full = collect(producer, consumer, cache.prompts, progress=False)
    assert fast.n_tokens == full.n_tokens
    for l in range(producer.n_layers):
        assert torch.allclose(fast.kv[l].gram, full.kv[l].gram, rtol=1e-5, atol=1e-6)
        assert torch.allclose(fast.h[l].gram, full.h[l].gram, rtol=1e-5, atol=1e-6)


def test_fast_search_writes_served_artifacts_and_reuses_the_cache(tiny_pair, tmp_path):
    from tests.unit.test_codec_contract import IDS, _transfer
    from tools.calibration.fast import calibrate_fast

    producer, consumer = tiny_pair
    cal, val = _prompts(23)
    kinds = ["qa", "lm"] * 2
    cfg = _cfg()
    folder, rep = calibrate_fast(producer, consumer, cal, val, cfg, str(tmp_path / "a"), "t", progress=False,
                                 val_kinds=kinds, cache_root=tmp_path / "cache")
    assert rep["search"] == "fast" and not rep["producer_cache"]["hit"] and "producer_cache" in rep["stage_seconds"]
    assert {"traces", "reuse_fit", "validation_prep", "fallback", "total"} <= set(rep["stage_seconds"])
    meta, pt = store.load(folder, "producer")
    _, ct = store.load(folder, "consumer")
    assert meta.patch_layers == [] and meta.reuse_code == "joint"
    if rep["patch_block"]:  # kept only when it beat REUSE alone on every validation prompt
        assert rep["block_scan"]["kl"] < rep["validation"]["reuse_only_kl"]
        assert [list(b) for b in meta.patch_blocks] == [rep["patch_block"]]
    for key in ("fallback", "reuse_fallback"):
        fb = rep[key]
        worst = max(fb["by_kind"][k] / b for k, b in fb["bound"].items())
        assert fb["bound_met"] == (worst <= 1)
        tried = [p["kl"] for p in fb["path"]]  # the set kept is the best tried, unless the bound asked for more
        assert fb["kl"] == min(tried) or fb["bound_path"]
    assert meta.fallback_layers == sorted(rep["fallback"]["layers"])
    pctx = CodecContext(producer, PairArtifacts(meta, pt, "producer"))
    cctx = CodecContext(consumer, PairArtifacts(meta, ct, "consumer"))
    cache, nbytes, _ = _transfer("scd", pctx, cctx)
    assert nbytes > 0 and cache.layers[0].keys.shape[2] == len(IDS) - 1

    folder2, rep2 = calibrate_fast(producer, consumer, cal, val, cfg, str(tmp_path / "b"), "t", progress=False,
                                   val_kinds=kinds, cache_root=tmp_path / "cache")
    assert rep2["producer_cache"]["hit"] and "producer_cache" not in rep2["stage_seconds"]
    assert rep2["patch_block"] == rep["patch_block"] and rep2["fallback"]["layers"] == rep["fallback"]["layers"]
    _, ct2 = store.load(folder2, "consumer")
    assert all(torch.equal(ct[k], ct2[k]) for k in ct)


@pytest.mark.parametrize("search, own, peer, expect", [
    ("auto", False, True, True),  # a new member of a calibrated producer
    ("auto", True, True, False),  # recalibrating a pair: the full search
    ("auto", False, False, False),  # the producer's first pair
    ("full", False, True, False),
    ("fast", False, False, True),
])
def test_which_search_scd_calibrate_runs(tiny_pair, tmp_path, search, own, peer, expect):
    from shared.model.fingerprint import weights_fingerprint
    from tools.cli.calibrate import _fast

    producer, _ = tiny_pair
    fp = weights_fingerprint(producer.model)
    for name, make in (("new", own), ("peer", peer)):
        if make:
            (tmp_path / name).mkdir()
            (tmp_path / name / "meta.json").write_text(json.dumps({"producer_fingerprint": fp}))
    (tmp_path / "stranger").mkdir()
    (tmp_path / "stranger" / "meta.json").write_text(json.dumps({"producer_fingerprint": "other"}))
    (tmp_path / "broken").mkdir()  # another pair's damaged manifest is not this calibration's problem
    (tmp_path / "broken" / "meta.json").write_text("{ cut short")
    cal, val = _prompts(24)
    pm = SimpleNamespace(producer=producer)
    assert _fast(pm, tmp_path, "new", cal, val, _cfg(search=search, pair="new")) is expect
