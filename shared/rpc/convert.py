"""Protobuf <-> domain types (KServe's ``from_grpc``/``to_grpc``): the servicers call these, so no
engine ever sees a message. Tensor payloads are ``wire.py``'s business."""

from __future__ import annotations

from shared.domain import GenerateRequest, SamplingRequest, StreamHeader, Timings, TokenEvent
from shared.rpc import scd_pb2 as pb


def sampling_from_pb(s: pb.SamplingParams) -> SamplingRequest:
    return SamplingRequest(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                           stop=tuple(s.stop), seed=s.seed if s.HasField("seed") else None)


def sampling_to_pb(s: SamplingRequest) -> pb.SamplingParams:
    return pb.SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                             stop=list(s.stop), seed=s.seed)  # None leaves the optional field unset


def request_from_pb(r: pb.GenerateRequest) -> GenerateRequest:
    which = r.WhichOneof("prompt")
    prompt: str | tuple[int, ...] = r.text if which == "text" else tuple(r.token_ids.ids) if which else ""
    return GenerateRequest(prompt=prompt, consumer=r.consumer, method=r.method, method_params=dict(r.method_params),
                           sampling=sampling_from_pb(r.sampling),
                           native_prefix=r.native_prefix if r.HasField("native_prefix") else True,  # unset: on
                           request_id=r.request_id)


def request_to_pb(r: GenerateRequest) -> pb.GenerateRequest:
    out = pb.GenerateRequest(consumer=r.consumer, method=r.method, method_params=r.method_params,
                             sampling=sampling_to_pb(r.sampling), native_prefix=r.native_prefix,
                             request_id=r.request_id)
    if isinstance(r.prompt, str):
        out.text = r.prompt
    else:
        out.token_ids.ids.extend(r.prompt)
    return out


def header_to_pb(h: StreamHeader) -> pb.Header:
    return pb.Header(request_id=h.request_id, method=h.method, method_version=h.method_version,
                     protocol_version=h.protocol_version, pair_fingerprint=h.pair_fingerprint, n_layers=h.n_layers,
                     n_tokens=h.n_tokens, prompt_ids=list(h.prompt_ids), params=h.params,
                     sampling=sampling_to_pb(h.sampling), native_prefix=h.native_prefix, prefix_len=h.prefix_len,
                     consumer=h.consumer, deadline_unix=h.deadline_unix)


def header_from_pb(h: pb.Header) -> StreamHeader:
    return StreamHeader(request_id=h.request_id, method=h.method, method_version=h.method_version,
                        protocol_version=h.protocol_version, pair_fingerprint=h.pair_fingerprint,
                        n_layers=h.n_layers, n_tokens=h.n_tokens, prompt_ids=tuple(h.prompt_ids),
                        params=dict(h.params), sampling=sampling_from_pb(h.sampling), native_prefix=h.native_prefix,
                        prefix_len=h.prefix_len, consumer=h.consumer, deadline_unix=h.deadline_unix)


_TIMING_FIELDS = tuple(Timings.__dataclass_fields__)


def event_to_pb(e: TokenEvent) -> pb.TokenEvent:
    out = pb.TokenEvent(text=e.text, token_id=e.token_id, index=e.index, finish_reason=e.finish_reason,
                        request_id=e.request_id)
    if e.timings is not None:
        out.timings.CopyFrom(pb.Timings(**{f: getattr(e.timings, f) for f in _TIMING_FIELDS}))
    return out


def event_from_pb(e: pb.TokenEvent) -> TokenEvent:
    timings = Timings(**{f: getattr(e.timings, f) for f in _TIMING_FIELDS}) if e.HasField("timings") else None
    return TokenEvent(text=e.text, token_id=e.token_id, index=e.index, finish_reason=e.finish_reason,
                      request_id=e.request_id, timings=timings)
