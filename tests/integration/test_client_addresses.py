"""What `scd generate` says when its --producer or --tls-ca is wrong, and what the producer says when
a consumer's address or its own TLS settings are. gRPC reports each mistake as UNAVAILABLE or
UNIMPLEMENTED with its transport's words ("Socket closed", "Method not found!", "Failed parsing
HTTP/2"); both say what answers at the address instead, and the client leaves the producer's own
errors as they are."""

from __future__ import annotations

import socket
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from ops_common import PROMPT, TOKEN
from ops_support import self_signed

from consumer_service.engine import ConsumerEngine
from consumer_service.settings import ConsumerSettings
from producer_service.engine import ProducerEngine
from producer_service.settings import ProducerSettings
from tools import client
from tools.inprocess import InProcessServices


def _failure(address: str, ca: bytes | None = None, consumer: str = "chat") -> str:
    req = client.request(PROMPT, consumer=consumer, method="raw", max_new_tokens=2)
    with pytest.raises(grpc.RpcError) as ei:
        client.generate(address, req, timeout=20, token=TOKEN, root_certificates=ca)
    return client.explain(address, ei.value, ca)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_wrong_producer_address_is_named_for_what_answers_there(svc):
    http = f"127.0.0.1:{svc.producer_server.http.port}"
    assert _failure(http).startswith(f"{http} is an HTTP/1 server (the producer's HTTP port?), not the producer's gRPC")
    cons = svc.consumer_addresses["chat"]
    assert _failure(cons).startswith(f"{cons} is an SCD consumer, not the producer")
    closed = f"127.0.0.1:{_closed_port()}"
    assert _failure(closed).startswith(f"{closed} refuses connections: nothing listens there")
    nohost = "no-such-host.invalid:50051"
    assert _failure(nohost).startswith(f"{nohost} names a host that does not resolve")
    other = grpc.server(futures.ThreadPoolExecutor(1))  # a gRPC server with none of SCD's services
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        assert _failure(f"127.0.0.1:{port}").startswith(f"127.0.0.1:{port} is a gRPC server but not an SCD producer")
    finally:
        other.stop(None)
    # the producer's own refusal stands as it is
    assert _failure(svc.producer_address, consumer="nope").startswith("NOT_FOUND: unknown consumer 'nope'")


def test_tls_on_one_side_only_or_a_certificate_that_does_not_verify_is_named(base, svc, tmp_path):
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    one, two = self_signed(tmp_path / "one"), self_signed(tmp_path / "two")
    if one is None or two is None:
        pytest.skip("openssl CLI not available to make a test certificate")
    ca, other_ca = Path(one["cert"]).read_bytes(), Path(two["cert"]).read_bytes()

    def make_producer(addresses):
        s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, default_method="raw",
                                  consumers={"chat": {"address": svc.consumer_addresses["chat"]}}, http={"port": 0},
                                  security={"token": TOKEN, "tls_cert": one["cert"], "tls_key": one["key"]})
        return ProducerEngine(s, base)

    with InProcessServices([], make_producer) as s:
        tls = s.producer_address
        assert _failure(tls).startswith(f"{tls} serves TLS: set --tls-ca to the CA that signed its")
        assert _failure(tls, other_ca).startswith(f"{tls} has a TLS certificate that does not verify against --tls-ca")
        https = f"127.0.0.1:{s.producer_server.http.port}"
        assert _failure(https, ca).startswith(f"{https} is an HTTP/1 server")
    assert _failure(svc.producer_address, ca).startswith(f"{svc.producer_address} does not serve TLS: leave out")


