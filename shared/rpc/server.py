"""A grpc.aio server with explicit message limits, standard health checking and graceful stop."""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import signal
import socket
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.errors import DataLoss, clip
from shared.rpc.wire import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def address(host: str, port: int | str) -> str:
    """``host:port`` as gRPC dials and binds it and as a message shows it: an IPv6 literal in
    brackets (``[::]:50051``; ``:::50051`` does not parse), whether or not ``host`` has them."""
    bare = host.strip("[]")
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def _bind_error(host: str, port: int) -> OSError | None:
    """What binding ``host:port`` raises (None: it binds), with SO_REUSEADDR as both servers set it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as e:
        return e
    return None


def check_can_listen(host: str, port: int | None, settings: str) -> None:
    """Before a service loads its model (minutes for a large one): refuse a host or port it will not
    be able to listen on. A check only; the port is bound again when the server starts."""
    if port is not None and (error := _bind_error(host, port)) is not None:
        raise listen_error(host, port, settings, error)


def listen_error(host: str, port: int, settings: str, error: OSError | None = None) -> OSError:
    """Why ``host:port`` cannot be listened on and what to set instead (``settings``: "server" or
    "http", whose ``host``/``port`` the message names). gRPC says only "Failed to bind"; a plain
    socket's bind, tried here when ``error`` is not given, tells which problem it is."""
    error = error or _bind_error(host, port)
    where = f"cannot listen on {address(host, port)}{' for HTTP' if settings == 'http' else ''}"
    if isinstance(error, socket.gaierror):
        why = (f"no such host name ({error.strerror}); set {settings}.host to an address of this machine, "
               "or 0.0.0.0 for all of them")
    elif error is not None and error.errno == errno.EADDRNOTAVAIL:
        why = f"this machine has no address {host}; set {settings}.host to one of its addresses, or 0.0.0.0 for all"
    elif error is not None and error.errno == errno.EADDRINUSE:
        why = f"the port is in use; is another server using it? Set {settings}.port to a free one (0 picks one)"
    elif error is not None and error.errno == errno.EACCES:
        why = f"not permitted ({error.strerror}); ports below 1024 need privileges: set {settings}.port above 1023"
    else:
        why = f"{error.strerror or error}" if error is not None else "gRPC could not bind it"
    return OSError(f"{where}: {why}")


class Undecodable:
    """What a message that does not parse becomes (instead of an exception inside gRPC's core,
    which would reach the client as INTERNAL or UNKNOWN)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserializer):
    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - a DecodeError (or invalid UTF-8 in a string field)
            return Undecodable(e)

    return parse


class DecodeErrorsInterceptor(grpc.aio.ServerInterceptor):
    """A request that does not parse is INVALID_ARGUMENT; a frame of a request stream that does not
    parse is DATA_LOSS (raised inside the stream, so the servicer frees what the request held)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = details.method
        kw = dict(request_deserializer=_tolerant(handler.request_deserializer),
                  response_serializer=handler.response_serializer)

        def refusal(request) -> str:
            return f"the request does not parse as the message {method} takes ({clip(str(request.error), 200)})"

        if handler.request_streaming:
            async def checked(request_iterator):
                async for item in request_iterator:
                    if isinstance(item, Undecodable):
                        raise DataLoss(f"a message of the stream does not parse ({clip(str(item.error), 200)})")
                    yield item

            if handler.response_streaming:
                inner_ss = handler.stream_stream
                if not inspect.isasyncgenfunction(inner_ss):  # it writes its answers (context.write)
                    async def stream_stream_writes(request_iterator, context):
                        return await inner_ss(checked(request_iterator), context)

                    return grpc.stream_stream_rpc_method_handler(stream_stream_writes, **kw)

                async def stream_stream(request_iterator, context):
                    async for item in inner_ss(checked(request_iterator), context):
                        yield item

                return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)
            inner_su = handler.stream_unary

            async def stream_unary(request_iterator, context):
                return await inner_su(checked(request_iterator), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
        if handler.response_streaming:
            inner_us = handler.unary_stream
            if not inspect.isasyncgenfunction(inner_us):  # it writes its answers (grpc_health's Watch)
                async def unary_stream_writes(request, context):
                    if isinstance(request, Undecodable):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(request))
                    return await inner_us(request, context)

                return grpc.unary_stream_rpc_method_handler(unary_stream_writes, **kw)

            async def unary_stream(request, context):
                if isinstance(request, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(request))
                async for item in inner_us(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
        inner_uu = handler.unary_unary

        async def unary_unary(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(request))
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)


