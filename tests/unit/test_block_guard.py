"""The token-sparse block's guard: how unlike the calibration text a prompt is (the producer's K/V in
the block's layers outside what the REUSE codes carry), the threshold calibration sets, and the
whole block it serves a prompt above it, as the evaluation harness and the producer serve it; and
``scd-reuse``'s guard, which serves such a prompt the producer's own K/V as ``raw`` sends them."""

import pytest
import torch

from shared.codecs import CodecContext, make_method
from shared.codecs.scd import PairArtifacts
from shared.model.hf_adapter import to_rows
from tests.unit.test_codec_contract import IDS, _transfer
from tests.unit.test_sparse_block import FEW, _sparse_pair
from tools.calibration.guard import fit_guards

SPARSE = {"block_tokens": 0.5, **FEW}


@pytest.fixture(scope="module")
def contexts(tiny_pair, tmp_path_factory):
    return _sparse_pair(tiny_pair, tmp_path_factory.mktemp("guard"))


def _guarded(ctx: CodecContext, guard: float) -> CodecContext:
    art = ctx.artifacts
    meta = art.meta.model_copy(update={"block_guard": guard, "layer_guard": {}})  # the block guard alone
    return CodecContext(ctx.model, PairArtifacts(meta, art.tensors, art.side), ctx.profiles)


def _share_by_pinv(ctx: CodecContext, state, start: int) -> float:
    """The same share another way: the least-squares fit of each centred row by the encoder's columns."""
    art, (a, b) = ctx.artifacts, ctx.artifacts.meta.patch_blocks[0]
    shares = []
    for layer in range(a, b):
        x = torch.cat([to_rows(state.keys[layer][:, :, start:]), to_rows(state.values[layer][:, :, start:])], 1)
        x = x.double() - art.tensors[f"mu_p.kv.{layer}"].double()
        e = art.tensors[f"enc.kv.{layer}"].double()
        res = x - x @ torch.linalg.pinv(e).T @ e.T
        shares.append(res.pow(2).sum(1) / x.pow(2).sum(1))
    return float(torch.stack(shares).mean())


def test_unlike_calibration_and_the_settings_it_serves(tiny_pair, contexts):
    pctx, cctx = contexts
    state = pctx.model.prefill(IDS[:-1], residual_layers=[1])
    u = make_method("scd", _guarded(pctx, 1.0), SPARSE).unlike_calibration(state, 5)
    assert 0 < u < 1
    assert abs(u - _share_by_pinv(pctx, state, 5)) < 1e-4
    below, above = _guarded(pctx, u / 2), _guarded(pctx, u * 2)
    m = make_method("scd", below, SPARSE)
    assert m.decides_after_prefill
    got = m.settings_for(state, 5)
    assert got is not None and got["block_tokens"] == "1" and got["block_min_tokens"] == "16"
    assert make_method("scd", below, got).block_tokens == 1 and not make_method("scd", below, got).decides_after_prefill
    assert make_method("scd", above, SPARSE).settings_for(state, 5) is None
    for params in ({**SPARSE, "block_guard": "none"}, {**SPARSE, "block_select": "attention"}, {}):
        off = make_method("scd", below, params)
        assert not off.decides_after_prefill and off.settings_for(state, 5) is None, params
    assert not make_method("scd", _guarded(pctx, 0.0), SPARSE).decides_after_prefill  # artifacts without a guard


