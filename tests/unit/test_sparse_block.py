"""The token-sparse PATCH block (``scd`` with ``block_tokens`` < 1): which positions it recomputes,
and the per-prompt fit of the others' REUSE K/V."""

import pytest
import torch

from shared.artifacts import store
from shared.codecs import CodecContext, DecodeJob, make_method
from shared.errors import InvalidPayload
from tests.unit.test_codec_contract import IDS, _calibrate_tiny_joint, _transfer, _variant

FEW = {"block_min_tokens": 16}  # the tiny prompt's 160 positions are below the default floor (128)


def _sparse_pair(tiny_pair, tmp_path, exit_kv=False):
    producer, consumer = tiny_pair
    *_, folder, _ = _calibrate_tiny_joint(tiny_pair, tmp_path, 20, block_layers=2, block_exit_kv="off")
    meta, pt = store.load(folder, "producer")
    _, ct = store.load(folder, "consumer")
    p, c = _variant(meta, pt, ct, patch_blocks=[(1, 3)], patch_layers=[], block_exit_kv=exit_kv)
    return CodecContext(producer, p), CodecContext(consumer, c)


def test_scd_token_sparse_block_recomputes_the_selected_positions(tiny_pair, tmp_path):
    """``block_tokens`` < 1: every block layer carries REUSE codes as well, and the consumer runs each
    block layer for the selected positions as its codes arrive; selecting every position is the full
    block, selecting few keeps the REUSE K/V elsewhere. The producer chooses the positions and sends
    the entry state of those only."""
    pctx, cctx = _sparse_pair(tiny_pair, tmp_path)
    full, full_bytes, _ = _transfer("scd", pctx, cctx)
    n = len(IDS) - 1
    every, every_bytes, enc = _transfer("scd", pctx, cctx, params={"block_tokens": 1 - 0.1 / n})
    assert set(enc[1]) == {"r", "r_scale", "r_channel", "pos", "zkv", "zkv_scale"}
    assert set(enc[2]) == {"zkv", "zkv_scale"}
    assert every_bytes > full_bytes
    for layer in (1, 2):
        torch.testing.assert_close(every.layers[layer].values, full.layers[layer].values, atol=1e-5, rtol=1e-5)
    few, few_bytes, enc = _transfer("scd", pctx, cctx, params={"block_tokens": 0.2, "block_fit": "none",
                                                               "block_select": "attention", **FEW})
    assert set(enc[1]) == {"r", "r_scale", "r_channel", "zkv", "zkv_scale"} and enc[1]["r"].shape[0] == n
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
    fit, _, _ = _transfer("scd", pctx, cctx, params={"block_tokens": 0.2, "block_select": "attention", **FEW})
    assert (same(fit, full, 1) == recomputed).all()
    assert not same(fit, reuse, 1)[~recomputed].any()
    # by default the positions are the producer's choice, the top of its scores; it sends their
    # entry states only, with the positions
    by_producer, producer_bytes, enc = _transfer("scd", pctx, cctx,
                                                 params={"block_tokens": 0.2, "block_fit": "none", **FEW})
    chosen = ~same(by_producer, reuse, 1)  # (its entry rows are quantized over the chosen rows only)
    assert chosen.nonzero().flatten().tolist() == enc[1]["pos"].tolist()
    torch.testing.assert_close(by_producer.layers[1].values[:, :, chosen], full.layers[1].values[:, :, chosen],
                               atol=0.05, rtol=0.05)
    assert enc[1]["r"].shape[0] == round(0.2 * n) and producer_bytes < few_bytes
    enc_method = make_method("scd", pctx, {"block_tokens": 0.2, **FEW})
    state = pctx.model.prefill(IDS[:-1], hidden_layers=enc_method.hidden_layers())
    score = enc_method._scores(state, (1, 3)).float()
    score[-16:] = float("inf")
    assert enc[1]["pos"].tolist() == torch.topk(score, round(0.2 * n)).indices.sort().values.tolist()
    with pytest.raises(Exception, match="block_tokens"):
        make_method("scd", cctx, {"block_tokens": 0})
    with pytest.raises(Exception, match="block_fit_lambda"):
        make_method("scd", cctx, {"block_tokens": 0.5, "block_fit_lambda": 0})
    with pytest.raises(Exception, match="block_fit"):
        make_method("scd", cctx, {"block_tokens": 0.5, "block_fit": "linear"})
    for bad in ({"block_fit_span": -1}, {"block_fit_prior": 0}):
        with pytest.raises(Exception, match=next(iter(bad))):
            make_method("scd", cctx, {"block_tokens": 0.5, **bad})