GRACE_MARGIN_S = 2.0
"""Time the requests still in flight when the grace is over get to send their last answer."""


class GRPCServer:
    """``start()`` binds and serves (returns the port); ``stop(grace)`` drains and stops."""

    def __init__(self, add_servicers, host: str, port: int, service_names: list[str], interceptors=(),
                 credentials: grpc.ServerCredentials | None = None):
        self._add, self.host, self.port, self._names = add_servicers, host, port, service_names
        self._interceptors, self._credentials = [*interceptors, DecodeErrorsInterceptor()], credentials
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.servicer: object = None  # the service's servicer (tests inspect its metrics and admission)
        self.http: Any = None  # the HTTP front (shared.rpc.http.HTTPServer) when http.port is set
        self.on_start: list = []  # coroutine functions run once the gRPC server serves (e.g. an HTTP front)
        self.on_stop: list = []  # coroutine functions that stop with it, given the same grace (an HTTP front)
        self.on_grace_expired: list = []  # coroutine functions run when the grace is over and requests remain
        self.initial_health: dict[str, int] = {}  # health statuses set before the port serves (after the defaults)

    async def start(self) -> int:
        # no SO_REUSEPORT: a second server on a taken port must fail, not share it silently
        self.server = grpc.aio.server(options=OPTIONS + [("grpc.so_reuseport", 0)], interceptors=self._interceptors)
        self._add(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # server reflection: `grpcurl HOST:PORT list` / `describe` work without the .proto files (behind
        # the bearer token, like the service itself)
        reflection.enable_server_reflection([*self._names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        addr = address(self.host, self.port)
        try:
            if self._credentials is not None:
                self.port = self.server.add_secure_port(addr, self._credentials)
            else:
                self.port = self.server.add_insecure_port(addr)
        except RuntimeError:
            raise listen_error(self.host, self.port, "server") from None
        # "" and the service names report readiness (the producer's follows its consumers); "liveness"
        # only that the process serves, for liveness probes that must not restart a producer whose
        # consumer is down. Set before the port serves: a probe in between got NOT_FOUND for the
        # service name, which the producer reads as "not an SCD consumer"
        for name in ["", "liveness", *self._names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        for name, status in self.initial_health.items():
            await self.health.set(name, status)
        await self.server.start()
        for fn in self.on_start:
            await fn()
        return self.port

    async def stop(self, grace: float) -> None:
        """New requests are refused at once, on gRPC and on the fronts in ``on_stop``; requests in
        flight get ``grace`` seconds, then ``on_grace_expired`` ends them with an answer (the
        producer's say why), a little before the servers would cut them off."""
        if self.server is None:
            return
        await self.health.enter_graceful_shutdown()
        stops = asyncio.ensure_future(asyncio.gather(self.server.stop(grace + GRACE_MARGIN_S),
                                                     *(fn() for fn in self.on_stop)))
        done, _ = await asyncio.wait({stops}, timeout=grace)
        if not done:
            for fn in self.on_grace_expired:
                await fn()
        await stops

    async def serve_until_signal(self, grace: float) -> None:
        """Block until SIGTERM/SIGINT, then stop gracefully."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("signal received; stopping with %.1f s grace", grace)
        await self.stop(grace)
