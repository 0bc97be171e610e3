"""Build and run a consumer server."""

from __future__ import annotations

from consumer_service.engine import ConsumerEngine
from consumer_service.servicer import ConsumerServicer
from consumer_service.settings import ConsumerSettings
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.server import GRPCServer


def load_engine(settings: ConsumerSettings) -> ConsumerEngine:
    from pathlib import Path

    from shared.model.loading import load_model, load_tokenizer

    path = Path(settings.model.path).expanduser()
    model = load_model(path, settings.model.device, settings.model.torch_dtype(), settings.model.adapter)
    tok = settings.tokenizer
    return ConsumerEngine(settings, model, load_tokenizer(Path(tok).expanduser(), required=True) if tok else
                          load_tokenizer(path, required=False))


def build_server(engine: ConsumerEngine) -> GRPCServer:
    """The consumer's gRPC server (with its token check and TLS when configured) and, when http.port
    is set, its /metrics and /health HTTP server, started and stopped with it. The servicer is
    ``server.servicer`` (its ``metrics`` and ``admission`` are what the tests inspect)."""
    from shared.rpc.security import BearerAuthInterceptor

    s = engine.settings
    s.security.check()
    servicer = ConsumerServicer(engine)
    metrics = engine.metrics
    token = s.security.bearer()
    interceptors = [BearerAuthInterceptor(token, metrics.auth_failures.labels("grpc").inc)] if token else []
    server = GRPCServer(lambda srv: pbg.add_ConsumerServicer_to_server(servicer, srv), s.server.host, s.server.port,
                        ["scd.v1.Consumer"], interceptors, s.security.server_credentials())
    server.servicer = servicer
    server.on_grace_expired.append(servicer.shed_inflight)
    server.http = None
    if s.http.port is not None:
        from shared.rpc.http import HTTPServer, metrics_app

        server.http = HTTPServer(metrics_app(metrics, token), s.http.host, s.http.port, s.security, s.server.grace_s,
                                 s.http.read_timeout_s)
        server.on_start.append(server.http.start)
        server.on_stop.append(server.http.stop)
    return server
