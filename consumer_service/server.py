"""Build and run a consumer server."""

from __future__ import annotations

from consumer_service.engine import ConsumerEngine
from consumer_service.servicer import ConsumerServicer
from consumer_service.settings import ConsumerSettings
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.server import GRPCServer


def load_engine(settings: ConsumerSettings) -> ConsumerEngine:
    from pathlib import Path

    from shared.assets.models import load_model, load_tokenizer

    path = Path(settings.model.path).expanduser()
    model = load_model(path, settings.model.device, settings.model.torch_dtype())
    return ConsumerEngine(settings, model, load_tokenizer(path, required=False))


def build_server(engine: ConsumerEngine) -> GRPCServer:
    s = engine.settings.server
    return GRPCServer(lambda srv: pbg.add_ConsumerServicer_to_server(ConsumerServicer(engine), srv),
                      s.host, s.port, ["scd.v1.Consumer"])
