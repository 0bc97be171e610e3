"""Named tensors <-> ``KVFrame`` messages: the only code that converts payloads to protobuf.

A request's stream is: one ``Header``, then per layer in increasing order the chunks of that
layer's tensors (each tensor's bytes split into chunks of at most ``CHUNK_BYTES`` before
compression, compressed as the chunk says: zstd by default, lz4 or none; crc32c of the uncompressed
bytes), the last chunk of a layer flagged ``layer_done``, then one ``Trailer`` with totals and a
checksum over the chunk checksums.

``FrameDecoder`` validates everything before it allocates: a chunk must belong to a tensor the
method declares for that layer (``plan``), sizes are bounded, offsets must be contiguous,
checksums must match; only verified bytes are kept (nothing is allocated for what a chunk merely
declares); a violation raises ``InvalidPayload`` or ``DataLoss`` and no partial tensor ever
escapes.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass, field
from typing import Callable, Iterator

import google_crc32c
import lz4.frame
import torch
import zstandard

from shared.domain import HeaderReceived, LayerReceived, Schema, StreamEvent, StreamHeader, TrailerReceived
from shared.errors import DataLoss, InvalidPayload
from shared.rpc import scd_pb2 as pb
from shared.rpc.convert import header_from_pb, header_to_pb

PROTOCOL_VERSION = 1
CHUNK_BYTES = 1 << 20  # uncompressed bytes per chunk; the compressed message stays under ~1 MiB
MAX_MESSAGE_BYTES = 4 << 20  # gRPC max send/receive message length set on both sides

DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

COMPRESSIONS = {"lz4": pb.COMPRESSION_LZ4, "zstd": pb.COMPRESSION_ZSTD, "none": pb.COMPRESSION_NONE}
"""Chunk compressions by setting name. zstd (level 1) entropy-codes the int8 codes, which lz4's
byte matching leaves as they are: ~25% fewer bytes for SCD's codes at a few ms per MB."""
DEFAULT_COMPRESSION = "zstd"
_ZSTD = zstandard.ZstdCompressor(level=1)


def compress(data: bytes, how: int) -> bytes:
    if how == pb.COMPRESSION_ZSTD:
        return _ZSTD.compress(data)
    if how == pb.COMPRESSION_LZ4:
        return lz4.frame.compress(data)
    return data


def decompress(data: bytes, how: int, raw_size: int) -> bytes:
    """A chunk's bytes, never more than ``raw_size + 1`` of them (a chunk that inflates beyond what
    it declares is caught by the length check, not allocated)."""
    if how == pb.COMPRESSION_ZSTD:  # read through a stream: ``decompress`` would trust the frame's own size
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as r:
            parts, want = [], raw_size + 1
            while want > 0 and (part := r.read(want)):
                parts.append(part)
                want -= len(part)
        return b"".join(parts)
    if how == pb.COMPRESSION_LZ4:
        return lz4.frame.LZ4FrameDecompressor().decompress(data, max_length=raw_size + 1)
    if how == pb.COMPRESSION_NONE:
        return data
    raise InvalidPayload(f"chunk compression {how} is not one of {sorted(COMPRESSIONS)} "
                         f"({sorted(COMPRESSIONS.values())})")


def crc32c(data: bytes) -> int:
    return google_crc32c.value(data)


def chunk_crc(c: pb.TensorChunk, raw: bytes) -> int:
    """crc32c over the chunk's metadata and its uncompressed bytes: a flipped name, layer, shape
    or offset is caught like a flipped data byte."""
    meta = f"{c.name}|{c.layer}|{c.dtype}|{list(c.shape)}|{c.offset}|{c.raw_size}|{c.last}|{c.layer_done}"
    return google_crc32c.extend(crc32c(meta.encode()), raw)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def tensor_chunks(
    name: str, layer: int, t: torch.Tensor, chunk_bytes: int = CHUNK_BYTES, compression: str = DEFAULT_COMPRESSION
) -> Iterator[tuple[pb.TensorChunk, bytes]]:
    """(chunk without its checksum, its uncompressed bytes) for each piece of ``t``."""
    how = COMPRESSIONS[compression]
    if t.dtype not in DTYPE_NAMES:
        raise InvalidPayload(f"tensor {name!r} has dtype {t.dtype}; expected one of {sorted(DTYPES)}")
    raw = tensor_bytes(t)
    n = max(1, math.ceil(len(raw) / chunk_bytes))
    for i in range(n):
        part = raw[i * chunk_bytes : (i + 1) * chunk_bytes]
        yield pb.TensorChunk(
            name=name, layer=layer, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape), offset=i * chunk_bytes,
            raw_size=len(part), data=compress(part, how), last=i == n - 1, compression=how,
        ), part


