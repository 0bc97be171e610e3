"""The PATCH block's entry map: a ridge map of the producer's residual-stream state toward the
consumer's own at the block entry, fitted by calibration and applied by the consumer (tiny pair)."""

import pytest
import torch

from shared.artifacts import store
from shared.codecs import CodecContext, make_method
from shared.errors import ConfigError
from tests.unit.test_codec_contract import _calibrate_tiny_joint, _transfer, _variant
from tools.calibration.linalg import fit_entry_map


def _prompts(seed, n, length=48):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


def test_the_fitted_map_brings_held_out_producer_states_nearer_the_consumers(tiny_pair):
    producer, consumer = tiny_pair
    layer = 3  # the consumer's layer 2 attention differs: residual states differ from layer 3 on
    t = fit_entry_map(producer, consumer, _prompts(1, 32), layer, 1e-2, progress=False)
    w, mp, mc = (t[f"entry.{x}.{layer}"].float() for x in ("w", "mu_p", "mu_c"))
    assert w.shape == (producer.hidden_size, producer.hidden_size)
    before = after = 0.0
    for ids in _prompts(2, 3):  # prompts the fit never saw
        xp = producer.prefill(ids, residual_layers=[layer]).residual[layer][0, 1:].float()
        xc = consumer.prefill(ids, residual_layers=[layer]).residual[layer][0, 1:].float()
        mapped = xp + (xp - mp) @ w + (mc - mp)
        assert (mapped - xc).norm() < (xp - xc).norm()
        before, after = before + float((xp - xc).norm()), after + float((mapped - xc).norm())
    # the tiny consumer's drift is cross-token (its layer 2 attention): a per-token map gets part of it
    assert after < 0.95 * before


def test_calibration_keeps_the_map_only_when_it_lowers_validation_kl_and_the_consumer_applies_it(tiny_pair, tmp_path):
    producer, consumer = tiny_pair
    *_, folder, report = _calibrate_tiny_joint(tiny_pair, tmp_path, 41, block_layers=2, block_exit_kv="off",
                                               bytes_target=None)
    em = report["entry_map"]
    meta, pt = store.load(folder, "producer")
    _, ct = store.load(folder, "consumer")
    (a0, _), = meta.patch_blocks
    assert em["layer"] == a0 and em["kept"] == (em["kl_with"] < em["kl_without"]) == meta.block_entry_map
    assert (f"entry.w.{a0}" in ct) == meta.block_entry_map and not any(k.startswith("entry.") for k in pt)
    # whatever calibration decided, served with a map the block runs the consumer's layers on the
    # mapped state (a block entering at layer 3, where the two residual streams differ)
    a, b = 3, 4
    entry = fit_entry_map(producer, consumer, _prompts(3, 8), a, 1e-2, progress=False)
    p, c = _variant(meta, pt, {**ct, **entry}, block_entry_map=True, patch_blocks=[(a, b)], patch_layers=[],
                    block_exit_kv=False)
    pctx, cctx = CodecContext(producer, p), CodecContext(consumer, c)
    mapped, _, enc = _transfer("scd", pctx, cctx)
    unmapped, _, _ = _transfer("scd", pctx, cctx, params={"entry_map": "none"})
    dec = make_method("scd", cctx)
    h = dec._uncode(enc[a], "r", producer.hidden_size)
    m = dec.map_entry(h, a)
    assert torch.equal(m[0], h[0]) and not torch.allclose(m[1:], h[1:])  # the sink keeps the producer's state
    _, ks, vs = consumer.run_layers(m.unsqueeze(0), a, b)
    for j, layer in enumerate(range(a, b)):
        assert torch.allclose(mapped.layers[layer].values, vs[j], atol=1e-5)
        assert not torch.allclose(unmapped.layers[layer].values, vs[j], atol=1e-4)
    for layer in range(a):  # only the block changes
        assert torch.equal(mapped.layers[layer].values, unmapped.layers[layer].values)


def test_without_a_block_there_is_no_entry_map(tiny_pair, tmp_path):
    *_, folder, report = _calibrate_tiny_joint(tiny_pair, tmp_path, 42, block_layers=0, bytes_target=None)
    assert "entry_map" not in report and not store.load_meta(folder).block_entry_map


def test_a_missing_map_tensor_is_a_clear_error(tiny_pair, tmp_path):
    producer, consumer = tiny_pair
    *_, folder, _ = _calibrate_tiny_joint(tiny_pair, tmp_path, 43, block_layers=2, entry_map=False,
                                          bytes_target=None)
    meta, pt = store.load(folder, "producer")
    _, ct = store.load(folder, "consumer")
    p, c = _variant(meta, pt, ct, block_entry_map=True)  # the flag without its tensors
    with pytest.raises(ConfigError, match=r"declare a block entry map but lack \['entry.w"):
        make_method("scd", CodecContext(consumer, c))
    make_method("scd", CodecContext(producer, p))  # the producer side holds no map: nothing to check
    make_method("scd", CodecContext(consumer, c), {"entry_map": "none"})