def test_sparse_block_exit_layer_takes_the_recomputed_positions_own_kv(tiny_pair, tmp_path):
    """With the artifacts' exit layer, the layer after a token-sparse block still carries codes (the
    others need them), but the recomputed positions take their native K/V from their block output
    state: with every position selected, that is the full block's exit layer exactly."""
    pctx, cctx = _sparse_pair(tiny_pair, tmp_path, exit_kv=True)
    n = len(IDS) - 1
    full, _, _ = _transfer("scd", pctx, cctx)
    every, _, enc = _transfer("scd", pctx, cctx, params={"block_tokens": 1 - 0.1 / n})
    assert set(enc[3]) == {"zkv", "zkv_scale"}
    torch.testing.assert_close(every.layers[3].keys, full.layers[3].keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(every.layers[3].values, full.layers[3].values, atol=1e-5, rtol=1e-5)
    off, _, _ = _transfer("scd", *_sparse_pair(tiny_pair, tmp_path / "off"), params={"block_tokens": 1 - 0.1 / n})
    assert not torch.allclose(off.layers[3].values, full.layers[3].values, atol=1e-3)


def test_a_short_prompts_sparse_block_recomputes_at_least_its_last_16_positions(tiny_pair, tmp_path, monkeypatch):
    """The budget was the share alone: 4 positions of a 12-position prompt at 0.35, fewer than the
    last 16 the rule always recomputes (on `strong`, "The capital of France is Paris. The capital of
    Germany is" got "Paris" where the whole block says "Berlin"). A prompt of at most 16 positions
    now gets the whole block's cache."""
    from tests.unit import test_codec_contract as contract

    pctx, cctx = _sparse_pair(tiny_pair, tmp_path)
    method = make_method("scd", pctx, {"block_tokens": 0.35, **FEW})
    assert [method.n_keep(12, 0), method.n_keep(40, 0), method.n_keep(40, 30)] == [12, 16, 10]
    assert method.n_keep(1000, 24) == round(0.35 * 976)  # a long prompt: its share, as before
    default = make_method("scd", pctx, {"block_tokens": 0.35})  # the floor: 128 positions
    assert [default.n_keep(100, 0), default.n_keep(200, 0), default.n_keep(1000, 24)] == [100, 128, round(0.35 * 976)]
    with pytest.raises(Exception, match="block_min_tokens"):
        make_method("scd", pctx, {"block_tokens": 0.35, "block_min_tokens": 8})  # fewer than the last 16
    monkeypatch.setattr(contract, "IDS", IDS[:13])  # 12 transferred positions
    full, _, _ = _transfer("scd", pctx, cctx)
    short, _, enc = _transfer("scd", pctx, cctx, params={"block_tokens": 0.35})
    assert enc[1]["pos"].tolist() == list(range(12))
    for layer in (1, 2):
        torch.testing.assert_close(short.layers[layer].values, full.layers[layer].values, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(short.layers[layer].keys, full.layers[layer].keys, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", ["unsorted", "repeated", "below", "beyond"])
def test_sparse_block_refuses_bad_positions(tiny_pair, tmp_path, bad):
    """The recomputed positions the producer sends must be increasing and inside the transferred
    range: anything else is ``InvalidPayload``, not an index error or a silent misplacement."""
    pctx, cctx = _sparse_pair(tiny_pair, tmp_path)
    params = {"block_tokens": 0.2, **FEW}
    enc, dec = make_method("scd", pctx, params), make_method("scd", cctx, params)
    start, n = 4, len(IDS) - 1
    state = pctx.model.prefill(IDS[:-1], hidden_layers=enc.hidden_layers(), residual_layers=enc.residual_layers())
    own = cctx.model.prefill(IDS[:-1])
    session = dec.start(DecodeJob(IDS, n, start, tuple(k[:, :, :start] for k in own.keys),
                                  tuple(v[:, :, :start] for v in own.values)))
    session.add_layer(0, enc.encode_layer(state, 0, start))
    entry = enc.encode_layer(state, 1, start)
    pos = entry["pos"].clone()
    if bad == "unsorted":
        pos[[0, 1]] = pos[[1, 0]]
    elif bad == "repeated":
        pos[1] = pos[0]
    elif bad == "below":
        pos[0] = start - 1
    else:
        pos[-1] = n
    with pytest.raises(InvalidPayload, match="positions"):
        session.add_layer(1, {**entry, "pos": pos})


def head_ridge(rows: torch.Tensor, idx: torch.Tensor, target: torch.Tensor, width: int, lam: float) -> torch.Tensor:
    """``heads_ridge`` on token rows: ``rows`` [T, H*width], a KV head per block of ``width`` columns."""
    from shared.codecs.sparse_block import heads_ridge

    t, s = rows.shape[0], target.shape[0]
    out = heads_ridge(rows.view(t, -1, width).transpose(0, 1), idx, target.view(s, -1, width).transpose(0, 1), lam)
    return out.transpose(0, 1).reshape(t, -1)


def test_heads_ridge_equals_the_per_head_fit_on_rows():
    """The batched per-head fit on [H, T, D] is the row form's, head by head: no head sees another."""
    from shared.codecs.sparse_block import heads_ridge

    g = torch.Generator().manual_seed(1)
    t, heads, width = 120, 3, 8
    rows = torch.randn(t, heads * width, generator=g)
    target = torch.randn(30, heads * width, generator=g)
    idx = torch.arange(0, t, 4)
    by_rows = head_ridge(rows, idx, target, width, 0.5)
    for h in range(heads):
        one = heads_ridge(rows[:, h * width:(h + 1) * width].unsqueeze(0), idx,
                          target[:, h * width:(h + 1) * width].unsqueeze(0), 0.5)[0]
        torch.testing.assert_close(by_rows[:, h * width:(h + 1) * width], one)


def test_head_ridge_recovers_a_per_head_affine_drift_from_a_sample():
    """The sparse block's fit: when the native K/V are an affine map of the given ones per head,
    a sample of rows recovers it for the rest; a large penalty keeps the rows as given; the
    sample's rows become their targets; the result keeps the input's dtype."""
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


def test_neighbour_residuals_carry_a_local_drift_the_affine_fit_misses():
    """``block_fit_span``: a drift shared by runs of neighbouring tokens (a different offset per run of
    8, which no affine map of the rows can fit) is mostly recovered at the rows next to a selected one,
    and left alone far from any; the weights are those of the nearest selected rows on each side."""
    from shared.codecs.sparse_block import heads_ridge, neighbours

    idx = torch.tensor([2, 5, 40])
    w = neighbours(idx, 48, span=1.0, prior=0.05).to_dense()
    assert w.shape == (48, 3)
    assert float(w[3].sum()) > 0.9 and int(w[3].argmax()) == 0  # next to position 2
    assert float(w[20].sum()) < 1e-4  # 15 positions from the nearest: almost no residual taken
    # 40 reaches the positions within 12 of it on both sides: exp(-12) / 0.05 is the last weight over 1e-4
    assert (w[:, 2] > 0).nonzero().flatten().tolist() == list(range(28, 48))
    assert (neighbours(idx, 48, 1.0, 0.05, per_side=1).to_dense()[4] > 0).tolist() == [True, True, False]

    g = torch.Generator().manual_seed(3)
    heads, t, width = 2, 256, 8
    rows = torch.randn(heads, t, width, generator=g)
    runs = torch.randn(heads, t // 8, width, generator=g).repeat_interleave(8, dim=1)
    native = rows + runs
    idx = torch.arange(3, t, 8)  # one selected row per run
    others = torch.ones(t, dtype=torch.bool)
    others[idx] = False
    def err(out):
        return float((out[:, others] - native[:, others]).pow(2).mean() / runs[:, others].pow(2).mean())

    affine = heads_ridge(rows, idx, native[:, idx], 1e-3)
    local = heads_ridge(rows, idx, native[:, idx], 1e-3, neighbours(idx, t, 1.0, 0.05))
    assert err(affine) > 0.8  # the runs' offsets are not an affine map of the rows
    assert err(local) < 0.6 * err(affine)
    assert torch.equal(local[:, idx], native[:, idx])
    far = neighbours(torch.tensor([0, t - 1]), t, 1.0, 0.05)  # two selected rows at the ends
    middle = heads_ridge(rows, torch.tensor([0, t - 1]), native[:, [0, t - 1]], 1e-3, far)[:, 100:150]
    torch.testing.assert_close(middle, heads_ridge(rows, torch.tensor([0, t - 1]), native[:, [0, t - 1]],
                                                   1e-3)[:, 100:150])


def test_auto_scores_the_sparse_block_only_where_there_is_a_block(tiny_pair, tmp_path):
    """The operating table measures ``scd:block_tokens=...`` beside ``scd`` when the artifacts have a
    PATCH block, and skips it, saying why, when they have none (it would be ``scd`` again)."""
    from shared.model.prompt import PromptFormat
    from shared.model.tiny import tiny_tokenizer
    from tools.calibration.auto import operating_table
    from tools.data import Item

    producer, consumer = tiny_pair
    val = [Item(id=f"v{i}", kind="qa", prefix_len=0, prompt_ids=IDS[i:i + 120]) for i in range(2)]
    with_block = _sparse_pair(tiny_pair, tmp_path)
    meta = with_block[0].artifacts.meta
    p, c = _variant(meta, with_block[0].artifacts.tensors, with_block[1].artifacts.tensors, patch_blocks=[])
    without = CodecContext(producer, p), CodecContext(consumer, c)
    fmt = PromptFormat(tiny_tokenizer())
    cands = ("raw", "scd", "scd:block_tokens=0.35")
    table = operating_table(producer, consumer, fmt, val, *with_block, candidates=cands, progress=False)
    assert [x["label"] for x in table["points"]] == list(cands)
    table = operating_table(producer, consumer, fmt, val, *without, candidates=cands, progress=False)
    assert [x["label"] for x in table["points"]] == ["raw", "scd"]
    assert "no PATCH block" in table["report"]["skipped"]["scd:block_tokens=0.35"]
