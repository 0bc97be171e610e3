"""How a service starts to listen. Why it cannot, said with what to set: gRPC says only "Failed to
bind", and every failure read "is another server using it?" (a host name that does not resolve, an
address this machine does not have). And its health is set before its port serves."""

import asyncio
import socket

import pytest
from fastapi import FastAPI

from shared.rpc.http import HTTPServer
from shared.rpc.server import GRPCServer


def _grpc(host: str, port: int) -> str:
    async def run():
        server = GRPCServer(lambda srv: None, host, port, ["x"])
        try:
            await server.start()
        finally:
            if server.server is not None:
                await server.server.stop(0)
    with pytest.raises(OSError) as e:
        asyncio.run(run())
    return str(e.value)


def _http(host: str, port: int) -> str:
    with pytest.raises(OSError) as e:
        asyncio.run(HTTPServer(FastAPI(), host, port).start())
    return str(e.value)


@pytest.fixture
def taken():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_in_use_is_named_as_such(taken):
    said = _grpc("127.0.0.1", taken)
    assert f"cannot listen on 127.0.0.1:{taken}: the port is in use" in said and "server.port" in said, said
    said = _http("127.0.0.1", taken)
    assert "for HTTP: the port is in use" in said and "http.port to a free one" in said, said


@pytest.mark.parametrize("listen", [_grpc, _http])
def test_an_address_the_machine_lacks_or_a_name_that_does_not_resolve_is_not_called_a_busy_port(listen):
    settings = "server" if listen is _grpc else "http"
    said = listen("192.0.2.1", 0)  # TEST-NET-1: no machine has it
    assert f"this machine has no address 192.0.2.1; set {settings}.host" in said and "in use" not in said, said
    said = listen("no-such-host.invalid", 0)
    assert "no such host name" in said and f"set {settings}.host" in said and "in use" not in said, said


@pytest.mark.parametrize("where", ["--port", "http.port"])
def test_scd_serve_refuses_a_busy_port_before_it_loads_the_model(taken, where):
    """/m does not exist: the model's error would come first if the port were checked after it."""
    from typer.testing import CliRunner

    from tools.cli import app

    args = ["--port", str(taken)] if where == "--port" else ["--port", "0", "--set", f"http.port={taken}"]
    res = CliRunner().invoke(app, ["serve", "consumer", "--model", "/m", *args])
    said = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and f"127.0.0.1:{taken}" in said and "the port is in use" in said, res.output


def test_the_health_statuses_are_set_before_the_port_serves(monkeypatch):
    """A probe between the two got NOT_FOUND for the service's name, which the producer reads as
    "not an SCD consumer" (a warning in its log at every start that lost the race)."""
    import grpc

    real, seen = grpc.aio.server, {}

    def recording(*args, **kwargs):
        srv = real(*args, **kwargs)
        start = srv.start

        async def start_and_record():
            seen.update(built.health._server_status)  # what a probe could read from the moment it serves
            await start()

        srv.start = start_and_record
        return srv

    monkeypatch.setattr(grpc.aio, "server", recording)
    built = GRPCServer(lambda srv: None, "127.0.0.1", 0, ["scd.v1.Consumer"])

    async def run():
        await built.start()
        await built.server.stop(0)

    asyncio.run(run())
    assert {"", "liveness", "scd.v1.Consumer"} <= set(seen), seen


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6(), reason="this machine has no IPv6 loopback")
@pytest.mark.parametrize("host", ["::", "[::]", "::1", "[::1]"])
def test_an_ipv6_host_is_listened_on_with_or_without_brackets(host):
    """`server.host: "::"` made gRPC bind ":::50051", which does not parse ("gRPC could not bind it");
    the HTTP front took "::" but not "[::]". Both take both, and a message shows the bracketed form."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shared.rpc.server import address

    assert address(host, 5) == f"[{host.strip('[]')}]:5" and address("127.0.0.1", 5) == "127.0.0.1:5"

    async def run():
        server, front = GRPCServer(lambda srv: None, host, 0, ["x"]), HTTPServer(FastAPI(), host, 0)
        port, http_port = await server.start(), await front.start()
        try:
            async with grpc.aio.insecure_channel(address("::1", port)) as ch:
                got = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            reader, writer = await asyncio.open_connection("::1", http_port)
            writer.write(b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = await reader.read()
            writer.close()
            return got.status, answer.split(b"\r\n", 1)[0]
        finally:
            await front.stop()
            await server.server.stop(0)

    status, line = asyncio.run(run())
    assert status == 1 and line == b"HTTP/1.1 404 Not Found", (status, line)  # SERVING; FastAPI's own 404


@pytest.mark.skipif(not _ipv6(), reason="this machine has no IPv6 loopback")
def test_a_busy_ipv6_port_is_named_in_brackets():
    with socket.socket(socket.AF_INET6) as sock:
        sock.bind(("::1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        for said in (_grpc("::1", port), _http("[::1]", port)):
            assert f"cannot listen on [::1]:{port}" in said and "the port is in use" in said, said
