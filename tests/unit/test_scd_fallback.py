"""SCD's per-layer fallback (the producer's own K/V where the code hurts) and the block shortened
within tolerance: served, declared, and chosen by calibration on the tiny pair."""

import pytest
import torch
from test_codec_contract import IDS, _calibrate_tiny_joint, _transfer, _variant

from shared.artifacts import store
from shared.codecs import CodecContext


def test_scd_fallback_layers_send_the_producers_own_kv_as_int8(tiny_pair, tmp_path):
    """A fallback layer crosses as the producer's K/V (int8 per token, declared in the schema) and
    decodes to exactly those; ``fallback=none`` sends the code there; ``scd-reuse`` reads its own set."""
    from shared.codecs.quant import dequantize_rows, quantize_rows
    from shared.codecs.scd import channel_scale
    from shared.model.hf_adapter import to_rows

    producer, consumer = tiny_pair
    *_, folder, _ = _calibrate_tiny_joint(tiny_pair, tmp_path, 21, block_layers=2, block_exit_kv="off",
                                          fallback=False)
    meta, pt = store.load(folder, "producer")
    _, ct = store.load(folder, "consumer")
    (a, b), = meta.patch_blocks
    layer = next(l for l in range(meta.n_layers) if not a <= l < b and l not in meta.patch_layers)
    p, c = _variant(meta, pt, ct, fallback_layers=[layer, a], reuse_fallback_layers=[b - 1])
    pctx, cctx = CodecContext(producer, p), CodecContext(consumer, c)
    cache, nbytes, enc = _transfer("scd", pctx, cctx)
    assert set(enc[layer]) == {"qkv", "qkv_scale", "qkv_channel"}  # with per-channel scales, the default
    assert "qkv" not in enc[a]  # a block layer never falls back: the block recomputes it
    state = producer.prefill(IDS[:-1])
    rows = torch.cat([to_rows(state.keys[layer]), to_rows(state.values[layer])], 1).float()
    c = channel_scale(rows).float()
    kv = dequantize_rows(*quantize_rows(rows / c, meta.code_levels.get("qkv", 8))) * c
    assert torch.allclose(to_rows(cache.layers[layer].values), kv[:, producer.kv_dim:], atol=1e-5)
    code, code_bytes, enc0 = _transfer("scd", pctx, cctx, params={"fallback": "none"})
    assert set(enc0[layer]) == {"zkv", "zkv_scale"} and code_bytes < nbytes
    assert not torch.allclose(code.layers[layer].values, cache.layers[layer].values, atol=1e-3)
    _, _, renc = _transfer("scd-reuse", pctx, cctx)
    assert set(renc[b - 1]) == {"qkv", "qkv_scale", "qkv_channel"} and set(renc[layer]) == {"zkv", "zkv_scale"}
    # ``codes=int8``: the form before per-channel scales and levels
    old, _, oenc = _transfer("scd", pctx, cctx, params={"codes": "int8"})
    assert set(oenc[layer]) == {"qkv", "qkv_scale"}
    kv8 = dequantize_rows(*quantize_rows(rows, 8))
    assert torch.allclose(to_rows(old.layers[layer].values), kv8[:, producer.kv_dim:], atol=1e-5)


