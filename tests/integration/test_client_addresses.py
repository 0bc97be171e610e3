"""What `scd generate` says when its --producer or --tls-ca is wrong. gRPC reports each mistake as
UNAVAILABLE or UNIMPLEMENTED with its transport's words ("Socket closed", "Method not found!",
"Failed parsing HTTP/2"); the client says what answers at the address instead, and leaves the
producer's own errors as they are."""

from __future__ import annotations

import socket
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from ops_common import PROMPT, TOKEN
from ops_support import self_signed

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
    assert _failure(http).startswith(f"{http} is an HTTP/1 server (the producer's HTTP API")
    cons = svc.consumer_addresses["chat"]
    assert _failure(cons).startswith(f"{cons} is an SCD consumer, not the producer")
    closed = f"127.0.0.1:{_closed_port()}"
    assert _failure(closed).startswith(f"nothing listens at {closed} (connection refused)")
    assert _failure("no-such-host.invalid:50051").startswith("the host 'no-such-host.invalid' does not resolve")
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
        assert _failure(tls).startswith(f"{tls} serves TLS: give the CA that signed its certificate (--tls-ca)")
        assert _failure(tls, other_ca).startswith(f"{tls}'s TLS certificate does not verify against --tls-ca")
        https = f"127.0.0.1:{s.producer_server.http.port}"
        assert _failure(https, ca).startswith(f"{https} is an HTTP/1 server")
    assert _failure(svc.producer_address, ca).startswith(f"{svc.producer_address} does not serve TLS: leave out")


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