def test_scd_reuse_serves_a_prompt_above_the_guard_the_producers_own_kv_as_raw_does(tiny_pair, contexts):
    """``scd-reuse``'s guard: the same statistic and threshold; above it the prompt is served
    ``fallback=raw``, which carries every layer exactly as ``raw`` does (same tensors, same cache)."""
    pctx, cctx = contexts
    state = pctx.model.prefill(IDS[:-1])
    u = make_method("scd", _guarded(pctx, 1.0), SPARSE).unlike_calibration(state, 3)
    below, above = _guarded(pctx, u / 2), _guarded(pctx, u * 2)
    m = make_method("scd-reuse", below)
    assert m.decides_after_prefill and m.unlike_calibration(state, 3) == pytest.approx(u)
    got = m.settings_for(state, 3)
    assert got is not None and got["fallback"] == "raw" and got["guard"] == "auto"
    assert not make_method("scd-reuse", below, got).decides_after_prefill  # settled: nothing left to decide
    assert make_method("scd-reuse", above).settings_for(state, 3) is None
    assert not make_method("scd-reuse", below, {"guard": "none"}).decides_after_prefill
    no_block = CodecContext(pctx.model, PairArtifacts(below.artifacts.meta.model_copy(update={"patch_blocks": []}),
                                                      below.artifacts.tensors, "producer"))
    assert not make_method("scd-reuse", no_block).decides_after_prefill  # the statistic needs a block's layers
    for start in (0, 3):
        raw, raw_bytes, raw_enc = _transfer("raw", pctx, cctx, start=start)
        reuse, reuse_bytes, reuse_enc = _transfer("scd-reuse", pctx, cctx, start=start, params=got)
        codes, code_bytes, _ = _transfer("scd-reuse", pctx, cctx, start=start)
        assert reuse_bytes == raw_bytes > code_bytes
        for layer in range(pctx.model.n_layers):
            assert set(reuse_enc[layer]) == {"k", "v"}
            assert torch.equal(reuse_enc[layer]["k"], raw_enc[layer]["k"])
            assert torch.equal(reuse.layers[layer].keys, raw.layers[layer].keys)
            assert torch.equal(reuse.layers[layer].values, raw.layers[layer].values)
        assert not torch.equal(codes.layers[1].values, raw.layers[1].values)


def test_fit_guard_is_a_margin_over_the_validation_prompts_highest(tiny_pair, contexts):
    pctx, _ = contexts
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (30,), generator=g).tolist() for _ in range(3)]
    states = [(pctx.model.prefill(p), 2) for p in prompts]
    m = make_method("scd", _guarded(pctx, 1.0), SPARSE)
    values = [m.unlike_calibration(s, start) for s, start in states]
    meta, tensors = pctx.artifacts.meta, pctx.artifacts.tensors
    threshold, per_layer, rep = fit_guards(pctx.model, meta, tensors, states, 1.1, 1.05)
    block = rep["block_guard"]
    assert abs(threshold - 1.1 * max(values)) < 1e-9 and block["n_prompts"] == 3 and block["highest"] == max(values)
    shares = [m.layer_shares(s, start, range(meta.n_layers)) for s, start in states]
    assert per_layer == {l: 1.05 * max(x[l] for x in shares) for l in range(meta.n_layers)}
    assert fit_guards(pctx.model, meta, tensors, states, 0, 0)[:2] == (0, {})
    no_block = meta.model_copy(update={"patch_blocks": []})
    none = fit_guards(pctx.model, no_block, tensors, states, 1.1, 0)
    assert none[:2] == (0.0, {}) and none[2]["block_guard"] == {"threshold": 0.0, "why": "no PATCH block"}


def test_the_harness_serves_a_prompt_above_the_guard_the_whole_block(tiny_pair, contexts):
    """As the producer serves it: both sides made anew with the whole block's settings, counted."""
    from tools.data import Item
    from tools.eval.harness import Context, codec_method

    pctx, cctx = contexts
    producer, consumer = tiny_pair
    m = make_method("scd", pctx, SPARSE)
    state = producer.prefill(IDS[:-1], hidden_layers=m.hidden_layers(), residual_layers=m.residual_layers())
    whole_m = make_method("scd", pctx, {**SPARSE, "block_tokens": 1})  # what the prefill captured covers it
    assert set(whole_m.hidden_layers()) <= set(m.hidden_layers())
    assert set(whole_m.residual_layers()) <= set(m.residual_layers())
    ctx = Context(Item(id="p", kind="user", prompt_ids=list(IDS), prefix_len=0), state, consumer.prefill(IDS[:-1]), 0)
    u = make_method("scd", _guarded(pctx, 1.0), SPARSE).unlike_calibration(state, 0)
    whole, _, _ = _transfer("scd", pctx, cctx, params={**SPARSE, "block_tokens": 1})
    sparse, _, _ = _transfer("scd", pctx, cctx, params=SPARSE)
    for guard, want, resettled in ((u / 2, whole, True), (u * 2, sparse, False)):
        r = codec_method("scd", _guarded(pctx, guard), _guarded(cctx, guard), SPARSE)(ctx, consumer)
        assert r.resettled is resettled
        for layer in range(consumer.n_layers):
            torch.testing.assert_close(r.cache.layers[layer].values, want.layers[layer].values, atol=1e-6, rtol=1e-6)
    assert not all(torch.equal(whole.layers[i].values, sparse.layers[i].values) for i in range(consumer.n_layers))