def test_calibration_falls_back_where_the_code_hurts_and_shortens_the_block(tiny_pair, tmp_path):
    """A rank-1 code is worse than the producer's own K/V: calibration finds layers where falling
    back lowers validation KL, keeps the best set, and the saved artifacts say so. The block is
    shortened while within tolerance."""
    producer, _ = tiny_pair
    *_, folder, report = _calibrate_tiny_joint(tiny_pair, tmp_path, 22, r_kv=1, pre_block_ranks=[], block_layers=3,
                                               block_min_layers=1, tolerance=100.0, fallback_gain=0.0)
    meta = store.load_meta(folder)
    fb, rfb = report["fallback"], report["reuse_fallback"]
    assert meta.patch_blocks == [(meta.patch_blocks[0][0], meta.patch_blocks[0][0] + 1)]
    assert [t["layers"] for t in report["block_length"]["tried"]] == [3, 1] and report["block_length"]["kept"] == 1
    assert meta.fallback_layers == fb["layers"] and meta.reuse_fallback_layers == rfb["layers"]
    assert rfb["layers"], "a rank-1 code should lose to the producer's own K/V on some layer"
    assert rfb["kl"] < rfb["kl_without"] and fb["kl"] <= fb["kl_without"]
    levels = report["code_levels"]  # the last stage starts from the fallback stage's configuration
    assert levels["kl_256_levels"] == pytest.approx(fb["kl"], rel=1e-4) and report["selected_kl"] == levels["kl"]
    (a, b), = meta.patch_blocks
    assert not set(fb["layers"]) & (set(range(a, b + meta.block_exit_kv)) | set(meta.patch_layers))
    assert set(rfb["gain"]) == {str(l) for l in range(producer.n_layers)}
    # no layer qualifies when the gain asked for is out of reach
    *_, folder, report = _calibrate_tiny_joint(tiny_pair, tmp_path / "strict", 22, r_kv=1, pre_block_ranks=[],
                                               block_layers=2, fallback_gain=1e9, fallback_bound=None)
    assert store.load_meta(folder).reuse_fallback_layers == [] == report["reuse_fallback"]["layers"]


def test_the_fallback_bound_holds_on_each_kind_of_validation_text(tiny_pair, tmp_path):
    """With no layer qualifying by gain, the per-kind bound alone adds fallback layers until each kind
    of validation text scores within its share of raw's KL on that kind."""
    *_, folder, report = _calibrate_tiny_joint(tiny_pair, tmp_path, 23, r_kv=1, pre_block_ranks=[], block_layers=2,
                                               fallback_gain=1e9, fallback_bound=1.5, val_kinds=["qa", "lm", "qa"])
    assert set(report["validation"]["raw_kl_by_kind"]) == {"qa", "lm"}
    bound = {k: 1.5 * v for k, v in report["validation"]["raw_kl_by_kind"].items()}
    for key in ("fallback", "reuse_fallback"):
        fb = report[key]
        assert fb["bound"] == bound and fb["path"] == []  # nothing qualified by gain: only the bound acts
        over = [k for k in bound if fb["by_kind_without"][k] > bound[k]]
        assert bool(fb["layers"]) == bool(over)
        assert sorted(s["layer"] for s in fb["bound_path"]) == fb["layers"]
        assert fb["bound_met"] and all(fb["by_kind"][k] <= bound[k] for k in bound)
    assert report["reuse_fallback"]["layers"], "a rank-1 code is worse than raw: the bound must add layers"
    assert store.load_meta(folder).reuse_fallback_layers == report["reuse_fallback"]["layers"]


def test_an_unreachable_bound_keeps_the_set_that_came_closest_not_every_layer(tiny_pair, tmp_path):
    """A bound no fallback set can meet: every set the bound tried is reported, and the one kept is
    the one whose worst kind came closest to its limit."""
    from tools.calibration.pipeline import _worst

    *_, folder, report = _calibrate_tiny_joint(tiny_pair, tmp_path, 24, r_kv=1, pre_block_ranks=[], block_layers=2,
                                               fallback_gain=1e9, fallback_bound=1e-6, val_kinds=["qa", "lm", "qa"])
    fb = report["reuse_fallback"]
    assert not fb["bound_met"] and fb["bound_path"]
    tried = [([], fb["kl_without"], fb["by_kind_without"])] + [(s["layers"], s["kl"], s["by_kind"])
                                                               for s in fb["bound_path"]]
    closest = min(tried, key=lambda s: _worst(s[2], fb["bound"]))
    assert (fb["layers"], fb["kl"], fb["by_kind"]) == closest
    assert store.load_meta(folder).reuse_fallback_layers == fb["layers"]
