"""Frames round-trip every dtype; every protocol violation is refused with the right error."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.domain import HeaderReceived, LayerReceived, TrailerReceived
from shared.errors import DataLoss, InvalidPayload
from shared.rpc import scd_pb2 as pb
from shared.rpc.wire import DTYPES, FrameDecoder, Limits, StreamTotals, layer_frames


def _stream(layers, chunk_bytes=1 << 20):
    totals = StreamTotals()
    frames = [totals.add(pb.KVFrame(header=pb.Header(request_id="r", n_layers=len(layers))))]
    for i, tensors in enumerate(layers):
        frames += [totals.add(f) for f in layer_frames(i, tensors, chunk_bytes)]
    return frames + [totals.trailer()]


def _decode(frames, **kw):
    dec, out = FrameDecoder(**kw), []
    for f in frames:
        r = dec.feed(f)
        if isinstance(r, LayerReceived):
            out.append(r.tensors)
    return out, dec


def _layers(n=3):
    g = torch.Generator().manual_seed(0)
    return [{"k": torch.randn(1, 2, 50, 16, generator=g), "v": torch.randn(1, 2, 50, 16, generator=g)}
            for _ in range(n)]


@pytest.mark.parametrize("dtype", list(DTYPES.values()))
def test_roundtrip_every_dtype(dtype):
    t = (torch.randn(3, 70, 5) * 50).to(dtype)
    out, dec = _decode(_stream([{"x": t}], chunk_bytes=256))
    assert dec.done and torch.equal(out[0]["x"], t) and out[0]["x"].dtype == dtype


def test_multi_chunk_multi_layer_roundtrip():
    layers = _layers()
    out, _ = _decode(_stream(layers, chunk_bytes=1000))
    for a, b in zip(out, layers):
        assert torch.equal(a["k"], b["k"]) and torch.equal(a["v"], b["v"])


def test_bad_checksum_is_data_loss():
    frames = _stream(_layers(1))
    frames[1].chunk.crc32c ^= 1
    with pytest.raises(DataLoss, match="crc32c"):
        _decode(frames)


@pytest.mark.parametrize("mutate", [
    lambda c: setattr(c, "name", "q"),
    lambda c: setattr(c, "offset", c.offset + 8),
    lambda c: setattr(c, "layer_done", not c.layer_done),
], ids=["name", "offset", "layer_done"])
def test_checksum_covers_metadata(mutate):
    frames = _stream(_layers(1), chunk_bytes=1000)
    mutate(frames[2].chunk)
    with pytest.raises((DataLoss, InvalidPayload)):
        _decode(frames)


def test_corrupt_payload_is_data_loss():
    frames = _stream(_layers(1))
    frames[1].chunk.data = b"\x00garbage"
    with pytest.raises(DataLoss):
        _decode(frames)


def test_missing_layer_and_out_of_order():
    frames = _stream(_layers(3))
    layer1 = [f for f in frames if f.HasField("chunk") and f.chunk.layer == 1]
    without = [f for f in frames if f not in layer1]
    with pytest.raises(InvalidPayload, match="out of order|in order"):
        _decode(without)


def test_lost_frame_detected_by_trailer():
    frames = _stream(_layers(2), chunk_bytes=1000)
    del frames[2]  # a middle chunk of layer 0
    with pytest.raises((InvalidPayload, DataLoss)):
        _decode(frames)


def test_chunk_before_header_and_double_header():
    frames = _stream(_layers(1))
    with pytest.raises(InvalidPayload, match="before the header"):
        _decode(frames[1:])
    with pytest.raises(InvalidPayload, match="second header"):
        _decode([frames[0]] + frames)


def test_oversized_tensor_refused_before_allocation():
    frames = _stream(_layers(1))
    frames[1].chunk.shape[:] = [1 << 20, 1 << 20]
    with pytest.raises(InvalidPayload, match="limit"):
        _decode(frames, limits=Limits(max_tensor_bytes=1 << 20))


def test_unknown_dtype_refused():
    frames = _stream(_layers(1))
    frames[1].chunk.dtype = "F64"
    with pytest.raises(InvalidPayload, match="dtype"):
        _decode(frames)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_never_crash(data):
    try:
        frame = pb.KVFrame.FromString(data)
    except Exception:
        return  # not a protobuf: rejected by gRPC deserialization
    dec = FrameDecoder(limits=Limits(max_tensor_bytes=1 << 20))
    try:
        r = dec.feed(frame)
    except (InvalidPayload, DataLoss):
        return
    assert r is None or isinstance(r, (HeaderReceived, LayerReceived, TrailerReceived))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_mutated_valid_stream_never_yields_wrong_tensors(data):
    layers = _layers(2)
    frames = _stream(layers, chunk_bytes=700)
    i = data.draw(st.integers(0, len(frames) - 1))
    raw = bytearray(frames[i].SerializeToString())
    j = data.draw(st.integers(0, len(raw) - 1))
    raw[j] ^= data.draw(st.integers(1, 255))
    try:
        frames[i] = pb.KVFrame.FromString(bytes(raw))
    except Exception:
        return
    try:
        out, dec = _decode(frames, limits=Limits(max_tensor_bytes=1 << 20))
    except (InvalidPayload, DataLoss):
        return
    # accepted: then the stream must be complete and every tensor must be what was sent, or the
    # mutation touched only a field that carries no tensor data (request id, flags already implied)
    assert dec.done
    for a, b in zip(out, layers):
        for name in b:
            assert torch.equal(a[name], b[name])


def _huge_declaring_chunk(name="k", layer=0, nbytes=256 << 20):
    """A valid first chunk (right checksum) of a tensor that declares ``nbytes`` but sends 64 bytes."""
    import lz4.frame

    from shared.rpc.wire import chunk_crc

    raw = bytes(64)
    c = pb.TensorChunk(name=name, layer=layer, dtype="U8", shape=[nbytes], offset=0, raw_size=len(raw),
                       data=lz4.frame.compress(raw), last=False)
    c.crc32c = chunk_crc(c, raw)
    return pb.KVFrame(chunk=c)


def test_declared_sizes_are_not_allocated_before_their_bytes_arrive():
    """Memory amplification: 64 tensors each declaring 256 MiB with one 64-byte chunk must hold
    only what arrived, not 16 GiB (measured by tracemalloc, which sees every Python allocation)."""
    import tracemalloc

    dec = FrameDecoder()
    dec.feed(pb.KVFrame(header=pb.Header(request_id="r", n_layers=2)))
    tracemalloc.start()
    try:
        for i in range(64):
            assert dec.feed(_huge_declaring_chunk(f"t{i}")) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak:,} bytes held for 64 chunks of 64 bytes"
    dec.close()
    assert not dec._tensors


def test_planned_schema_refuses_undeclared_tensors_before_allocation():
    from shared.domain import TensorSpec

    schema = {"k": TensorSpec(torch.float16, (1, 2, 5, 4)), "v": TensorSpec(torch.float16, (1, 2, 5, 4))}
    ok = {"k": torch.zeros(1, 2, 5, 4, dtype=torch.float16), "v": torch.ones(1, 2, 5, 4, dtype=torch.float16)}
    dec = FrameDecoder(n_layers=1)
    dec.feed(pb.KVFrame(header=pb.Header(request_id="r", n_layers=1)))
    dec.plan(lambda layer: schema)
    for case, frame in (("undeclared name", _huge_declaring_chunk("x")),
                        ("declared name, another size", _huge_declaring_chunk("k"))):
        with pytest.raises(InvalidPayload, match="declares no tensor" if case.startswith("undeclared") else "dtype"):
            dec.feed(frame)
    frames = _stream([ok])[1:]
    for wrong in ({"k": ok["k"].float(), "v": ok["v"]}, {"k": ok["k"][:, :, :4], "v": ok["v"]}):
        dec = FrameDecoder(n_layers=1)
        dec.feed(pb.KVFrame(header=pb.Header(request_id="r", n_layers=1)))
        dec.plan(lambda layer: schema)
        with pytest.raises(InvalidPayload):
            for f in _stream([wrong])[1:]:
                dec.feed(f)
    dec = FrameDecoder(n_layers=1)
    dec.feed(pb.KVFrame(header=pb.Header(request_id="r", n_layers=1)))
    dec.plan(lambda layer: schema)
    got = [dec.feed(f) for f in frames]
    assert isinstance(got[-2], LayerReceived) and torch.equal(got[-2].tensors["v"], ok["v"])
    dec = FrameDecoder(n_layers=1)  # discard: verified and dropped (the consumer recomputes itself)
    dec.feed(pb.KVFrame(header=pb.Header(request_id="r", n_layers=1)))
    dec.plan(None, discard=True)
    got = [dec.feed(f) for f in frames]
    assert isinstance(got[-2], LayerReceived) and got[-2].tensors == {} and isinstance(got[-1], TrailerReceived)


@pytest.mark.parametrize("compression", ["zstd", "lz4", "none"])
def test_roundtrip_every_compression(compression):
    layers = _layers()
    totals = StreamTotals()
    frames = [totals.add(pb.KVFrame(header=pb.Header(request_id="r", n_layers=len(layers))))]
    for i, tensors in enumerate(layers):
        frames += [totals.add(f) for f in layer_frames(i, tensors, 300, compression=compression)]
    frames.append(totals.trailer())
    out, dec = _decode(frames)
    assert dec.done and len(out) == len(layers)
    for a, b in zip(out, layers):
        assert all(torch.equal(a[n], b[n]) for n in b)


def test_zstd_entropy_codes_small_int8_codes_that_lz4_leaves():
    """The reason zstd is the default: int8 codes concentrated near 0 (a PCA code's trailing
    components) are entropy-coded; lz4 finds no repeats in them."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2000, 64, generator=g) * torch.linspace(40, 1, 64)).round().clamp(-127, 127).to(torch.int8)
    size = {c: sum(len(f.chunk.data) for f in layer_frames(0, {"z": q}, compression=c)) for c in ("zstd", "lz4")}
    assert size["zstd"] < 0.9 * q.numel() <= size["lz4"]


