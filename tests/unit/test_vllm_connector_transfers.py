"""The vLLM connector's two ends without vLLM (integrations/vllm_connector/transfers.py): a producer's
stream over real gRPC into a consumer engine's receiver, on the tiny pair; what the receiver refuses."""

import contextlib

import grpc
import pytest
import torch

from integrations.vllm_connector.engine_model import EngineModel
from integrations.vllm_connector.transfers import (
    Outgoing,
    Receiver,
    TransferFailed,
    check_method,
    make_header,
    prompt_key,
    serve_receiver,
)
from shared.codecs import CodecContext, make_method
from shared.errors import UnknownMethod
from shared.model.hf_adapter import ModelAdapter
from shared.rpc import scd_pb2 as pb
from shared.rpc import scd_pb2_grpc as pbg

IDS = list(range(3, 3 + 41))  # 40 transferred positions and the one the consumer computes


@pytest.fixture(scope="module")
def ends(tiny_pair):
    producer, consumer = tiny_pair
    pm, cm = EngineModel(producer.config), EngineModel(consumer.config)
    receiver = Receiver(cm, CodecContext(cm))
    server, port = serve_receiver(receiver, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield producer, pm, receiver, pbg.KVReceiverStub(channel)
    channel.close()
    server.stop(0)


def send(producer: ModelAdapter, pm: EngineModel, stub, kind="raw", params=None, corrupt_layer=None, ids=IDS):
    """A producer engine's transfer: the prefill's K/V as a paged cache holds them (rotated), un-rotated
    by the connector and encoded layer by layer."""
    method = make_method(kind, CodecContext(pm), params)
    state = producer.prefill(ids[:-1])
    out = Outgoing(stub, method, make_header(method, "fp-producer", prompt_key(ids[:-1]), ids, pm.n_layers, 30), 30)
    if corrupt_layer is not None:  # flip one byte of one chunk of that layer, after its checksum was taken
        real = out._q.put

        def put(frame):
            if frame is not None and frame.WhichOneof("body") == "chunk" and frame.chunk.layer == corrupt_layer:
                data = bytearray(frame.chunk.data)
                data[len(data) // 2] ^= 0x40
                frame.chunk.data = bytes(data)
            real(frame)

        out._q.put = put
    for layer in range(pm.n_layers):
        paged = pm.apply_rope(state.keys[layer])  # what the producer engine's cache holds
        out.add_layer(layer, pm.remove_rope(paged), state.values[layer])
    return out.close(30), state


def test_engine_model_rope_matches_the_adapter_and_inverts(tiny_pair):
    producer, _ = tiny_pair
    em = EngineModel(producer.config)
    k = torch.randn(1, em.n_kv_heads, 17, em.head_dim)
    torch.testing.assert_close(em.apply_rope(k, 5), producer.apply_rope(k, 5))
    torch.testing.assert_close(em.remove_rope(em.apply_rope(k, 5), 5), k, atol=1e-5, rtol=1e-5)


def test_raw_arrives_layer_by_layer_as_the_producers_own_kv(ends):
    producer, pm, receiver, stub = ends
    reply, state = send(producer, pm, stub)
    assert reply.layers == pm.n_layers and reply.wire_bytes > 0
    key = prompt_key(IDS[:-1])
    (entry,) = receiver.lookup([key, "0" * 32])  # keys it does not hold are absent
    assert (entry.state, entry.n_tokens) == ("ready", len(IDS) - 1)
    t = receiver.claim(key)
    for layer in range(pm.n_layers):
        k, v = t.layer(layer, 1.0)  # [T, H, D], rotated: what the consumer's paged cache must hold
        want_k = pm.apply_rope(state.keys[layer].half().float())[0].transpose(0, 1)
        torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, state.values[layer].half().float()[0].transpose(0, 1))
    receiver.done(key)  # kept for later prompts with the same prefix
    assert [e.state for e in receiver.lookup([key])] == ["ready"]
    receiver.release(key)
    assert receiver.lookup([key]) == []


def test_quant_is_within_its_bound(ends):
    producer, pm, receiver, stub = ends
    ids = IDS[:30]
    send(producer, pm, stub, "quant", {"bits": "8"}, ids=ids)
    t = receiver.claim(prompt_key(ids[:-1]))
    state = producer.prefill(ids[:-1])
    k, _ = t.layer(2, 1.0)
    want = pm.apply_rope(state.keys[2])[0].transpose(0, 1)
    assert float((k - want).norm() / want.norm()) < 0.02
    receiver.release(t.key)


def test_a_corrupted_byte_fails_the_transfer_and_nothing_of_it_is_served(ends):
    producer, pm, receiver, stub = ends
    ids = IDS[:25]
    with pytest.raises(grpc.RpcError) as e:
        send(producer, pm, stub, corrupt_layer=2, ids=ids)
    assert e.value.code() == grpc.StatusCode.DATA_LOSS and "crc32c" in e.value.details()
    (entry,) = receiver.lookup([prompt_key(ids[:-1])])
    assert entry.state == "failed" and "crc32c" in entry.error
    t = receiver.claim(entry.key)
    assert t.layers == {}  # the layers decoded before the bad one are dropped too
    with pytest.raises(TransferFailed):
        t.layer(0, 0.1)
    receiver.release(entry.key)


def test_the_receiver_refuses_what_it_cannot_check(ends):
    producer, pm, receiver, stub = ends
    method = make_method("raw", CodecContext(pm))
    h = make_header(method, "fp", "0" * 32, IDS, pm.n_layers, 30)  # a request_id that is not the prompt's key
    from shared.rpc.wire import header_frame

    with pytest.raises(grpc.RpcError) as e:
        stub.Push(iter([header_frame(h)]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_key" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # frames before a header
        stub.Push(iter([pb.KVFrame(trailer=pb.Trailer())]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "header" in e.value.details()
    with pytest.raises(UnknownMethod, match="PATCH block"):
        check_method("scd")
    with pytest.raises(UnknownMethod, match="runs"):
        check_method("magic")


@contextlib.contextmanager
def receiving(tiny_pair, **settings):
    """A receiver with ``settings`` on a free port: (producer, its engine model, receiver, stub)."""
    producer, consumer = tiny_pair
    pm, cm = EngineModel(producer.config), EngineModel(consumer.config)
    receiver = Receiver(cm, CodecContext(cm), **settings)
    server, port = serve_receiver(receiver, "127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield producer, pm, receiver, pbg.KVReceiverStub(ch)
    finally:
        server.stop(0)


def test_a_pinned_producer_fingerprint_is_enforced(tiny_pair):
    with receiving(tiny_pair, producer_fingerprint="fp-right") as (producer, pm, _, stub), \
            pytest.raises(grpc.RpcError) as e:
        send(producer, pm, stub, ids=IDS[:12])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "fp-right" in e.value.details()


def test_the_held_bytes_are_bounded(tiny_pair):
    """A transfer over the whole budget is the sender's to fix (INVALID_ARGUMENT), and evicts nothing:
    it was RESOURCE_EXHAUSTED (retry later) after dropping every transfer held."""
    cm = EngineModel(tiny_pair[1].config)
    one = 2 * cm.n_layers * 20 * cm.kv_dim * 4  # the decoded bytes of a 20-position transfer
    prompts = [[7 + i] * 21 for i in range(2)]
    with receiving(tiny_pair, max_bytes=2 * one) as (producer, pm, receiver, stub):
        for p in prompts:
            send(producer, pm, stub, ids=p)
        with pytest.raises(grpc.RpcError) as e:
            send(producer, pm, stub, ids=list(range(3, 3 + 46)))  # 45 positions: over twice one
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "over the receiver's whole budget" in e.value.details() and "max_held_bytes" in e.value.details()
        assert len(receiver.lookup([prompt_key(p[:-1]) for p in prompts])) == 2  # both still held
        receiver.claim(prompt_key(prompts[0][:-1]))
        receiver.claim(prompt_key(prompts[1][:-1]))  # both being loaded: nothing can make room
        with pytest.raises(grpc.RpcError) as e:
            send(producer, pm, stub, ids=[9] * 21)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry when a load ends" in e.value.details()
        assert len(receiver.lookup([prompt_key(p[:-1]) for p in prompts])) == 2


def test_a_transfer_being_loaded_is_not_replaced_by_a_second_push(tiny_pair):
    """The second push took its place: the old one's bytes stopped counting while its load read them, and
    that load's release() dropped the new, good transfer. Two loads of one prompt (two requests that
    start with it): the first one's end made it replaceable (and evictable) while the second read it."""
    ids = [5] * 21
    key = prompt_key(ids[:-1])
    with receiving(tiny_pair) as (producer, pm, receiver, stub):
        send(producer, pm, stub, ids=ids)
        first = receiver.claim(key)
        with pytest.raises(grpc.RpcError) as e:
            send(producer, pm, stub, ids=ids)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "being loaded" in e.value.details()
        assert receiver.claim(key) is first and first.state == "ready"  # a second load of the same prompt
        receiver.done(key)
        with pytest.raises(grpc.RpcError) as e:  # the second load still reads it
            send(producer, pm, stub, ids=ids)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "being loaded" in e.value.details()
        receiver.release(key)  # the second load failed: nobody reads it now, and it is dropped
        assert receiver.lookup([key]) == []
        send(producer, pm, stub, ids=ids)  # a newer push is held
        second = receiver.claim(key)
        assert second is not first and second.state == "ready"
        receiver.claim(key)
        receiver.release(key)  # one of two loads failed: the other's transfer stays
        assert receiver.claim(key) is second


def test_held_transfers_make_room_least_recently_used_first(tiny_pair):
    cm = EngineModel(tiny_pair[1].config)
    one = 2 * cm.n_layers * 20 * cm.kv_dim * 4  # the decoded bytes of a 20-position transfer
    prompts = [[7 + i] * 21 for i in range(3)]
    with receiving(tiny_pair, max_bytes=2 * one) as (producer, pm, receiver, stub):
        send(producer, pm, stub, ids=prompts[0])
        send(producer, pm, stub, ids=prompts[1])
        receiver.claim(prompt_key(prompts[0][:-1]))  # a load of the first is under way: it must stay
        send(producer, pm, stub, ids=prompts[2])  # evicts the second, the least recently used unclaimed
        held = {e.key for e in receiver.lookup([prompt_key(p[:-1]) for p in prompts])}
    assert held == {prompt_key(prompts[0][:-1]), prompt_key(prompts[2][:-1])}


def test_a_stalled_stream_is_cut_and_its_transfer_fails(tiny_pair):
    import threading
    import time

    from shared.rpc.wire import header_frame

    release = threading.Event()
    with receiving(tiny_pair, frame_timeout_s=0.5) as (_, pm, receiver, stub):
        method = make_method("raw", CodecContext(pm))
        h = make_header(method, "fp", prompt_key(IDS[:-1]), IDS, pm.n_layers, 30)

        def frames():  # the header, then nothing: a producer that hangs mid-stream
            yield header_frame(h)
            release.wait(10)

        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError):
            stub.Push(frames(), timeout=10)
        assert time.monotonic() - t0 < 5  # cut at ~0.5 s, not at the client's 10 s deadline
        release.set()
        end = time.monotonic() + 5  # the receiver's thread sees the cut as its read returns
        while receiver.lookup([h.request_id])[0].state == "receiving" and time.monotonic() < end:
            time.sleep(0.05)
        (entry,) = receiver.lookup([h.request_id])
    assert entry.state == "failed"
    assert receiver.counters["pushes_failed"] >= 1


def test_a_push_to_a_wrong_address_says_what_answers_there(tiny_pair, monkeypatch):
    """The producer engine logged gRPC's transport words ("Socket closed", "Failed parsing HTTP/2",
    "Method not found!") for a consumer address that is an HTTP port or another service."""
    import http.server
    import socket
    import threading
    from concurrent import futures

    from integrations.vllm_connector import transfers

    producer, _ = tiny_pair
    pm = EngineModel(producer.config)
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    other = grpc.server(futures.ThreadPoolExecutor(1))  # gRPC, but no scd.v1.KVReceiver
    other_port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    doctor, probes = transfers.AddressDoctor(), []
    real = transfers.socket_problem
    monkeypatch.setattr(transfers, "socket_problem", lambda *a, **k: probes.append(a[0]) or real(*a, **k))
    try:
        for port, said in [(web.server_address[1], "is an HTTP/1 server (the consumer engine's HTTP port?)"),
                           (closed, "refuses connections: nothing listens there (is the consumer engine running"),
                           (other_port, "is a gRPC server without scd.v1.KVReceiver")]:
            address = f"127.0.0.1:{port}"
            with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as ei:
                send(producer, pm, pbg.KVReceiverStub(ch))
            for _ in range(2):  # the second failure at the address is said from the first probe
                got = doctor.explain(address, ei.value)
                assert got.startswith(f"{address} {said}") and ei.value.code().name in got, got
            assert probes.count(address) == 1
    finally:
        web.shutdown()
        other.stop(0)
