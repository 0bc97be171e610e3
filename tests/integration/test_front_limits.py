"""The front doors' limits beyond a request's fields: a body that stops arriving, the HTTP methods a
route takes, and what a gRPC tool (grpcurl) can ask a running service."""

from __future__ import annotations

import grpc
import httpx2 as httpx
import pytest
from ops_common import MD, TOKEN
from ops_support import wait_for

H = {"Authorization": f"Bearer {TOKEN}"}


def _producer(svc, base, tok, **http):
    """A producer of its own before the test's consumer ``chat``, its HTTP front with ``http``."""
    from producer_service.engine import ProducerEngine
    from producer_service.settings import ProducerSettings
    from tools.inprocess import InProcessServices

    def make_producer(addresses):
        s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, http={"port": 0, **http},
                                  default_method="raw", security={"token": TOKEN},
                                  consumers={"chat": {"address": svc.consumer_addresses["chat"]}}, health_probe_s=0)
        return ProducerEngine(s, base, tok)

    with InProcessServices([], make_producer) as s:
        yield s.producer_server.http.port


@pytest.fixture(scope="module")
def quick(svc, base, tok):
    """A producer whose HTTP front gives a request 1 s to arrive (``http.read_timeout_s``)."""
    yield from _producer(svc, base, tok, read_timeout_s=1.0)


@pytest.mark.parametrize("side, path", [("producer", "/health"), ("producer", "/metrics"),
                                        ("producer", "/v1/models"), ("producer", "/v1/models/chat"),
                                        ("producer", "/v1/models/nosuch"), ("consumer", "/health"),
                                        ("consumer", "/metrics")])
def test_head_is_answered_as_get_is_without_a_body(svc, side, path):
    """Load balancers and uptime checks probe with HEAD, which HTTP says a GET resource takes: it was a
    405 everywhere. The answer's status and headers are GET's; it has no body; the token still counts."""
    port = svc.producer_server.http.port if side == "producer" else svc.consumer_servers["lease"].http.port
    url = f"http://127.0.0.1:{port}{path}"
    if path == "/health":  # not while the producer's first probe may change its answer between the two calls
        wait_for(lambda: httpx.get(url, timeout=30).status_code == 200, what="the consumers to be probed")
    got, head = httpx.get(url, headers=H, timeout=30), httpx.head(url, headers=H, timeout=30)
    assert head.status_code == got.status_code and head.content == b"", (head.status_code, head.content[:200])
    assert head.headers["content-type"] == got.headers["content-type"]
    if path != "/metrics":  # the metrics' text changes between the two calls, so its length may
        assert head.headers["content-length"] == got.headers["content-length"]
    if path != "/health":
        assert httpx.head(url, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401


def test_a_post_route_still_refuses_head_naming_post(svc):
    r = httpx.head(f"http://127.0.0.1:{svc.producer_server.http.port}/v1/completions", headers=H, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.content == b""


REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
           + TOKEN.encode() + b"\r\n")
WHOLE = b'{"model": "chat", "prompt": "hi there", "max_tokens": 2}'


@pytest.mark.parametrize("sent, answer", [
    (b"", b""),  # a connection that sends nothing
    (REQUEST[:40], b""),  # part of the headers
    (REQUEST + b"Content-Length: 200\r\n\r\n{\"model\":", b"HTTP/1.1 408"),  # part of the body
    # after a first request on the same connection (once its answer is out: uvicorn's keep-alive timer stops
    # at the next byte)
    ((REQUEST + b"Content-Length: %d\r\n\r\n" % len(WHOLE) + WHOLE, REQUEST[:40]), b"HTTP/1.1 200"),
])
def test_a_request_that_stops_arriving_is_cut_off_and_the_front_serves_on(quick, sent, answer):
    """A client that sends nothing, part of the headers (also after a first request on the same
    connection) or part of the body, then waits, held the connection (and a coroutine) for as long
    as it liked (measured: still open after 130 s): a few thousand such sockets take the front down."""
    import socket
    import time

    with socket.create_connection(("127.0.0.1", quick), timeout=20) as c:
        got = b""
        for piece in sent if isinstance(sent, tuple) else (sent,):
            c.sendall(piece)
            while b"}" not in got and isinstance(sent, tuple):  # the first answer, whole (its JSON ends it)
                got += c.recv(4096)
        t0 = time.monotonic()
        while chunk := c.recv(4096):  # read to the end: the server closes the connection
            got += chunk
        waited = time.monotonic() - t0
    assert got.startswith(answer) and got.count(b"HTTP/1.1 ") == (1 if answer else 0), got[:400]
    if answer.endswith(b"408"):
        assert b"http.read_timeout_s" in got, got[:400]
    assert 0.5 < waited < 15, waited
    r = httpx.post(f"http://127.0.0.1:{quick}/v1/completions", headers=H, timeout=60,  # and it still serves
                   json={"model": "chat", "prompt": "hi there", "max_tokens": 2})
    assert r.status_code == 200, r.text[:300]


def test_a_request_sent_in_pieces_in_time_is_read_whole(quick):
    slow = httpx.post(f"http://127.0.0.1:{quick}/v1/completions", timeout=60,
                      headers={**H, "content-type": "application/json"}, content=_slowly(WHOLE, 0.1))
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


# ---------------------------------------------------------------------------- browsers (CORS)
PAGE = "http://localhost:3000"


@pytest.fixture(scope="module")
def browser(svc, base, tok):
    """A producer whose OpenAI API a web page at ``PAGE`` may call (``http.cors_origins``)."""
    for port in _producer(svc, base, tok, cors_origins=[PAGE]):
        yield f"http://127.0.0.1:{port}"


def _preflight(url: str, origin: str, method: str = "POST") -> httpx.Response:
    # what the openai library sends from a browser: its own x-stainless-* headers beside the token
    return httpx.options(url, timeout=30, headers={"Origin": origin, "Access-Control-Request-Method": method,
                                                   "Access-Control-Request-Headers": "authorization, content-type, "
                                                                                     "x-stainless-os"})


def test_a_listed_web_page_may_call_the_api_and_read_its_answers_and_refusals(browser):
    r = _preflight(browser + "/v1/chat/completions", PAGE)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
    assert "x-stainless-os" in r.headers["access-control-allow-headers"]
    assert "POST" in r.headers["access-control-allow-methods"]
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers, status in (({**H, "Origin": PAGE}, 200), ({"Origin": PAGE}, 401)):  # a refusal is readable too
        r = httpx.post(browser + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == status and r.headers["access-control-allow-origin"] == PAGE, r.text[:300]
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    r = httpx.post(browser + "/v1/chat/completions", json=body, headers={**H, "Origin": "http://elsewhere.example"},
                   timeout=60)  # the answer is sent, but no browser shows it to another page
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_an_unlisted_page_or_method_is_refused_at_preflight_saying_what_to_change(browser):
    r = _preflight(browser + "/v1/completions", "http://elsewhere.example", "PUT")
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "INVALID_ARGUMENT", r.text[:300]
    assert "origin 'http://elsewhere.example' may not call this API from a browser" in err["message"]
    assert f"http.cors_origins (now ['{PAGE}'])" in err["message"] and "method 'PUT' is not served" in err["message"]
    assert _preflight(browser + "/v1/completions", PAGE).status_code == 200  # and it serves on


def test_without_cors_origins_a_preflight_is_refused_naming_the_setting(svc):
    r = _preflight(f"http://127.0.0.1:{svc.producer_server.http.port}/v1/completions", PAGE)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    assert "CORS preflight: to let a web page call this API, list its origin in the producer's http.cors_origins" \
        in r.json()["error"]["message"]
