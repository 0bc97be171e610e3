"""Nothing of a failed stream outlives it (issue 58). The consumer's read-ahead task used to be
cancelled and left: blocked on its full queue, it held the request's decoded layers (and through them
its cache) until the garbage collector destroyed it ("Task was destroyed but it is pending!"), so the
consumer's memory grew with every stream that failed part-way. Here every kind of failing stream is
sent straight to a consumer with the collector off; afterwards no task a transfer started is alive,
the live-task gauge is back at 0, and collecting destroys no pending task."""

import gc
import logging
import threading
import time

import grpc
import pytest
import torch

from consumer_service.engine import ConsumerEngine
from consumer_service.settings import ConsumerSettings
from shared.codecs import CodecContext, make_method
from shared.model.hf_adapter import ModelAdapter
from shared.model.tiny import tiny_model
from shared.rpc import scd_pb2 as pb
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.wire import PROTOCOL_VERSION, StreamTotals, layer_frames
from tools.inprocess import InProcessServices

N_LAYERS = 12
PROMPT = torch.randint(0, 256, (97,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def consumer():
    model = tiny_model("llama", n_layers=N_LAYERS)
    s = ConsumerSettings.load(model={"path": "unused"}, server={"port": 0}, name="c", methods=["raw"],
                              read_ahead_layers=2, frame_timeout_s=1.0)
    with InProcessServices([ConsumerEngine(s, model)], None) as svc:
        yield svc, model


def _stream(model, nan_layer=None):
    ad = ModelAdapter(model)
    m = make_method("raw", CodecContext(ad))
    state = ad.prefill(PROMPT[:-1])
    totals = StreamTotals()
    out = [totals.add(pb.KVFrame(header=pb.Header(
        request_id="leak", method="raw", method_version=1, protocol_version=PROTOCOL_VERSION,
        pair_fingerprint="f:raw", n_layers=N_LAYERS, n_tokens=len(PROMPT) - 1, prompt_ids=PROMPT, consumer="c",
        sampling=pb.SamplingParams(max_new_tokens=2))))]
    for layer in range(N_LAYERS):
        tensors = m.encode_layer(state, layer, 0)
        if layer == nan_layer:
            tensors = {k: v.clone().fill_(float("nan")) for k, v in tensors.items()}
        out += [totals.add(f) for f in layer_frames(layer, tensors, chunk_bytes=4096)]
    out.append(totals.trailer())
    return out


def _held(frames, n, release: threading.Event):
    """The first ``n`` frames, then nothing until ``release`` (a sender that stalls or is cancelled)."""
    yield from frames[:n]
    release.wait(30)


def _send(address, frames, cancel_after=None):
    with grpc.insecure_channel(address) as ch:
        call = pbg.ConsumerStub(ch).Transfer(frames, timeout=30)
        if cancel_after is not None:
            threading.Timer(cancel_after, call.cancel).start()
        try:
            return "ok", list(call)
        except grpc.RpcError as e:
            return e.code().name, None


def _pending_transfer_tasks():
    import asyncio

    return [t for t in gc.get_objects() if isinstance(t, asyncio.Task) and not t.done()
            and "ConsumerEngine" in getattr(t.get_coro(), "__qualname__", "")]


def test_failing_streams_leave_no_task_and_nothing_decoded(consumer, caplog):
    svc, model = consumer
    address = svc.consumer_addresses["c"]
    metrics = svc.consumer_servers["c"].servicer.metrics
    good = _stream(model)
    mid = len(good) // 2
    flipped = [pb.KVFrame.FromString(f.SerializeToString()) for f in good]
    flipped[mid].chunk.crc32c ^= 1
    nan = _stream(model, nan_layer=N_LAYERS // 2)
    seen: dict[str, set] = {}
    gc.collect()
    gc.disable()
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(4):
                cases = {
                    "checksum": lambda: _send(address, iter(flipped)),
                    "nan": lambda: _send(address, iter(nan)),
                    "truncated": lambda: _send(address, iter(good[:mid])),
                    "stall": lambda: _send(address, _held(good, mid, threading.Event())),
                    "cancel": lambda: _send(address, _held(good, mid, threading.Event()), cancel_after=0.3),
                }
                for kind, case in cases.items():
                    seen.setdefault(kind, set()).add(case()[0])
            assert _send(address, iter(good))[0] == "ok"  # it still serves
            deadline = time.time() + 10  # the server's side of a cancelled call ends a moment after the client's
            while (_pending_transfer_tasks() or metrics.value("live_tasks")) and time.time() < deadline:
                time.sleep(0.1)
            left = _pending_transfer_tasks()
            assert not left, f"{len(left)} transfer task(s) outlived their requests: {left[:3]}"
            assert metrics.value("live_tasks") == 0
    finally:
        gc.enable()
    with caplog.at_level(logging.WARNING):
        gc.collect()
    assert seen == {"checksum": {"DATA_LOSS"}, "nan": {"DATA_LOSS"}, "truncated": {"INVALID_ARGUMENT"},
                    "stall": {"DEADLINE_EXCEEDED"}, "cancel": {"CANCELLED"}}
    destroyed = [r.getMessage() for r in caplog.records if "destroyed but it is pending" in r.getMessage()
                 or "different event loop" in r.getMessage()]
    assert not destroyed, destroyed[:3]
    assert metrics.value("process_resident_memory_bytes") > 0  # the operator's view of the same


def test_every_kind_of_the_soaks_failing_streams_gets_its_answer_and_leaves_nothing(consumer):
    """``scd soak --faults`` sends these beside its good traffic and fails on any other answer: each
    kind once here, against the tiny consumer, which then holds no task and still serves."""
    import random

    from shared.model.fingerprint import weights_fingerprint
    from tools.soak_faults import EXPECTED, KINDS, FaultyStreams, Shape

    svc, model = consumer
    address = svc.consumer_addresses["c"]
    metrics = svc.consumer_servers["c"].servicer.metrics
    cfg = model.config
    shape = Shape("c", N_LAYERS, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                  weights_fingerprint(model))
    faulty = FaultyStreams(shape, address, random.Random(0), stall_s=1.0, n_tokens=40)
    got = {kind: faulty.send(kind) for kind in KINDS}
    assert {k: o for k, (o, _) in got.items()} == EXPECTED, got
    assert _send(address, iter(_stream(model)))[0] == "ok"
    deadline = time.time() + 10
    while (_pending_transfer_tasks() or metrics.value("live_tasks")) and time.time() < deadline:
        time.sleep(0.1)
    assert not _pending_transfer_tasks() and metrics.value("live_tasks") == 0
