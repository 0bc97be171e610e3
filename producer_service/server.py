"""Build and run a producer server."""

from __future__ import annotations

from pathlib import Path

from producer_service.engine import ProducerEngine
from producer_service.servicer import ProducerServicer
from producer_service.settings import ProducerSettings
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.server import GRPCServer


def load_engine(settings: ProducerSettings) -> ProducerEngine:
    from shared.model.loading import load_model, load_tokenizer

    path = Path(settings.model.path).expanduser()
    model = load_model(path, settings.model.device, settings.model.torch_dtype(), settings.model.adapter)
    return ProducerEngine(settings, model, load_tokenizer(path, required=False))


def build_server(engine: ProducerEngine) -> tuple[GRPCServer, ProducerServicer]:
    """The producer's gRPC server (token check and TLS when configured) and, when http.port is set,
    its OpenAI-compatible HTTP front with /health and /metrics, started and stopped with it."""
    from shared.rpc.security import BearerAuthInterceptor

    s = engine.settings
    s.security.check()
    servicer = ProducerServicer(engine)
    token = s.security.bearer()
    interceptors = [BearerAuthInterceptor(token, servicer.metrics.auth_failures.labels("grpc").inc)] if token else []
    server = GRPCServer(lambda srv: pbg.add_ProducerServicer_to_server(servicer, srv), s.server.host, s.server.port,
                        ["scd.v1.Producer"], interceptors, s.security.server_credentials())

    # set before the port serves: until the first probe answers each consumer, and so the producer, is
    # NOT_SERVING (a probe in between got NOT_FOUND for a configured consumer, and SERVING overall)
    server.initial_health = servicer.health_statuses()

    async def probes():
        servicer.start_probes(server.health)

    server.on_start.append(probes)
    server.on_grace_expired.append(servicer.shed_inflight)
    server.http = None
    if s.http.port is not None:
        from producer_service.http import make_app
        from shared.rpc.http import HTTPServer

        server.http = HTTPServer(make_app(servicer, token), s.http.host, s.http.port, s.security, s.server.grace_s,
                                 s.http.read_timeout_s)
        server.on_start.append(server.http.start)
        server.on_stop.append(server.http.stop)
    return server, servicer