def _chunk_frame(data: bytes, raw_size: int, raw: bytes, compression) -> pb.KVFrame:
    from shared.rpc.wire import chunk_crc

    c = pb.TensorChunk(name="k", layer=0, dtype="U8", shape=[raw_size], offset=0, raw_size=raw_size, data=data,
                       last=True, layer_done=True, compression=compression)
    c.crc32c = chunk_crc(c, raw)
    return pb.KVFrame(chunk=c)


def _fed(frame):
    dec = FrameDecoder()
    dec.feed(pb.KVFrame(header=pb.Header(request_id="r", n_layers=1)))
    return dec.feed(frame)


def test_a_zstd_chunk_that_inflates_beyond_its_declared_size_is_refused_without_inflating():
    """A zstd frame records its own content size, and zstandard's one-shot decompress trusts it over
    any bound: the decoder reads at most raw_size + 1 bytes from a stream instead."""
    import tracemalloc

    import zstandard

    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(200 << 20))  # 200 MiB of zeros, a few kB
    tracemalloc.start()
    try:
        with pytest.raises(DataLoss, match="decompressed to 65"):
            _fed(_chunk_frame(bomb, 64, bytes(64), pb.COMPRESSION_ZSTD))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


@pytest.mark.parametrize("data", [b"not a zstd frame", b""])
def test_a_corrupt_zstd_chunk_is_data_loss(data):
    with pytest.raises(DataLoss):
        _fed(_chunk_frame(data, 64, bytes(64), pb.COMPRESSION_ZSTD))