def header_frame(h: StreamHeader) -> pb.KVFrame:
    return pb.KVFrame(header=header_to_pb(h))


def layer_frames(layer: int, tensors: dict[str, torch.Tensor], chunk_bytes: int = CHUNK_BYTES,
                 compression: str = DEFAULT_COMPRESSION) -> list[pb.KVFrame]:
    """Frames of one layer (``compression``: one of ``COMPRESSIONS``); the last one is flagged ``layer_done``."""
    pieces = [p for name, t in tensors.items() for p in tensor_chunks(name, layer, t, chunk_bytes, compression)]
    if not pieces:
        raise InvalidPayload(f"layer {layer} has no tensors")
    pieces[-1][0].layer_done = True
    for c, raw in pieces:  # the checksum covers the final metadata, layer_done included
        c.crc32c = chunk_crc(c, raw)
    return [pb.KVFrame(chunk=c) for c, _ in pieces]


@dataclass
class StreamTotals:
    """Running totals on the sending side, for the trailer."""

    n_chunks: int = 0
    payload_bytes: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0
    _crcs: bytearray = field(default_factory=bytearray)

    def add(self, frame: pb.KVFrame) -> pb.KVFrame:
        self.wire_bytes += frame.ByteSize()
        if frame.HasField("chunk"):
            c = frame.chunk
            self.n_chunks += 1
            self.payload_bytes += len(c.data)
            self.raw_bytes += c.raw_size
            self._crcs += struct.pack("<I", c.crc32c)
        return frame

    def trailer(self, encode_ms: float = 0.0, prefill_ms: float = 0.0) -> pb.KVFrame:
        return pb.KVFrame(trailer=pb.Trailer(
            n_chunks=self.n_chunks, payload_bytes=self.payload_bytes, raw_bytes=self.raw_bytes,
            crc32c=crc32c(bytes(self._crcs)), encode_ms=encode_ms, prefill_ms=prefill_ms,
        ))


@dataclass(frozen=True)
class Limits:
    max_tensor_bytes: int = 256 << 20
    max_chunk_bytes: int = CHUNK_BYTES
    max_layers: int = 1024
    max_tensors_per_layer: int = 64
    max_ndim: int = 6
    max_stream_bytes: int = 4 << 30  # uncompressed payload bytes of one stream


class _Partial:
    """A tensor being received: its verified chunks so far (only bytes that arrived and passed
    their checksum are held; the whole tensor is assembled once, when its layer closes)."""

    __slots__ = ("dtype", "shape", "nbytes", "chunks", "filled")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int):
        self.dtype, self.shape, self.nbytes = dtype, shape, nbytes
        self.chunks: list[bytes] = []
        self.filled = 0

    def tensor(self) -> torch.Tensor:
        if not self.nbytes:
            return torch.empty(self.shape, dtype=self.dtype)
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks = []
        return torch.frombuffer(bytearray(data), dtype=self.dtype).reshape(self.shape)


