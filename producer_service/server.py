"""Build and run a producer server."""

from __future__ import annotations

from pathlib import Path

from producer_service.engine import ProducerEngine
from producer_service.servicer import ProducerServicer
from producer_service.settings import ProducerSettings
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.server import GRPCServer


def load_engine(settings: ProducerSettings) -> ProducerEngine:
    from shared.assets.models import load_model, load_tokenizer

    path = Path(settings.model.path).expanduser()
    model = load_model(path, settings.model.device, settings.model.torch_dtype())
    return ProducerEngine(settings, model, load_tokenizer(path, required=False))


def build_server(engine: ProducerEngine) -> tuple[GRPCServer, ProducerServicer]:
    s = engine.settings.server
    servicer = ProducerServicer(engine)
    return GRPCServer(lambda srv: pbg.add_ProducerServicer_to_server(servicer, srv), s.host, s.port,
                      ["scd.v1.Producer"]), servicer
