"""The token-sparse PATCH block (``scd`` with ``block_tokens`` < 1): which positions it recomputes,
and the per-prompt fit of the others' REUSE K/V."""

import pytest
import torch

from shared.artifacts import store
from shared.codecs import CodecContext, make_method
from tests.unit.test_codec_contract import IDS, _calibrate_tiny_joint, _transfer, _variant


def test_scd_token_sparse_block_recomputes_the_selected_positions(tiny_pair, tmp_path):
    """``block_tokens`` < 1: every block layer carries REUSE codes as well, the consumer recomputes
    the selected positions once the block's last layer is in; selecting every position is the full
    block, selecting few keeps the REUSE K/V elsewhere."""
    producer, consumer = tiny_pair
    *_, folder, _ = _calibrate_tiny_joint(tiny_pair, tmp_path, 20, block_layers=2, block_exit_kv="off")
    meta, pt = store.load(folder, "producer")
    _, ct = store.load(folder, "consumer")
    p, c = _variant(meta, pt, ct, patch_blocks=[(1, 3)], patch_layers=[])
    pctx, cctx = CodecContext(producer, p), CodecContext(consumer, c)
    full, full_bytes, _ = _transfer("scd", pctx, cctx)
    n = len(IDS) - 1
    every, every_bytes, enc = _transfer("scd", pctx, cctx, params={"block_tokens": 1 - 0.1 / n})
    assert set(enc[1]) == {"r", "r_scale", "r_channel", "score", "zkv", "zkv_scale"}
    assert set(enc[2]) == {"zkv", "zkv_scale"}
    assert every_bytes > full_bytes
    for layer in (1, 2):
        torch.testing.assert_close(every.layers[layer].values, full.layers[layer].values, atol=1e-5, rtol=1e-5)
    few, _, _ = _transfer("scd", pctx, cctx, params={"block_tokens": 0.2, "block_fit": "none",
                                                     "block_select": "attention"})
    reuse, _, _ = _transfer("scd", pctx, cctx, params={"patch_blocks": "none"})
    def same(x, y, layer):  # per position
        return (x.layers[layer].values - y.layers[layer].values).abs().amax(dim=(0, 1, 3)) < 1e-5

    # at the entry layer a recomputed position's K/V are the full block's (the same entry state)
    recomputed = same(few, full, 1) & ~same(few, reuse, 1)
    assert recomputed[-16:].all() and int(recomputed.sum()) == round(0.2 * n)  # the last 16 always
    assert same(few, reuse, 1)[~recomputed].all()
    # deeper, the recomputed positions have attended to the others' REUSE K/V: neither full nor REUSE
    assert same(few, reuse, 2)[~recomputed].all() and not same(few, reuse, 2)[recomputed].any()
    assert not same(few, full, 2)[recomputed].all()
    # with the per-prompt fit (the default), the others' REUSE K/V are corrected from the entry layer on
    fit, _, _ = _transfer("scd", pctx, cctx, params={"block_tokens": 0.2, "block_select": "attention"})
    assert (same(fit, full, 1) == recomputed).all()
    assert not same(fit, reuse, 1)[~recomputed].any()
    # by default the positions are the producer's choice: the top of the scores it sends
    by_producer, _, enc = _transfer("scd", pctx, cctx, params={"block_tokens": 0.2, "block_fit": "none"})
    chosen = same(by_producer, full, 1) & ~same(by_producer, reuse, 1)
    score = enc[1]["score"].float()
    score[-16:] = float("inf")
    assert chosen.nonzero().flatten().tolist() == torch.topk(score, round(0.2 * n)).indices.sort().values.tolist()
    with pytest.raises(Exception, match="block_tokens"):
        make_method("scd", cctx, {"block_tokens": 0})
    with pytest.raises(Exception, match="block_fit_lambda"):
        make_method("scd", cctx, {"block_tokens": 0.5, "block_fit_lambda": 0})
    with pytest.raises(Exception, match="block_fit"):
        make_method("scd", cctx, {"block_tokens": 0.5, "block_fit": "linear"})


def test_head_ridge_recovers_a_per_head_affine_drift_from_a_sample():
    """The sparse block's fit: when the native K/V are an affine map of the given ones per head,
    a sample of rows recovers it for the rest; a large penalty keeps the rows as given; the
    sample's rows become their targets; the result keeps the input's dtype."""
    from shared.codecs.scd import head_ridge

    g = torch.Generator().manual_seed(0)
    t, heads, width = 400, 3, 8
    rows = torch.randn(t, heads * width, generator=g)
    maps = [torch.eye(width) + 0.3 * torch.randn(width, width, generator=g) for _ in range(heads)]
    native = torch.cat([rows[:, h * width:(h + 1) * width] @ maps[h] + 0.5 for h in range(heads)], 1)
    idx = torch.arange(0, t, 5)
    others = torch.ones(t, dtype=torch.bool)
    others[idx] = False
    def err(x, y=native):  # the others' error, relative to leaving them as given
        return float((x[others] - y[others]).pow(2).mean() / (rows[others] - y[others]).pow(2).mean())

    fitted = head_ridge(rows, idx, native[idx], width, 1e-4)
    assert err(fitted) < 1e-3
    assert torch.equal(fitted[idx], native[idx])
    assert err(head_ridge(rows, idx, native[idx], width, 1e4)) > 0.5  # shrunk to the identity: little corrected
    # per head: a map that mixes heads is not what it fits, so a cross-head drift stays partly
    mixed = rows @ (torch.eye(heads * width) + 0.3 * torch.randn(heads * width, heads * width, generator=g))
    assert err(head_ridge(rows, idx, mixed[idx], width, 1e-4), mixed) > 0.3
    assert head_ridge(rows.half(), idx, native[idx].half(), width, 1.0).dtype == torch.float16
