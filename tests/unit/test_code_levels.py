"""SCD's code form: per-channel scales, fewer int8 levels, and the calibration stage that lowers
them to a bytes target without buying it with quality (tiny pair)."""

import pytest
import torch

from shared.artifacts import store
from shared.codecs import CodecContext, make_method
from shared.codecs.scd import channel_scale
from shared.errors import InvalidPayload
from tests.unit.test_codec_contract import IDS, _calibrate_tiny_joint, _transfer, _variant


@pytest.fixture(scope="module")
def tiny_scd(tiny_pair, tmp_path_factory):
    """Artifacts with a block, a patch-free REUSE code and one fallback layer; the levels stage off."""
    *_, folder, _ = _calibrate_tiny_joint(tiny_pair, tmp_path_factory.mktemp("levels"), 31, block_layers=2,
                                          fallback=False, bytes_target=None)
    meta, pt = store.load(folder, "producer")
    _, ct = store.load(folder, "consumer")
    assert meta.code_levels == {} and meta.code_channel == ["r", "qkv"]
    (a, b), = meta.patch_blocks
    fb = next(l for l in range(meta.n_layers) if not a <= l <= b)
    return meta.model_copy(update={"fallback_layers": [fb]}), pt, ct


def _contexts(tiny_pair, meta, pt, ct, **update):
    p, c = _variant(meta, pt, ct, **{"fallback_layers": meta.fallback_layers, **update})
    return CodecContext(tiny_pair[0], p), CodecContext(tiny_pair[1], c)


def test_channel_scale_is_set_by_the_channels_not_by_a_huge_row():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 8, generator=g) * torch.tensor([1, 1, 1, 1, 1, 1, 1, 40.0])
    x[0] *= 1e4  # an attention sink's state
    c = channel_scale(x).float()
    assert c[7] > 5 * c[:7].max()
    assert torch.allclose(channel_scale(x[1:]).float(), c, rtol=0.02)  # the huge row does not set it


def test_fewer_levels_cost_fewer_zstd_bytes_and_decode_within_their_step(tiny_pair, tiny_scd):
    meta, pt, ct = tiny_scd
    full, full_bytes, _ = _transfer("scd", *_contexts(tiny_pair, meta, pt, ct))
    low, low_bytes, enc = _transfer("scd", *_contexts(tiny_pair, meta, pt, ct,
                                                      code_levels={"z": 5, "r": 6, "qkv": 5}))
    assert low_bytes < 0.85 * full_bytes
    (a, _), = meta.patch_blocks
    assert int(enc[a]["r"].abs().max()) <= 31 and int(enc[meta.fallback_layers[0]]["qkv"].abs().max()) <= 15
    z = next(l for l in range(meta.n_layers) if "zkv" in enc[l])
    assert int(enc[z]["zkv"].abs().max()) <= 15
    fb = meta.fallback_layers[0]  # a fallback layer decodes to the producer's K/V within its coarser step
    own = tiny_pair[0].prefill(IDS[:-1]).values[fb]
    for cache in (full, low):
        err = float((cache.layers[fb].values - own).norm() / own.norm())
        assert err < (0.02 if cache is full else 0.15)


def test_the_int8_form_sends_no_channel_scales_and_matches_the_old_decode(tiny_pair, tiny_scd):
    meta, pt, ct = tiny_scd
    old, old_bytes, enc = _transfer("scd", *_contexts(tiny_pair, meta, pt, ct, code_levels={"z": 5}),
                                    params={"codes": "int8"})
    plain, plain_bytes, _ = _transfer("scd", *_contexts(tiny_pair, meta, pt, ct, code_levels={}, code_channel=[]))
    assert not any(name.endswith("_channel") for e in enc for name in e)
    assert old_bytes == plain_bytes
    for layer in range(meta.n_layers):
        assert torch.equal(old.layers[layer].values, plain.layers[layer].values)


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0, float("inf")])
def test_a_bad_channel_scale_is_refused(tiny_pair, tiny_scd, bad):
    meta, pt, ct = tiny_scd
    pctx, cctx = _contexts(tiny_pair, meta, pt, ct)
    enc, dec = make_method("scd", pctx), make_method("scd", cctx)
    (a, _), = meta.patch_blocks
    state = pctx.model.prefill(IDS[:-1], residual_layers=enc.residual_layers())
    tensors = enc.encode_layer(state, a, 0)
    tensors["r_channel"] = tensors["r_channel"].clone()
    tensors["r_channel"][3] = bad
    with pytest.raises(InvalidPayload, match="per-channel scales must be"):
        dec._uncode(tensors, "r", pctx.model.hidden_size)


def _scorer(tiny_pair, seed=5):
    from tools.calibration import selection as sel
    from tools.calibration.scoring import Scorer

    producer, consumer = tiny_pair
    g = torch.Generator().manual_seed(seed)
    val = [(torch.randint(0, 256, (40,), generator=g).tolist(), 0) for _ in range(3)]
    return Scorer(producer, consumer, sel.prepare_val(producer, consumer, val, progress=False))


def test_levels_stage_lowers_to_the_target_cheapest_first_within_its_kl_bound(tiny_pair, tiny_scd):
    from tools.calibration.levels import tune_levels

    meta, pt, ct = tiny_scd
    scorer = _scorer(tiny_pair)
    levels, rep = tune_levels(scorer, meta, pt, ct, target=1.0, tolerance=0.1, progress=False)
    assert levels == {} and rep["met"] and len(rep["path"]) == 1  # already within the target: nothing lowered
    start = rep["path"][0]["bytes_vs_raw_fp16"]
    levels, rep = tune_levels(scorer, meta, pt, ct, target=0.01, tolerance=float("inf"), min_bits=6, progress=False)
    assert rep["kinds"] == ["qkv", "r", "z"] and levels == {"qkv": 6, "r": 6, "z": 6} and not rep["met"]
    steps = [p for p in rep["path"] if "levels" in p]
    assert all(later["bytes_per_token"] < earlier["bytes_per_token"] for earlier, later in zip(steps, steps[1:]))
    for p in steps[1:]:  # each step is the tried candidate with the least KL per byte saved
        prev = steps[steps.index(p) - 1]
        cost = [(t["kl"] - prev["kl"]) / (prev["bytes_per_token"] - t["bytes_per_token"]) for t in p["tried"]]
        assert (p["kl"] - prev["kl"]) / (prev["bytes_per_token"] - p["bytes_per_token"]) == pytest.approx(min(cost))
    assert steps[-1]["bytes_vs_raw_fp16"] < start
    _, strict = tune_levels(scorer, meta, pt, ct, target=0.01, tolerance=0.0, min_bits=6, progress=False)
    assert all(p["kl"] <= strict["kl_bound"] for p in strict["path"] if "levels" in p)
    assert "stopped" in strict["path"][-1] and not strict["met"]
