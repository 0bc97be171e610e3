"""``ridge`` with a byte budget: the mapped K/V cross at SpectrumKV's per-token precision."""

import pytest
import torch
from test_codec_contract import _transfer, contexts  # noqa: F401 - the module's fixture

from shared.codecs import make_method
from shared.errors import InvalidRequest


@pytest.mark.parametrize("budget", [0.5, 0.35])
def test_ridge_under_a_budget_sends_its_share_and_decodes_close_to_the_fp16_map(contexts, budget):  # noqa: F811
    pctx, cctx = contexts
    full, full_bytes, enc_full = _transfer("ridge", pctx, cctx, compression="lz4")  # a budget of bytes before zstd
    cut, cut_bytes, enc_cut = _transfer("ridge", pctx, cctx, params={"budget": str(budget)}, compression="lz4")
    assert set(enc_full[0]) == {"k", "v"} and "tier" in enc_cut[0]
    assert cut_bytes <= budget * full_bytes * 1.05  # lz4 and the tier row are the only slack
    for layer in range(pctx.model.n_layers):
        for a, b in ((full.layers[layer].keys, cut.layers[layer].keys),
                     (full.layers[layer].values, cut.layers[layer].values)):
            assert float((a - b).norm() / a.norm()) < make_method("ridge", pctx, {"budget": str(budget)}).error_bound()
    # the fp16 tier is where the producer's attention goes: at least the sinks cross exactly
    assert torch.allclose(full.layers[0].values[:, :, :4], cut.layers[0].values[:, :, :4], atol=1e-6)


def test_ridge_budget_out_of_range_is_a_clear_error(contexts):  # noqa: F811
    pctx, _ = contexts
    with pytest.raises(InvalidRequest, match="budget"):
        make_method("ridge", pctx, {"budget": "1.5"})


@pytest.mark.parametrize("k_bits,v_bits", [(8, 8), (6, 8), (6, 6), (4, 16), (16, 4)])
def test_ridge_at_one_precision_sends_its_bits_and_decodes_close_to_the_fp16_map(contexts, k_bits, v_bits):  # noqa: F811
    pctx, cctx = contexts
    params = {"k_bits": str(k_bits), "v_bits": str(v_bits)}
    full, full_bytes, _ = _transfer("ridge", pctx, cctx)
    for start in (0, 2):  # with the native prefix, fewer sinks cross (two at start=2)
        cut, cut_bytes, enc = _transfer("ridge", pctx, cctx, start=start, params=params)
        n = full.layers[0].keys.shape[2]
        share = {16: 1.0, 8: 0.5, 6: 0.375, 4: 0.25}
        # keys: codes (the sinks fp16, a scale and zero per channel); values: codes, scale and zero per 32
        want = (share[k_bits] + (share[v_bits] + (0 if v_bits == 16 else 2 * 2 / 32 / 2))) / 2
        assert cut_bytes / (n - start) / (full_bytes / n) <= want * 1.1 + 4 / n
        bound = make_method("ridge", pctx, params).error_bound()
        for layer in range(pctx.model.n_layers):
            for a, b in ((full.layers[layer].keys, cut.layers[layer].keys),
                         (full.layers[layer].values, cut.layers[layer].values)):
                a, b = a[:, :, start:], b[:, :, start:]
                assert float((a - b).norm() / a.norm()) < bound, (layer, start)
        if k_bits < 16 and start == 0:  # the attention sinks' keys cross exactly
            torch.testing.assert_close(cut.layers[0].keys[:, :, :4], full.layers[0].keys[:, :, :4])


def test_ridge_budget_and_bits_together_are_refused(contexts):  # noqa: F811
    pctx, _ = contexts
    with pytest.raises(InvalidRequest, match="either budget"):
        make_method("ridge", pctx, {"budget": "0.5", "v_bits": "8"})
    with pytest.raises(InvalidRequest, match="k_bits"):
        make_method("ridge", pctx, {"k_bits": "5"})