def test_the_producer_names_a_consumer_address_that_is_an_http_port_or_tls_on_one_side_only(base, svc, tmp_path,
                                                                                           caplog):
    """Each was "unavailable" in /health and the log, and a request got UNAVAILABLE "... Socket closed;
    retry, or check the consumer's health": no retry helps, the producer's settings are wrong."""
    import logging

    import httpx2 as httpx

    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    one, two = self_signed(tmp_path / "one"), self_signed(tmp_path / "two")
    if one is None or two is None:
        pytest.skip("openssl CLI not available to make a test certificate")
    tls_consumer = ConsumerEngine(ConsumerSettings.load(
        model={"path": "unused"}, server={"port": 0}, name="tls", methods=["raw"],
        security={"token": TOKEN, "tls_cert": one["cert"], "tls_key": one["key"]}), base)
    web = f"127.0.0.1:{svc.producer_server.http.port}"

    def producer(consumers: dict[str, str], **security):
        def make(_):
            s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, default_method="raw",
                                      consumers={n: {"address": a} for n, a in consumers.items()}, http={"port": 0},
                                      security={"token": TOKEN, **security}, health_probe_s=0)
            return ProducerEngine(s, base)
        return make

    def statuses(s) -> dict[str, str]:
        s._run(s._servicer.probe_once())
        return httpx.get(f"http://127.0.0.1:{s.producer_server.http.port}/health").json()["consumers"]

    def refusal(s, name: str) -> str:
        with pytest.raises(grpc.RpcError) as ei:
            client.generate(s.producer_address, client.request(PROMPT, consumer=name, method="raw",
                                                               max_new_tokens=2), timeout=30, token=TOKEN)
        assert ei.value.code() == grpc.StatusCode.INTERNAL, (ei.value.code(), ei.value.details())
        return ei.value.details()

    with InProcessServices([tls_consumer], producer({"web": web})) as a, caplog.at_level(logging.WARNING):
        tls = a.consumer_addresses["tls"]
        with InProcessServices([], producer({"web": web, "tls": tls})) as s:
            said = statuses(s)
            assert said["web"].startswith("is an HTTP/1 server (the consumer's HTTP port?)"), said
            assert said["tls"] == "serves TLS: set security.peer_ca to the CA that signed its certificate", said
            assert f"consumer 'web' at {web}: is an HTTP/1 server" in caplog.text, caplog.text
            assert refusal(s, "web").startswith(f"consumer 'web': the producer's consumers.web.address ({web}) is an "
                                                "HTTP/1 server")
            assert "consumers.tls.address" in refusal(s, "tls")
        plain = svc.consumer_addresses["chat"]
        with InProcessServices([], producer({"tls": tls, "chat": plain}, peer_ca=two["cert"])) as s:
            said = statuses(s)
            assert said["tls"].startswith("has a TLS certificate that does not verify against security.peer_ca"), said
            assert said["chat"] == "does not serve TLS: leave out security.peer_ca", said
            assert "does not serve TLS" in refusal(s, "chat")


@pytest.mark.parametrize("content, said", [
    (None, "cannot read --tls-ca"),
    ("not a certificate\n", "holds no PEM certificate"),
    ("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", "--tls-ca: unreadable PEM"),
])
def test_scd_generate_reads_its_tls_ca_before_it_calls(tmp_path, content, said):
    """A missing file was a FileNotFoundError traceback; any bytes were taken as a CA, and gRPC's
    handshake then failed with "Failed to create security handshaker"."""
    from typer.testing import CliRunner

    from tools.cli import app

    path = tmp_path / "ca.pem"
    if content is not None:
        path.write_text(content)
    res = CliRunner().invoke(app, ["generate", "hi", "--producer", f"127.0.0.1:{_closed_port()}",
                                   "--tls-ca", str(path)])
    assert res.exit_code == 2 and said in " ".join(res.output.replace("│", " ").split()), res.output


def test_scd_generate_says_an_error_on_its_own_line_and_after_streamed_text(svc):
    """An error that came before any text began with a blank line."""
    from typer.testing import CliRunner

    from tools.cli import app

    closed = f"127.0.0.1:{_closed_port()}"
    res = CliRunner().invoke(app, ["generate", "hi", "--producer", closed, "--timeout", "5"])
    assert res.exit_code == 1 and res.output.startswith(f"error: {closed} refuses connections"), repr(res.output)
    res = CliRunner().invoke(app, ["generate", "hi", "--producer", svc.producer_address, "--consumer", "nope",
                                   "--token", TOKEN])
    assert res.exit_code == 1 and res.output.startswith("error: NOT_FOUND: unknown consumer 'nope'"), repr(res.output)
