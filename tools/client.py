"""A small synchronous client of the producer's Generate API (used by the CLI, demo and tests)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import grpc

from shared.config import BENCH_HOLD_METADATA
from shared.rpc import scd_pb2 as pb
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.diagnose import socket_problem, unreached, with_reason
from shared.rpc.server import OPTIONS

BENCH_HOLD = ((BENCH_HOLD_METADATA, "1"),)  # benchmarks: encode, then reconstruct, every layer at once


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    timings: pb.Timings | None = None
    client_ttft_ms: float = 0.0


def request(prompt: str | list[int], consumer: str, method: str = "", max_new_tokens: int = 32,
            temperature: float = 0.0, top_p: float = 1.0, stop: tuple[str, ...] = (), seed: int | None = None,
            native_prefix: bool = True, method_params: dict[str, str] | None = None) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        consumer=consumer, method=method, native_prefix=native_prefix, method_params=method_params or {},
        sampling=pb.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                   stop=list(stop), seed=seed),
    )
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def channel(address: str, root_certificates: bytes | None = None) -> grpc.Channel:
    """An insecure channel, or a TLS one verified against ``root_certificates`` (PEM) when given."""
    if root_certificates is not None:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates), options=OPTIONS)
    return grpc.insecure_channel(address, options=OPTIONS)


def stream(address: str, req: pb.GenerateRequest, timeout: float = 120.0, token: str | None = None,
           root_certificates: bytes | None = None, metadata: tuple = ()) -> Iterator[pb.TokenEvent]:
    md = ((("authorization", f"Bearer {token}"),) if token else ()) + tuple(metadata)
    with channel(address, root_certificates) as ch:
        yield from pbg.ProducerStub(ch).Generate(req, timeout=timeout, metadata=md or None)


def generate(address: str, req: pb.GenerateRequest, timeout: float = 120.0, on_event=None, token: str | None = None,
             root_certificates: bytes | None = None, metadata: tuple = ()) -> Result:
    """``metadata``: extra gRPC metadata, e.g. ``BENCH_HOLD`` (honoured only by servers started with
    ``bench.hold_layers``)."""
    res = Result()
    t0 = time.perf_counter()
    for ev in stream(address, req, timeout, token, root_certificates, metadata):
        if not res.token_ids:
            res.client_ttft_ms = (time.perf_counter() - t0) * 1e3
        res.token_ids.append(ev.token_id)
        res.text += ev.text
        if ev.finish_reason:
            res.finish_reason = ev.finish_reason
        if ev.HasField("timings"):
            res.timings = ev.timings
        if on_event:
            on_event(ev)
    return res


def explain(address: str, err: grpc.RpcError, root_certificates: bytes | None = None, timeout: float = 2.0) -> str:
    """``err`` from a call to the producer at ``address``, said for whoever gave the address: when the
    call never reached an SCD producer (nothing listening, an HTTP port, TLS on one side only, a
    certificate that does not verify, another gRPC service) what answers there instead; the producer's
    own errors (an unknown consumer, one that is down) as they are."""
    return with_reason(what_answers(address, root_certificates, timeout) if unreached(err) else None, err)


def what_answers(address: str, root_certificates: bytes | None = None, timeout: float = 2.0) -> str | None:
    """Why ``address`` is not an SCD producer this client can use; None when a producer answers."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def serves(service: str) -> grpc.StatusCode | None:
        with channel(address, root_certificates) as ch:
            try:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
                return None
            except grpc.RpcError as e:
                return e.code()

    got = serves("scd.v1.Producer")
    if got is None or got == grpc.StatusCode.UNAUTHENTICATED:
        return None  # a producer: its own error stands
    if got in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
        if serves("scd.v1.Consumer") is None:
            return f"{address} is an SCD consumer, not the producer: give the producer's gRPC address"
        return f"{address} is a gRPC server but not an SCD producer: give the producer's gRPC address"
    problem = socket_problem(address, root_certificates, "--tls-ca", "producer", timeout)
    return f"{address} {problem.said}" if problem else None

