"""What answers at a gRPC address that a call could not reach, found with plain sockets: gRPC says
"Socket closed", "Failed parsing HTTP/2" or "Tls handshake failed" where the person who gave the
address needs "this is the HTTP port" or "this server speaks TLS". Used by the client (``scd
generate``) for the producer's address and by the producer for its consumers' addresses."""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass

import grpc

from shared.config import GRPC_SCHEMES

HTTP1 = "is an HTTP/1 server"


@dataclass(frozen=True)
class AddressProblem:
    said: str
    """A predicate of the address: "is an HTTP/1 server ...", "serves TLS: ..."."""
    lasting: bool
    """A mistake in the address or the TLS settings (no retry helps), not a server that is down or
    not up yet."""


def socket_problem(address: str, ca: bytes | None, ca_setting: str | None, role: str,
                   timeout: float = 2.0, port_setting: str = "server.port") -> AddressProblem | None:
    """Why ``address`` (HOST:PORT) is no gRPC server of ``role`` ("producer", "consumer") reachable
    as configured: TLS verified against ``ca`` (named ``ca_setting`` in the advice; None: a client
    that speaks plaintext only) or plaintext when it is None. None when nothing here is wrong (the
    server speaks gRPC as expected, or the address is a target with a scheme, ``unix:``..., which
    is not probed). ``port_setting``: where the server's gRPC port is set."""
    if address.startswith(GRPC_SCHEMES):
        return None
    host, _, port_s = address.rpartition(":")
    host, port = host.strip("[]"), int(port_s)
    grpc_port = f"the {role}'s gRPC port ({port_setting})"
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return AddressProblem(f"names a host that does not resolve ({host!r})", False)

    def connect() -> socket.socket:
        return socket.create_connection((host, port), timeout=timeout)

    try:
        connect().close()
    except ConnectionRefusedError:
        return AddressProblem(f"refuses connections: nothing listens there (is the {role} running, and is this "
                              f"{grpc_port}?)", False)
    except OSError as e:
        return AddressProblem(f"cannot be connected to: {e.strerror or e}", False)
    probe = ssl.create_default_context()
    probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE
    try:
        with connect() as s, probe.wrap_socket(s, server_hostname=host):
            tls = True
    except (ssl.SSLError, OSError):
        tls = False
    if tls and ca_setting is None:
        return AddressProblem("serves TLS, and this client speaks plaintext gRPC only: serve it without TLS", True)
    if tls and ca is None:
        return AddressProblem(f"serves TLS: set {ca_setting} to the CA that signed its certificate", True)
    if not tls and ca is not None:
        return AddressProblem(f"does not serve TLS: leave out {ca_setting}", True)
    ctx = probe
    if ca is not None:
        ctx = ssl.create_default_context(cadata=ca.decode("ascii", "replace"))
        try:
            with connect() as s, ctx.wrap_socket(s, server_hostname=host):
                pass
        except ssl.SSLCertVerificationError as e:
            return AddressProblem(f"has a TLS certificate that does not verify against {ca_setting}: "
                                  f"{e.verify_message}", True)
        except (ssl.SSLError, OSError):
            pass
    try:
        with connect() as s:
            conn = ctx.wrap_socket(s, server_hostname=host) if tls else s
            conn.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            if conn.recv(8).startswith(b"HTTP/"):
                return AddressProblem(f"{HTTP1} (the {role}'s HTTP port?), not {grpc_port}", True)
    except (ssl.SSLError, OSError):
        pass
    return None


def unreached(err: grpc.RpcError) -> bool:
    """Whether a call's status may mean it never reached the service it was meant for (nothing, or
    something else, answers at the address): what the probes above tell apart."""
    return err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED)


def with_reason(why: str | None, err: grpc.RpcError) -> str:
    """``err`` said as ``CODE: details``, after what answers at the address (``why``) when known."""
    said = f"{err.code().name}: {err.details()}"
    return f"{why} ({said})" if why else said
