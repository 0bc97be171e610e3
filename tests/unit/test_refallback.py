"""Validation scored like the test split (LM text on its own continuation), and the fallback layers
selected again on existing artifacts (``scd calibrate --method fallback``), on the tiny pair."""

import pytest
import torch
from test_codec_contract import _calibrate_tiny_joint

from shared.artifacts import store
from shared.codecs import CodecContext, make_method
from shared.codecs.scd import PairArtifacts
from tools.calibration import selection as sel
from tools.calibration.scoring import Scorer
from tools.calibration.settings import CalibrationSettings


def test_validation_scores_a_given_continuation_not_the_oracles_greedy_one(tiny_pair):
    producer, consumer = tiny_pair
    g = torch.Generator().manual_seed(31)
    ids = torch.randint(0, 256, (40,), generator=g).tolist()
    cont = torch.randint(0, 256, (12,), generator=g).tolist()
    given, greedy = sel.prepare_val(producer, consumer, [(ids, 0, cont), (ids, 0)], n_new=8, progress=False)
    assert given.target == cont[:8] and given.oracle_lp.shape[0] == 8
    state = consumer.prefill(ids[:-1])
    assert greedy.target == consumer.greedy(consumer.build_cache(state.keys, state.values), ids[-1], 8)
    assert given.target != greedy.target  # random text is not what the model would say next
    # the log-probs are the Oracle's on that continuation
    lp = consumer.score(consumer.build_cache(state.keys, state.values), ids[-1], cont[:8])[:8]
    assert torch.allclose(given.oracle_lp, lp, atol=1e-5)
    # an empty continuation is no continuation
    empty, = sel.prepare_val(producer, consumer, [(ids, 0, [])], n_new=8, progress=False)
    assert empty.target == greedy.target


def test_fallback_reselection_scores_the_served_method_and_writes_its_choice(tiny_pair, tmp_path):
    """A rank-1 code calibrated without fallback: re-selecting scd-reuse's set finds layers where the
    producer's own K/V do better, writes them (and only them: scd's set is untouched), and the KL it
    reports is the served method's on those layers."""
    from tools.calibration.refallback import reselect

    producer, consumer = tiny_pair
    _, val, _, folder, _ = _calibrate_tiny_joint(tiny_pair, tmp_path / "a", 41, r_kv=1, pre_block_ranks=[],
                                                 block_layers=2, fallback=False)
    before = store.load_meta(folder)
    assert before.reuse_fallback_layers == [] == before.fallback_layers
    g = torch.Generator().manual_seed(42)
    val3 = [(ids, start, torch.randint(0, 256, (10,), generator=g).tolist() if i % 2 else [])
            for i, (ids, start) in enumerate(val)]
    kinds = ["qa" if i % 2 == 0 else "lm" for i in range(len(val3))]
    cfg = CalibrationSettings(pair="tiny", val_tokens=8, fallback_gain=0.0, fallback_bound=None)
    out = tmp_path / "b"
    new_folder, rep = reselect(producer, consumer, folder, out, val3, kinds, cfg, ["scd-reuse"], progress=False)
    meta, pt = store.load(new_folder, "producer")
    _, ct = store.load(new_folder, "consumer")
    rfb = rep["reuse_fallback"]
    assert meta.reuse_fallback_layers == rfb["layers"] and rfb["layers"], "rank 1 should lose on some layer"
    assert meta.fallback_layers == before.fallback_layers and "fallback" not in rep
    assert rfb["kl"] < rfb["kl_without"] == pytest.approx(rep["reuse_fallback_before"]["kl"])
    assert set(rep["raw_by_kind"]) == {"qa", "lm"} and meta.report["refallback"]["n_val"] == len(val3)
    # rescored independently: the served scd-reuse with the written artifacts
    vps = sel.prepare_val(producer, consumer, val3, n_new=8, progress=False)
    scorer = Scorer(producer, consumer, vps, kinds)
    enc = make_method("scd-reuse", CodecContext(producer, PairArtifacts(meta, pt, "producer")))
    dec = make_method("scd-reuse", CodecContext(consumer, PairArtifacts(meta, ct, "consumer")))
    assert scorer.kl(enc, dec) == pytest.approx(rfb["kl"], rel=1e-5)
    with pytest.raises(ValueError, match="fallback modes must be some of"):
        reselect(producer, consumer, folder, out, val3, kinds, cfg, ["scd-typo"], progress=False)
