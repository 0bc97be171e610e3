"""The front doors' limits beyond a request's fields: a body that stops arriving, and what a gRPC
tool (grpcurl) can ask a running service."""

from __future__ import annotations

import grpc
import httpx2 as httpx
import pytest
from ops_common import MD, TOKEN

H = {"Authorization": f"Bearer {TOKEN}"}


def test_a_body_that_stops_arriving_is_408_and_its_connection_closed(svc, base, tok):
    """A client that sends its headers and part of the body, then nothing, held the connection (and
    a coroutine) for as long as it liked: a few thousand such sockets would take the front down."""
    import socket
    import time

    from producer_service.engine import ProducerEngine
    from producer_service.settings import ProducerSettings
    from tools.inprocess import InProcessServices

    def make_producer(addresses):
        s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, http={"port": 0},
                                  http_body_timeout_s=1.0, default_method="raw", security={"token": TOKEN},
                                  consumers={"chat": {"address": svc.consumer_addresses["chat"]}}, health_probe_s=0)
        return ProducerEngine(s, base, tok)

    with InProcessServices([], make_producer) as s:
        port = s.producer_server.http.port
        with socket.create_connection(("127.0.0.1", port), timeout=20) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: 200\r\n\r\n{\"model\":")
            t0, got = time.monotonic(), b""
            while chunk := c.recv(4096):  # read to the end: the server closes the connection
                got += chunk
            waited = time.monotonic() - t0
        assert got.startswith(b"HTTP/1.1 408") and b"http_body_timeout_s" in got, got[:400]
        assert waited < 15, waited
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers=H, timeout=60,  # and it still serves
                       json={"model": "chat", "prompt": "hi there", "max_tokens": 2})
        assert r.status_code == 200, r.text[:300]
        slow = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,  # in pieces, in time:
                          headers={**H, "content-type": "application/json"},
                          content=_slowly(b'{"model": "chat", "prompt": "hi there", "max_tokens": 2}', 0.1))  # read
        assert slow.status_code == 200, slow.text[:300]


def _slowly(data: bytes, pause: float):
    import time

    for i in range(0, len(data), 8):
        time.sleep(pause)
        yield data[i:i + 8]


# ---------------------------------------------------------------------------- gRPC server reflection
@pytest.mark.parametrize("side, service, method", [("producer", "scd.v1.Producer", "Generate"),
                                                   ("consumer", "scd.v1.Consumer", "Transfer")])
def test_grpc_reflection_describes_the_service_behind_the_token(svc, side, service, method):
    """`grpcurl HOST:PORT list` / `describe` (server reflection) answered UNIMPLEMENTED: a user had to
    find the .proto files to call or inspect a running service."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    address = svc.producer_address if side == "producer" else svc.consumer_addresses["chat"]

    def ask(md, **request):
        with grpc.insecure_channel(address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            return next(iter(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(**request)]),
                                                       metadata=md, timeout=10)))

    listed = {s.name for s in ask(MD, list_services="").list_services_response.service}
    assert {service, "grpc.health.v1.Health"} <= listed, listed
    files = ask(MD, file_containing_symbol=service).file_descriptor_response.file_descriptor_proto
    protos = [descriptor_pb2.FileDescriptorProto.FromString(f) for f in files]
    methods = {m.name for p in protos for s in p.service if f"{p.package}.{s.name}" == service for m in s.method}
    assert method in methods, methods
    with pytest.raises(grpc.RpcError) as ei:  # the token guards it as it guards the service
        ask((), list_services="")
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
