"""HTTP pieces shared by both services: uvicorn in the gRPC server's event loop, bearer-token
checking, OpenAI-style error bodies, and a /metrics + /health app for the consumer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import sys
import uuid
from typing import Any

import grpc
import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from shared.errors import clip, usable_request_id
from shared.metrics import CONTENT_TYPE, Metrics, log_request
from shared.rpc.security import SecuritySettings, token_ok, token_problem
from shared.rpc.server import GRACE_MARGIN_S, address, listen_error
from shared.version import VERSION

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.DATA_LOSS: 502, grpc.StatusCode.CANCELLED: 499,
}
OPEN_PATHS = ("/health",)
READ_METHODS = ["GET", "HEAD"]
"""What the read-only routes take: HEAD too, as HTTP says a GET resource should (load balancers and
uptime checks probe with it; it was a 405)."""


def error_body(code: grpc.StatusCode, message: str, param: str | None = None) -> dict:
    """OpenAI's error object; ``param`` names the request field at fault, where one is."""
    return {"error": {"message": message, "type": code.name.lower(), "code": code.name, "param": param}}


RETRY_AFTER_S = 1
"""What a 429 (at capacity) or 503 (consumer unavailable) tells a client to wait before it retries
(OpenAI's client libraries honour ``Retry-After``)."""


def error_response(code: grpc.StatusCode, message: str, param: str | None = None) -> JSONResponse:
    headers = None
    if code == grpc.StatusCode.UNAUTHENTICATED:
        headers = {"WWW-Authenticate": "Bearer"}
    elif code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return JSONResponse(error_body(code, message, param), status_code=HTTP_STATUS.get(code, 500), headers=headers)


def add_auth(app: FastAPI, token: str | None, metrics: Metrics | None = None) -> None:
    """Every route but /health needs ``Authorization: Bearer <token>`` when a token is set."""
    if not token:
        return

    @app.middleware("http")
    async def _bearer(request: Request, call_next):
        preflight = request.method == "OPTIONS" and "access-control-request-method" in request.headers
        if request.url.path in OPEN_PATHS or preflight or token_ok(request.headers.get("authorization"), token):
            return await call_next(request)  # a browser's preflight carries no token (no route serves it)
        if metrics is not None:
            metrics.auth_failures.labels("http").inc()
        msg = token_problem(request.headers.get("authorization"), "'Authorization: Bearer <token>'")
        return error_response(grpc.StatusCode.UNAUTHENTICATED, msg)


class HTTPAccounting:
    """ASGI middleware, outermost: counts every answer in ``http_responses`` (path, status), and logs
    a request line for an error answer the engine has not logged (``scope["state"]["engine"]`` unset:
    a body that does not validate, a refused token, size or encoding, an unknown path), with its
    error message. A 499 (the client left) is counted, not logged twice."""

    def __init__(self, app, metrics: Metrics, paths: tuple[str, ...], access_log: bool = True):
        self.app, self.metrics, self.paths, self.access_log = app, metrics, paths, access_log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen: dict[str, Any] = {"status": 500, "body": b"", "done": False}
        given = dict(scope.get("headers") or ()).get(b"x-request-id", b"").decode("latin-1")
        # the request's id where the app gave none (a refusal before it ran): the client's own if usable
        rid = given if usable_request_id(given) else uuid.uuid4().hex

        def account() -> None:
            if seen["done"]:
                return
            seen["done"] = True
            path, status = scope.get("path", ""), seen["status"]
            self.metrics.http_responses.labels(path if path in self.paths else "other", str(status)).inc()
            if status >= 400 and status != 499 and self.access_log and not scope.get("state", {}).get("engine"):
                log_request(rid, http=f"{scope.get('method', '')} {path}", status=status, error=_message(seen["body"]))

        async def counted(message):
            nonlocal rid
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                headers = dict(message.get("headers") or ())
                if b"x-request-id" in headers:  # the app's (the client's own, or one it made)
                    rid = headers[b"x-request-id"].decode("latin-1")
                else:  # every answer carries one, a refusal before the app ran too
                    message = {**message, "headers": [*message.get("headers", ()),
                                                      (b"x-request-id", rid.encode("latin-1"))]}
                length = headers.get(b"content-length", b"")
                seen["length"] = int(length) if length.isdigit() else None
                seen["sent"] = 0
            elif message["type"] == "http.response.body":
                piece = message.get("body", b"")
                seen["sent"] += len(piece)
                if seen["status"] >= 400 and len(seen["body"]) < 4096:
                    seen["body"] += piece[:4096]
                # before the answer's last byte goes out (a client stops reading at its Content-Length, which
                # may come before the last, empty, message): a client that has the answer sees it counted
                if not message.get("more_body") or seen["length"] is not None and seen["sent"] >= seen["length"]:
                    account()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            account()  # an answer that never finished (the client left, the app failed)