def _layer_guarded(ctx: CodecContext, thresholds: dict[int, float]) -> CodecContext:
    art = ctx.artifacts
    meta = art.meta.model_copy(update={"block_guard": 0.0, "layer_guard": thresholds})
    return CodecContext(ctx.model, PairArtifacts(meta, art.tensors, art.side), ctx.profiles)


@pytest.mark.parametrize("kind", ["scd-reuse", "scd"])
def test_the_layer_guard_sends_what_the_codes_do_not_carry_as_raw_sends_it(tiny_pair, contexts, kind):
    """Per layer that carries a REUSE code, the share of this prompt's K/V outside the code's span
    against the artifacts' threshold. Above it at one layer: ``scd`` sends that layer as the
    producer's fp16 K/V (the very tensors ``raw`` sends; the consumer's cache holds raw's there) and
    keeps the other codes; ``scd-reuse``, with no block to lean on, sends every layer as raw does.
    Nothing above it, nothing changes."""
    pctx, cctx = contexts
    state = pctx.model.prefill(IDS[:-1], hidden_layers=make_method(kind, pctx).hidden_layers())
    on = {"layer_guard": "auto"}  # scd's default is none: its block carries such text better than raw layers
    m0 = make_method(kind, _layer_guarded(pctx, {}), on)
    code = sorted(m0.code_layers)
    assert code and not m0.decides_after_prefill  # artifacts without a layer guard decide nothing
    shares = m0.layer_shares(state, 3, code)
    hot = code[0]
    limits = {l: shares[l] * (0.5 if l == hot else 2.0) for l in code}
    p, c = _layer_guarded(pctx, limits), _layer_guarded(cctx, limits)
    m = make_method(kind, p, on)
    assert m.decides_after_prefill
    got = m.settings_for(state, 3)
    assert make_method(kind, p, {"layer_guard": "none"}).settings_for(state, 3) is None
    quiet = _layer_guarded(pctx, {l: shares[l] * 2 for l in code})
    assert make_method(kind, quiet, on).settings_for(state, 3) is None
    assert (make_method(kind, p).settings_for(state, 3) is None) == (kind == "scd")  # the defaults
    raw, raw_bytes, raw_enc = _transfer("raw", pctx, cctx, start=3)
    guarded, guarded_bytes, enc = _transfer(kind, p, c, start=3, params=got)
    plain, _, plain_enc = _transfer(kind, p, c, start=3, params={"layer_guard": "none"})
    assert not torch.equal(plain.layers[hot].values, raw.layers[hot].values)
    if kind == "scd-reuse":
        assert got is not None and got["fallback"] == "raw" and guarded_bytes == raw_bytes
        layers = range(pctx.model.n_layers)
    else:
        assert got is not None and got["raw_layers"] == f"[{hot}]"
        layers = [hot]
        for l in code[1:]:
            assert set(enc[l]) == set(plain_enc[l]) and torch.equal(guarded.layers[l].keys, plain.layers[l].keys)
    for l in layers:
        assert set(enc[l]) == {"k", "v"} and torch.equal(enc[l]["k"], raw_enc[l]["k"])
        assert torch.equal(guarded.layers[l].values, raw.layers[l].values)


def test_raw_layers_names_only_layers_that_carry_a_code(contexts):
    from shared.errors import InvalidRequest

    pctx, _ = contexts
    m = make_method("scd", pctx)
    not_coded = sorted(set(range(pctx.model.n_layers)) - m.code_layers - m.fallback)
    assert not_coded  # the PATCH block's layers
    with pytest.raises(InvalidRequest, match=rf"raw_layers: layers \[{not_coded[0]}\] carry no REUSE code") as e:
        make_method("scd", pctx, {"raw_layers": str(not_coded[0])})
    assert e.value.param == "method_params.raw_layers" or "raw_layers" in str(e.value)
