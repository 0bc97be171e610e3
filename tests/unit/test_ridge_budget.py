"""``ridge`` with a byte budget: the mapped K/V cross at SpectrumKV's per-token precision."""

import pytest
import torch
from test_codec_contract import _transfer, contexts  # noqa: F401 - the module's fixture

from shared.codecs import make_method
from shared.errors import InvalidRequest


@pytest.mark.parametrize("budget", [0.5, 0.35])
def test_ridge_under_a_budget_sends_its_share_and_decodes_close_to_the_fp16_map(contexts, budget):  # noqa: F811
    pctx, cctx = contexts
    full, full_bytes, enc_full = _transfer("ridge", pctx, cctx)
    cut, cut_bytes, enc_cut = _transfer("ridge", pctx, cctx, params={"budget": str(budget)})
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


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_ridge_at_one_precision_sends_its_bits_and_decodes_close_to_the_fp16_map(contexts, bits):  # noqa: F811
    pctx, cctx = contexts
    full, full_bytes, _ = _transfer("ridge", pctx, cctx)
    cut, cut_bytes, enc = _transfer("ridge", pctx, cctx, start=2, params={"bits": str(bits)})
    assert set(enc[0]) == {"k.q", "k.s", "k.z", "v.q", "v.s", "v.z"}
    n_full, n_cut = full.layers[0].keys.shape[2], full.layers[0].keys.shape[2] - 2
    per_token = cut_bytes / n_cut / (full_bytes / n_full)
    assert per_token <= (bits / 16 + 2 * 2 / 32 / 2) * 1.05  # the codes, a scale and a zero per 32 channels
    bound = make_method("ridge", pctx, {"bits": str(bits)}).error_bound()
    for layer in range(pctx.model.n_layers):
        for a, b in ((full.layers[layer].keys, cut.layers[layer].keys),
                     (full.layers[layer].values, cut.layers[layer].values)):
            a = a[:, :, 2:]
            assert float((a - b[:, :, 2:]).norm() / a.norm()) < bound


def test_ridge_budget_and_bits_together_are_refused(contexts):  # noqa: F811
    pctx, _ = contexts
    with pytest.raises(InvalidRequest, match="either budget"):
        make_method("ridge", pctx, {"budget": "0.5", "bits": "8"})
    with pytest.raises(InvalidRequest, match="bits"):
        make_method("ridge", pctx, {"bits": "5"})
