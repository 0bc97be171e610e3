import pytest
import torch

from shared.codecs.quant import (
    dequantize_groups,
    dequantize_rows,
    pack4,
    pack_codes,
    packed_size,
    quantize_groups,
    quantize_rows,
    unpack4,
    unpack_codes,
)


def test_pack4_round_trip():
    q = torch.randint(0, 16, (1000,), dtype=torch.uint8)
    p = pack4(q)
    assert p.numel() == 500 and torch.equal(unpack4(p, 1000), q)


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("byteorder", ["little", "big"])
def test_packed_codes_round_trip_at_their_size(bits, byteorder, monkeypatch):
    """The same bytes whichever path packs them (6-bit codes take an int32 path on little-endian hosts)."""
    monkeypatch.setattr("shared.codecs.quant.sys.byteorder", byteorder)
    q = torch.randint(0, 2**bits, (1000,), dtype=torch.uint8)
    q[:4] = 2**bits - 1  # every bit of a code set: nothing spills into the next code
    p = pack_codes(q, bits)
    assert p.dtype == torch.uint8 and p.numel() == packed_size(1000, bits) == 1000 * bits // 8
    assert torch.equal(unpack_codes(p, bits, 1000), q)
    if bits == 6:  # the layout itself: code i's bit j is bit 6i+j of the little-endian byte string
        bits_of = [(int(q[i]) >> j) & 1 for i in range(8) for j in range(6)]
        assert [(int(p[k // 8]) >> (k % 8)) & 1 for k in range(48)] == bits_of


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("axis", [0, 1])
def test_group_quantization_error_is_within_half_a_step(bits, axis):
    x = torch.randn(64, 96) * torch.linspace(0.1, 10, 96)
    q, s, z = quantize_groups(x, bits, 32, axis)
    assert int(q.max()) <= 2**bits - 1
    err = (dequantize_groups(q, s, z, 32, axis) - x).abs()
    step = s.float().expand(*([64 // 32, 32, 96] if axis == 0 else [64, 96 // 32, 32])).reshape(64, 96)
    assert bool((err <= step / 2 + 1e-3 * x.abs().max()).all())


def test_keys_per_channel_beat_per_token_on_channel_outliers():
    """KIVI's reason to quantize keys per channel: keys have outlier channels."""
    x = torch.randn(128, 64)
    x[:, 5] *= 50
    qc, sc, zc = quantize_groups(x, 4, 32, 0)
    qt, st, zt = quantize_groups(x, 4, 32, 1)
    per_channel = (dequantize_groups(qc, sc, zc, 32, 0) - x).norm()
    per_token = (dequantize_groups(qt, st, zt, 32, 1) - x).norm()
    assert per_channel < per_token


def test_symmetric_rows():
    x = torch.randn(10, 7)
    q, s = quantize_rows(x, 8)
    assert q.dtype == torch.int8 and float((dequantize_rows(q, s) - x).abs().max()) <= float(s.max()) / 2 + 1e-6