def test_an_unknown_compression_is_refused_by_name():
    with pytest.raises(InvalidPayload, match="compression 7 is not one of"):
        _fed(_chunk_frame(bytes(64), 64, bytes(64), 7))


def test_an_uncompressed_chunk_of_the_wrong_length_is_data_loss():
    with pytest.raises(DataLoss, match="decompressed to 63"):
        _fed(_chunk_frame(bytes(63), 64, bytes(64), pb.COMPRESSION_NONE))


def test_a_chunk_declaring_more_than_a_chunk_holds_is_refused_as_such():
    """Its raw_size would also pass the stream's bound: the chunk's own limit is what it broke."""
    import lz4.frame

    from shared.rpc.wire import chunk_crc

    raw = bytes(64)
    for declared in (2**40, (16 << 20) + 1):
        c = pb.TensorChunk(name="k", layer=0, dtype="U8", shape=[64], offset=0, raw_size=declared,
                           data=lz4.frame.compress(raw))
        c.crc32c = chunk_crc(c, raw)
        dec = FrameDecoder(limits=Limits(max_chunk_bytes=16 << 20))
        dec.feed(pb.KVFrame(header=pb.Header(request_id="r", n_layers=1)))
        with pytest.raises(InvalidPayload, match=rf"chunk declares {declared:,} bytes; a chunk carries at most "
                                                  rf"16,777,216 \(max_chunk_bytes\)"):
            dec.feed(pb.KVFrame(chunk=c))
