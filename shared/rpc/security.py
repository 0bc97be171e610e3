"""Bearer-token authentication and TLS for both services (gRPC and HTTP).

The token is checked on every RPC (a server interceptor; ``UNAUTHENTICATED``) and every HTTP route
(401) except the health checks (gRPC ``grpc.health.v1.Health`` and HTTP ``/health``), which stay
open for orchestrator probes. The producer sends its own token to its consumers."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import grpc
from pydantic import BaseModel, ConfigDict, SecretStr, model_validator

from shared.errors import ConfigError, clip

CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def sendable_token(tok: str) -> bool:
    """Whether a bearer token can cross gRPC metadata and HTTP headers: printable ASCII without spaces."""
    return tok.isascii() and tok.isprintable() and not any(c.isspace() for c in tok)


class SecuritySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    token: SecretStr | None = None
    """Bearer token clients must send (``authorization: Bearer <token>``). Prefer ``token_file`` or
    the environment (``PRODUCER__SECURITY__TOKEN`` / ``CONSUMER__SECURITY__TOKEN``) to a file."""
    token_file: str | None = None
    """A file holding the token (e.g. a mounted Kubernetes secret); surrounding whitespace ignored."""
    tls_cert: str | None = None
    """PEM certificate chain of this server; with ``tls_key`` it serves TLS (gRPC and HTTP)."""
    tls_key: str | None = None
    tls_client_ca: str | None = None
    """PEM CA bundle: clients must present a certificate it signed (mutual TLS)."""
    peer_ca: str | None = None
    """Producer only: PEM CA that signed the consumers' certificates; set, the producer connects to
    its consumers over TLS (presenting ``tls_cert``/``tls_key`` as its client certificate)."""

    @model_validator(mode="after")
    def _consistent(self):
        if self.token is not None and self.token_file:
            raise ValueError("set token or token_file, not both")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: set both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        return self

    # ------------------------------------------------------------------ resolved values
    def bearer(self) -> str | None:
        if self.token is not None:
            tok = self.token.get_secret_value().strip()
        elif self.token_file:
            tok = _read(self.token_file, "security.token_file").decode().strip()
        else:
            return None
        if not tok:
            raise ConfigError("the bearer token is empty; set a non-empty token or drop it")
        if not sendable_token(tok):  # gRPC metadata and HTTP headers carry no other: no client could have sent it
            raise ConfigError("the bearer token must be printable ASCII without spaces (gRPC metadata and HTTP "
                              "headers carry no other); set another token, e.g. `openssl rand -hex 32`")
        return tok

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls or self.tls_key is None or self.tls_cert is None:
            return None
        pair = [(_read(self.tls_key, "security.tls_key"), _read(self.tls_cert, "security.tls_cert"))]
        if self.tls_client_ca:
            ca = _read(self.tls_client_ca, "security.tls_client_ca")
            return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=True)
        return grpc.ssl_server_credentials(pair)

    def peer_credentials(self) -> grpc.ChannelCredentials | None:
        """Channel credentials towards this service's peers (producer -> consumers)."""
        if not self.peer_ca:
            return None
        key = _read(self.tls_key, "security.tls_key") if self.tls_key else None
        cert = _read(self.tls_cert, "security.tls_cert") if self.tls_cert else None
        return grpc.ssl_channel_credentials(_read(self.peer_ca, "security.peer_ca"), key, cert)

    def check(self) -> None:
        """Read every configured file once at start-up, before the model loads: a bad path or a file
        that is not what its setting takes fails then, not per request (gRPC took any bytes as a
        certificate and failed to bind, which read as "is another server using it?")."""
        self.bearer()
        marks = {"tls_cert": CERTIFICATE, "tls_key": b"PRIVATE KEY-----", "tls_client_ca": CERTIFICATE,
                 "peer_ca": CERTIFICATE}
        held = {name: _read(getattr(self, name), f"security.{name}") for name in marks if getattr(self, name)}
        for name, data in held.items():
            if marks[name] not in data:
                kind = "private key" if name == "tls_key" else "certificate"
                raise ConfigError(f"security.{name}: {getattr(self, name)} holds no PEM {kind} (no "
                                  f"'{marks[name].decode()}' line); set a PEM {kind} file")
        if b"ENCRYPTED" in held.get("tls_key", b""):
            raise ConfigError(f"security.tls_key: {self.tls_key} is encrypted; set the key unencrypted "
                              "(e.g. a mounted secret readable by the service only)")
        if self.tls_cert and self.tls_key:
            _check_pem(lambda ctx: ctx.load_cert_chain(_path(self.tls_cert), _path(self.tls_key)),
                       "security.tls_cert and tls_key")
        for name in ("tls_client_ca", "peer_ca"):
            path = getattr(self, name)
            if path:
                _check_pem(lambda ctx, path=path: ctx.load_verify_locations(cafile=_path(path)), f"security.{name}")
        self.server_credentials()
        self.peer_credentials()


def _path(path: str | None) -> str:
    return os.path.expanduser(path or "")


def read_ca(path: str, what: str) -> bytes:
    """A PEM CA certificate file's bytes (a client's ``--tls-ca``), read as OpenSSL reads it; a path
    that cannot be read or a file that holds no certificate is a ConfigError naming ``what``."""
    data = _read(path, what)
    if CERTIFICATE not in data:
        raise ConfigError(f"{what}: {path} holds no PEM certificate (no '{CERTIFICATE.decode()}' line); give the "
                          "PEM certificate of the CA that signed the server's")
    _check_pem(lambda ctx: ctx.load_verify_locations(cadata=data.decode("ascii", "replace")), what)
    return data


def _check_pem(load, what: str) -> None:
    """``load(ctx)`` on a fresh TLS context (the standard library's parser is OpenSSL's, as gRPC's and
    uvicorn's are); its failure said as a problem of ``what``."""
    import ssl

    try:
        load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    except ssl.SSLError as e:
        why = "the key is not the certificate's" if e.reason == "KEY_VALUES_MISMATCH" else f"unreadable PEM ({e})"
        raise ConfigError(f"{what}: {why}") from None


def _read(path: str, what: str) -> bytes:
    try:
        return Path(_path(path)).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror or e}") from None


def token_ok(header: str | None, token: str) -> bool:
    """``header`` is the raw authorization value, ``Bearer <token>``; the scheme is matched without
    regard to case (RFC 7235), the token in constant time."""
    if header is None:
        return False
    scheme, _, credentials = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode("utf-8", "replace"),
                                                              token.encode())


def token_problem(header: str | None, where: str) -> str:
    """Why ``header`` (the raw authorization value) was refused, saying what to send; ``where``: how the
    client sends it (``'Authorization: Bearer <token>'`` or gRPC metadata)."""
    if header is None or not header.strip():
        return f"missing bearer token: send {where}"
    scheme, _, credentials = header.strip().partition(" ")
    if scheme.lower() == "bearer" and not credentials.strip():
        return f"missing bearer token: the authorization names the scheme but no token; send {where}"
    if scheme.lower() != "bearer":
        said = f"scheme {clip(scheme, 16)}" if credentials.strip() else "a value with no scheme"
        return f"the authorization is not a bearer token ({said}): send {where}"
    return "wrong bearer token: send the token this service was configured with"


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that refuses with UNAUTHENTICATED."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC but the health service without ``authorization: Bearer <token>``."""

    def __init__(self, token: str, on_failure=None):
        self.token, self.on_failure = token, on_failure

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization")
        if token_ok(got, self.token):
            return handler
        if self.on_failure:
            self.on_failure()
        return _denied(handler, token_problem(got, "metadata 'authorization: Bearer <token>'"))