def _message(body: bytes) -> str:
    """An error body's message (OpenAI-style JSON), else its text."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace").strip()


def add_metrics_routes(app: FastAPI, metrics: Metrics, ready=lambda: True, detail=lambda: None) -> None:
    @app.api_route("/metrics", methods=READ_METHODS)
    async def _metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.api_route("/health", methods=READ_METHODS)
    async def _health():
        ok = ready()
        body: dict[str, Any] = {"status": "ok" if ok else "unavailable", "service": metrics.service,
                                "version": VERSION}
        extra = detail()
        if extra is not None:
            body.update(extra)
        return JSONResponse(body, status_code=200 if ok else 503)


_HTTP_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
               404: grpc.StatusCode.NOT_FOUND, 405: grpc.StatusCode.UNIMPLEMENTED,
               413: grpc.StatusCode.INVALID_ARGUMENT}


def add_route_errors(app: FastAPI, served: str, api_elsewhere: str = "", preflight: str = "") -> None:
    """The framework's own errors (404, 405, 413...) as OpenAI-style bodies; a path that is not
    served lists ``served`` (and, for an OpenAI API path, ``api_elsewhere``: where that API is), a
    wrong method names the ones the path takes (and a browser's CORS preflight, ``preflight``: how
    to allow it)."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = _HTTP_CODES.get(exc.status_code, grpc.StatusCode.INVALID_ARGUMENT)
        msg = str(exc.detail)
        if exc.status_code == 404 and msg == "Not Found":
            path = request.url.path
            msg = f"{clip(path)} is not served here; this server serves {served}"
            bare = path.rstrip("/")
            if bare and bare != path and any((rx := getattr(r, "path_regex", None)) and rx.match(bare)
                                             for r in app.routes):
                msg += f" (send it to {clip(bare)}, without the trailing '/')"
            elif api_elsewhere and path.startswith("/v1/"):
                msg += f" ({api_elsewhere})"
        elif exc.status_code == 405 and msg == "Method Not Allowed":
            allow = (exc.headers or {}).get("Allow", "another method")
            msg = f"{request.method} is not allowed on {clip(request.url.path)}; use {allow}"
            if preflight and request.method == "OPTIONS" and "origin" in request.headers:
                msg += f" (this is a browser's CORS preflight: {preflight})"
        elif exc.status_code == 400 and msg == "There was an error parsing the body":
            msg = _unreadable_body(exc.__cause__)
        return JSONResponse(error_body(code, msg), status_code=exc.status_code, headers=exc.headers)


def _unreadable_body(cause: BaseException | None) -> str:
    """What FastAPI's "There was an error parsing the body" was (it says no more; its cause does)."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"the body is not text ({cause.encoding}: {cause.reason} at byte {cause.start}); "
                "send one JSON object encoded as UTF-8")
    if isinstance(cause, RecursionError):
        return "the body's JSON is nested too deeply to read; send one JSON object of the request's fields"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):  # valid JSON, Python's limit
        return (f"the body holds a whole number of more than {sys.get_int_max_str_digits():,} digits, far out of any "
                "field's range; send each number within its field's range")
    return "the body could not be read as JSON; send one JSON object (Content-Type: application/json)"


def metrics_app(metrics: Metrics, token: str | None) -> FastAPI:
    """The consumer's HTTP side: /metrics (token-checked) and /health."""
    app = FastAPI(title=f"scd {metrics.service}", docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)  # a 307 to the path without '/': POST clients do not follow it
    add_route_errors(app, "GET /health, GET /metrics", "this is an SCD consumer's HTTP port: send OpenAI API "
                     "requests to the producer's http.port, which names this consumer as its model")
    add_metrics_routes(app, metrics)
    add_auth(app, token, metrics)
    return app


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for a request's headers (``read_timeout``): uvicorn arms
    no timer before a connection's first request, nor while a request's headers trickle in after a
    keep-alive, so a client that sends nothing, or part of the headers, held the connection for ever.
    The body's deadline is the app's (the producer's ``BodyLimit``)."""

    read_timeout = 30.0
    _headers_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._wait_for_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is None or self.cycle.response_complete:  # between requests: headers still to come
            self._wait_for_headers()
        elif self._headers_timer is not None:  # a request began
            self._headers_timer.cancel()
            self._headers_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None
        super().connection_lost(exc)

    def _wait_for_headers(self) -> None:
        if self._headers_timer is None:  # one deadline per request, not one per piece of it
            self._headers_timer = self.loop.call_later(self.read_timeout, self._late)

    def _late(self) -> None:
        self._headers_timer = None
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.conn.send(h11.ConnectionClosed())
            self.transport.close()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the gRPC server owns SIGTERM/SIGINT and stops us
        yield


class HTTPServer:
    """uvicorn serving ``app`` in the running event loop; ``start()`` returns the bound port."""

    def __init__(self, app, host: str, port: int, security: SecuritySettings | None = None, grace_s: float = 5.0,
                 read_timeout_s: float = 30.0):
        self.app, self.host, self.port, self.grace_s, self.read_timeout_s = app, host, port, grace_s, read_timeout_s
        self.security = security or SecuritySettings()
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        bare = self.host.strip("[]")  # an IPv6 literal binds without its brackets
        family = socket.AF_INET6 if ":" in bare else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        # a restarted service binds at once, though connections of its previous run linger in TIME_WAIT
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bare, self.port))
        except OSError as e:
            sock.close()
            raise listen_error(self.host, self.port, "http", e) from None
        self.port = sock.getsockname()[1]
        s = self.security
        kw: dict[str, Any] = {}
        if s.tls:
            import ssl

            kw = dict(ssl_certfile=s.tls_cert, ssl_keyfile=s.tls_key)
            if s.tls_client_ca:
                kw.update(ssl_ca_certs=s.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        protocol = type("Protocol", (_Protocol,), {"read_timeout": self.read_timeout_s})
        cfg = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False, http=protocol,
                             timeout_graceful_shutdown=math.ceil(self.grace_s + GRACE_MARGIN_S), **kw)
        self._server = _Server(cfg)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        for _ in range(500):  # bounded wait for start-up (5 s)
            if self._server.started or self._task.done():
                break
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raises the start-up error
        if not self._server.started:
            raise OSError(f"HTTP server on {address(self.host, self.port)} did not start")
        return self.port

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, self.grace_s + GRACE_MARGIN_S + 5)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - stopping anyway
            self._task.cancel()
        self._server = None