class FrameDecoder:
    """Consumer-side state machine over one request's frames.

    ``feed(frame)`` returns ``HeaderReceived`` for the header, ``LayerReceived`` when a layer is
    complete, ``TrailerReceived`` at the end, or ``None`` for a chunk inside a layer.

    Once the receiver has read the header it calls ``plan``: with the method's schema, a chunk of
    a tensor the layer does not declare, or declared with another dtype or shape, is refused
    before anything is kept; with ``discard`` (the receiver recomputes the prefill itself) chunks
    are verified and dropped."""

    def __init__(self, limits: Limits = Limits(), n_layers: int | None = None):
        self.limits, self.n_layers = limits, n_layers
        self.header: StreamHeader | None = None
        self.layer = 0  # the layer whose chunks are arriving
        self.done = False
        self._tensors: dict[str, _Partial] = {}
        self._totals = StreamTotals()
        self._schema: Callable[[int], Schema] | None = None
        self._discard = False
        self._layer_schema: tuple[int, Schema] | None = None

    def plan(self, schema: Callable[[int], Schema] | None, discard: bool = False) -> None:
        """What the stream must carry: ``schema(layer)`` gives each layer's declared tensors."""
        self._schema, self._discard = schema, discard

    def _declared(self, layer: int) -> Schema | None:
        if self._schema is None:
            return None
        if self._layer_schema is None or self._layer_schema[0] != layer:
            self._layer_schema = (layer, self._schema(layer))
        return self._layer_schema[1]

    def close(self) -> None:
        """Drop every partial tensor (on any exit path)."""
        self._tensors = {}

    def feed(self, frame: pb.KVFrame) -> StreamEvent | None:
        kind = frame.WhichOneof("body")
        if self.done:  # the trailer ends the stream: nothing may follow it
            what = f"a {kind} frame" if kind else "an empty frame"
            raise InvalidPayload(f"a frame arrived after the trailer ({what}); the trailer must be the last frame of "
                                 "a request's stream")
        if kind is None:
            raise InvalidPayload("empty frame: expected a header, chunk or trailer")
        if kind == "header":
            if self.header is not None:
                raise InvalidPayload("a second header arrived; one request carries one header")
            if frame.header.n_layers > self.limits.max_layers:
                raise InvalidPayload(f"header declares {frame.header.n_layers} layers; at most "
                                     f"{self.limits.max_layers}")
            d = frame.header.deadline_unix  # NaN compares false with everything: no deadline check would fire
            if not math.isfinite(d) or d < 0:
                raise InvalidPayload(f"header deadline_unix={d!r}: it must be a finite unix time in seconds (the "
                                     "request's absolute deadline, e.g. time.time() + its timeout), or 0 for none",
                                     param="deadline_unix")
            self.header = header_from_pb(frame.header)
            return HeaderReceived(self.header)
        if self.header is None:
            raise InvalidPayload(f"a {kind} arrived before the header; the header must come first")
        if kind == "trailer":
            self._trailer(frame.trailer)
            return TrailerReceived()
        c, lim = frame.chunk, self.limits
        if c.raw_size > lim.max_chunk_bytes:  # one chunk's own bound before the stream's (which it would also pass)
            raise InvalidPayload(f"tensor {_clip(c.name)} chunk declares {c.raw_size:,} bytes; a chunk carries at most "
                                 f"{lim.max_chunk_bytes:,} (max_chunk_bytes)")
        self._totals.add(frame)
        if self._totals.raw_bytes > self.limits.max_stream_bytes:  # bounded before anything is allocated
            raise InvalidPayload(f"stream carries more than {self.limits.max_stream_bytes:,} payload bytes "
                                 "(max_stream_bytes)")
        return self._chunk(frame.chunk)

    def _chunk(self, c: pb.TensorChunk):
        lim = self.limits
        assert self.header is not None  # feed() refuses chunks before the header
        n_layers = self.n_layers if self.n_layers is not None else self.header.n_layers
        if c.layer != self.layer:
            raise InvalidPayload(f"chunk for layer {c.layer} arrived while layer {self.layer} was open; "
                                 "layers must arrive in order, each complete")
        if c.layer >= n_layers:
            raise InvalidPayload(f"chunk for layer {c.layer}; the model has {n_layers} layers")
        if not c.name or len(c.name) > 64:
            raise InvalidPayload(f"tensor name must be 1 to 64 characters; got {len(c.name)}")
        if c.dtype not in DTYPES:
            raise InvalidPayload(f"tensor {c.name!r} has dtype {_clip(c.dtype, 16)}; expected one of {sorted(DTYPES)}")
        if not 0 < len(c.shape) <= lim.max_ndim or any(d < 0 for d in c.shape):
            raise InvalidPayload(f"tensor {c.name!r} has invalid shape {list(c.shape)[:8]} ({len(c.shape)} dimensions; "
                                 f"1 to {lim.max_ndim}, none negative)")
        dtype = DTYPES[c.dtype]
        declared = self._declared(c.layer)
        if declared is not None and not self._discard:
            spec = declared.get(c.name)
            if spec is None:
                raise InvalidPayload(f"layer {c.layer} declares no tensor {_clip(c.name)}; it carries "
                                     f"{sorted(declared)[:16]}")
            why = spec.mismatch(dtype, tuple(c.shape))
            if why:
                raise InvalidPayload(f"layer {c.layer} tensor {c.name!r}: {why}")
        nbytes = math.prod(c.shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes > lim.max_tensor_bytes:
            raise InvalidPayload(f"tensor {c.name!r} declares {nbytes} bytes; the limit is {lim.max_tensor_bytes}")
        part = self._tensors.get(c.name)
        if part is None:
            if len(self._tensors) >= lim.max_tensors_per_layer:
                raise InvalidPayload(f"layer {c.layer} carries more than {lim.max_tensors_per_layer} tensors")
            part = self._tensors[c.name] = _Partial(dtype, tuple(c.shape), nbytes)
        elif part.dtype != dtype or part.shape != tuple(c.shape):
            raise InvalidPayload(f"tensor {c.name!r} changed dtype or shape between chunks")
        if c.offset != part.filled:
            raise InvalidPayload(f"tensor {c.name!r} chunk at offset {c.offset}; expected offset {part.filled}")
        if c.offset + c.raw_size > part.nbytes:
            raise InvalidPayload(f"tensor {c.name!r} chunk overruns its declared size {part.nbytes}")
        try:
            raw = decompress(c.data, c.compression, c.raw_size)
        except (RuntimeError, zstandard.ZstdError) as e:
            raise DataLoss(f"tensor {c.name!r} chunk at offset {c.offset} does not decompress: {e}") from None
        if len(raw) != c.raw_size:
            raise DataLoss(f"tensor {c.name!r} chunk decompressed to {len(raw)} bytes; header says {c.raw_size}")
        if chunk_crc(c, raw) != c.crc32c:
            raise DataLoss(f"tensor {c.name!r} chunk at offset {c.offset} failed its crc32c check")
        if not self._discard:
            part.chunks.append(raw)
        part.filled += c.raw_size
        if not c.layer_done:
            return None
        missing = [n for n, p in self._tensors.items() if p.filled != p.nbytes]
        if missing:
            raise InvalidPayload(f"layer {c.layer} closed with incomplete tensors {missing}")
        parts, self._tensors = self._tensors, {}
        tensors = {} if self._discard else {n: p.tensor() for n, p in parts.items()}
        self.layer += 1
        return LayerReceived(c.layer, tensors)

    def _trailer(self, t: pb.Trailer) -> pb.Trailer:
        if self._tensors:
            raise InvalidPayload(f"trailer arrived inside layer {self.layer}; its tensors are incomplete")
        expect = self._totals.trailer()
        got = (t.n_chunks, t.payload_bytes, t.raw_bytes)
        have = (expect.trailer.n_chunks, expect.trailer.payload_bytes, expect.trailer.raw_bytes)
        if got != have:
            raise DataLoss(f"trailer counts {got[0]} chunks / {got[1]} bytes ({got[2]} uncompressed); received "
                           f"{have[0]} / {have[1]} ({have[2]}): frames were lost")
        if t.crc32c != expect.trailer.crc32c:
            raise DataLoss("trailer checksum does not match the chunks received")
        self.done = True
        return t


def _clip(text: str, n: int = 64) -> str:
    """A peer's string quoted in an error message, bounded."""
    return repr(text) if len(text) <= n else repr(text[:n]) + f"... ({len(text)} characters)"
