"""``scd soak --faults``: streams that fail part-way, sent straight to the consumer beside the soak's
good traffic, each with the one answer a healthy consumer gives it (issue 58: the consumer's memory
grew with every stream that failed part-way). Every kind starts as a valid ``raw`` stream of the pair's
shape (the frame decoder, the read-ahead and the reconstruction are the same for every method; the
producer's side of each method is soaked by the good traffic and its cancellations):

==============  ==============================================================  ===================
kind            what the sender does                                            answer
==============  ==============================================================  ===================
checksum        one chunk's CRC flipped in the middle of the stream             DATA_LOSS
nan             one layer's values NaN (valid checksums)                        DATA_LOSS
truncated       ends half-way, no trailer                                       INVALID_ARGUMENT
stall           stops sending half-way and keeps the call open                  DEADLINE_EXCEEDED
cancel          cancels its call half-way                                       (the client's own)
killed          a sender process killed (SIGKILL) half-way                      (the consumer frees)
oversized       a chunk that declares more than a chunk may hold                INVALID_ARGUMENT
undeclared      a tensor the method does not send                               INVALID_ARGUMENT
==============  ==============================================================  ===================
"""

from __future__ import annotations

import math
import random
import struct
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

KINDS = ("checksum", "nan", "truncated", "stall", "cancel", "killed", "oversized", "undeclared")
EXPECTED = {"checksum": "data_loss", "nan": "data_loss", "truncated": "invalid_argument",
            "stall": "deadline_exceeded", "cancel": "cancelled", "killed": "killed", "oversized": "invalid_argument",
            "undeclared": "invalid_argument"}
"""The outcome each kind must have (``killed``: the sender was killed after its frames arrived)."""
SENDER = Path(__file__).with_name("frame_sender.py")


@dataclass(frozen=True)
class Shape:
    """What a consumer checks of a raw stream: its name, depth, K/V shape and producer fingerprint."""

    consumer: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    producer_fingerprint: str

    @classmethod
    def of_pair(cls, pair: str) -> Shape:
        from tools.assets import registry

        e = registry.get(pair)
        return cls(pair, e.n_layers, e.n_kv_heads, e.head_dim, e.producer_fingerprint)


class FaultyStreams:
    """Streams of ``shape``, prompt of ``n_tokens``, to the consumer at ``address``."""

    def __init__(self, shape: Shape, address: str, rng: random.Random, stall_s: float, n_tokens: int = 64):
        import torch

        from shared.rpc import scd_pb2 as pb
        from shared.rpc.wire import PROTOCOL_VERSION, StreamTotals, layer_frames

        e, pair = shape, shape.consumer
        self.address, self.rng, self.stall_s = address, rng, stall_s
        self.n_layers = e.n_layers

        def build(nan_layer: int | None = None, extra: bool = False) -> list:
            totals = StreamTotals()
            out = [totals.add(pb.KVFrame(header=pb.Header(
                request_id="soak-fault", method="raw", method_version=1, protocol_version=PROTOCOL_VERSION,
                pair_fingerprint=f"{e.producer_fingerprint}:raw", n_layers=e.n_layers, n_tokens=n_tokens,
                prompt_ids=list(range(1, n_tokens + 2)), consumer=pair, sampling=pb.SamplingParams(max_new_tokens=2))))]
            g = torch.Generator().manual_seed(len(out))
            for layer in range(e.n_layers):
                kv = torch.randn(1, e.n_kv_heads, n_tokens, e.head_dim, generator=g).to(torch.float16)
                tensors = {"k": kv, "v": kv}
                if layer == nan_layer:
                    tensors = {"k": kv.clone().fill_(math.nan), "v": kv}
                if extra and layer == e.n_layers // 2:
                    tensors["x"] = kv
                out += [totals.add(f) for f in layer_frames(layer, tensors)]
            out.append(totals.trailer())
            return out

        self.good = build()
        self.nan = build(nan_layer=e.n_layers // 2)
        self.undeclared = build(extra=True)
        self.mid = len(self.good) // 2
        self.flip = [pb.KVFrame.FromString(f.SerializeToString()) for f in self.good]
        self.flip[self.mid].chunk.crc32c ^= 1
        self.over = [pb.KVFrame.FromString(f.SerializeToString()) for f in self.good[: self.mid]]
        self.over[-1].chunk.raw_size = 1 << 40  # declared: more than a chunk, a tensor or a stream may hold
        self._file = Path(tempfile.mkdtemp(prefix="scd-soak-faults-")) / "frames.bin"
        self._file.write_bytes(b"".join(struct.pack("<I", f.ByteSize()) + f.SerializeToString()
                                        for f in self.good[: self.mid]))

    def _held(self, frames: list, release: threading.Event):
        yield from frames
        release.wait(self.stall_s * 4)

    def send(self, kind: str) -> tuple[str, str]:
        """(outcome, the consumer's message) of one stream of ``kind``."""
        if kind == "killed":
            return self._killed()
        frames = {"checksum": self.flip, "nan": self.nan, "truncated": self.good[: self.mid],
                  "oversized": self.over, "undeclared": self.undeclared}.get(kind)
        release = threading.Event()
        source = iter(frames) if frames is not None else self._held(self.good[: self.mid], release)
        from shared.rpc import scd_pb2_grpc as pbg

        try:
            with grpc.insecure_channel(self.address) as ch:
                call = pbg.ConsumerStub(ch).Transfer(source, timeout=self.stall_s * 4)
                timer = threading.Timer(0.2 + self.rng.random() * 0.3, call.cancel) if kind == "cancel" else None
                if timer is not None:
                    timer.start()
                try:
                    list(call)
                    return "answered (wrong)", ""
                except grpc.RpcError as e:
                    return e.code().name.lower(), e.details() or ""
                finally:
                    if timer is not None:
                        timer.cancel()
        finally:
            release.set()

    def _killed(self) -> tuple[str, str]:
        proc = subprocess.Popen([sys.executable, str(SENDER), self.address, str(self._file)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        try:
            line = (proc.stdout.readline() if proc.stdout else "").strip()
            outcome = "killed" if line == "SENT" else line or f"the sender exited first ({proc.wait(10)})"
        finally:
            proc.kill()
            proc.wait(10)
        return outcome, ""
