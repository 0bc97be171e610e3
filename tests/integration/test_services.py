"""Both services in-process on free ports, tiny models: streaming, exactness and bad input."""

from typing import NamedTuple

import grpc
import pytest
import torch

from consumer_service.engine import ConsumerEngine
from consumer_service.settings import ConsumerSettings
from producer_service.engine import ProducerEngine
from producer_service.settings import ProducerSettings
from shared.model.hf_adapter import ModelAdapter
from shared.model.tiny import perturbed, tiny_model
from tools import client
from tools.inprocess import InProcessServices

PROMPT = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()


def _consumer(name, model, **kw):
    s = ConsumerSettings.load(model={"path": "unused"}, server={"port": 0}, name=name, methods=["oracle", "raw"], **kw)
    return ConsumerEngine(s, model)


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama", n_layers=4)


@pytest.fixture(scope="module")
def services(base):
    consumers = [
        _consumer("same", base),
        _consumer("other", perturbed(base, 0.3)),
        _consumer("picky", base, producer_fingerprint="0000000000000000"),
    ]

    def make_producer(addresses):
        s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, default_method="raw",
                                  consumers={n: {"address": a} for n, a in addresses.items()})
        return ProducerEngine(s, base)

    with InProcessServices(consumers, make_producer) as svc:
        yield svc


def _gen(svc, **kw):
    prompt = kw.pop("prompt", PROMPT)
    return client.generate(svc.producer_address, client.request(prompt, **kw), timeout=60)


def _local_greedy(model, n):
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(PROMPT):].tolist()


def test_lossless_raw_is_token_identical_to_local_decode(services, base):
    res = _gen(services, consumer="same", method="raw", method_params={"dtype": "float32"}, max_new_tokens=12)
    assert res.token_ids == _local_greedy(base, 12)
    assert res.finish_reason == "length"
    t = res.timings
    assert t.method == "raw" and t.completion_tokens == 12 and t.prompt_tokens == len(PROMPT)
    expect = 2 * 4 * base.config.num_key_value_heads * 16 * (len(PROMPT) - 1) * 4  # K,V x layers x fp32
    assert expect * 0.5 < t.payload_bytes < expect * 1.05 and t.wire_bytes > t.payload_bytes
    assert t.ttft_ms > 0 and t.reconstruct_ms > 0


def test_oracle_sends_only_ids_and_matches_consumer_prefill(services):
    res = _gen(services, consumer="other", method="oracle", max_new_tokens=8)
    other = services._consumers[1].adapter.model
    assert res.token_ids == _local_greedy(other, 8)
    assert res.timings.payload_bytes == 0


def test_fp16_raw_to_a_drifted_consumer_streams(services):
    res = _gen(services, consumer="other", method="raw", max_new_tokens=6)
    assert len(res.token_ids) == 6 and res.timings.payload_bytes > 0


class Bad(NamedTuple):
    info: str
    kwargs: dict
    code: grpc.StatusCode
    says: str


BAD = [
    Bad("empty prompt", dict(prompt=[], consumer="same"), grpc.StatusCode.INVALID_ARGUMENT, "token"),
    Bad("empty text", dict(prompt="   ", consumer="same"), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    Bad("oversized prompt", dict(prompt=[1] * 9000, consumer="same"), grpc.StatusCode.INVALID_ARGUMENT, "limit"),
    Bad("token out of vocab", dict(prompt=[1, 99999], consumer="same"), grpc.StatusCode.INVALID_ARGUMENT, "vocab"),
    Bad("unknown consumer", dict(consumer="nope"), grpc.StatusCode.NOT_FOUND, "unknown consumer"),
    Bad("several consumers in one call", dict(consumer="same,picky"), grpc.StatusCode.INVALID_ARGUMENT,
        "call Generate once per consumer"),
    Bad("unknown method", dict(consumer="same", method="magic"), grpc.StatusCode.NOT_FOUND, "magic"),
    Bad("bad method setting", dict(consumer="same", method="raw", method_params={"dtype": "int3"}),
        grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
    Bad("negative temperature", dict(consumer="same", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT,
        "temperature"),
    Bad("top_p above 1", dict(consumer="same", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    Bad("too many new tokens", dict(consumer="same", max_new_tokens=100000), grpc.StatusCode.INVALID_ARGUMENT,
        "max_new_tokens"),
    Bad("fingerprint mismatch", dict(consumer="picky", method="raw"), grpc.StatusCode.INTERNAL,
        "accepts streams of producer weights '0000000000000000' only"),
    Bad("a method the pair is not calibrated for", dict(consumer="same", method="scd"),
        grpc.StatusCode.FAILED_PRECONDITION, "run `scd calibrate --pair same`, then restart the producer"),
]


@pytest.mark.parametrize("case", BAD, ids=[b.info for b in BAD])
def test_bad_input_gets_clear_status_and_service_keeps_serving(services, case):
    with pytest.raises(grpc.RpcError) as ei:
        _gen(services, **case.kwargs)
    assert ei.value.code() == case.code, \
        f"{case.info}: expected {case.code}, got {ei.value.code()}: {ei.value.details()}"
    assert case.says in ei.value.details(), ei.value.details()
    ok = _gen(services, consumer="same", method="raw", max_new_tokens=2)
    assert len(ok.token_ids) == 2


def _frames(base, mutate=None, drop_layer=None, shape_t=None):
    """A valid raw stream for PROMPT, optionally corrupted."""
    from shared.codecs import CodecContext, make_method
    from shared.rpc import scd_pb2 as pb
    from shared.rpc.wire import PROTOCOL_VERSION, StreamTotals, layer_frames

    ad = ModelAdapter(base)
    m = make_method("raw", CodecContext(ad))
    state = ad.prefill(PROMPT[:-1])
    totals = StreamTotals()
    out = [totals.add(pb.KVFrame(header=pb.Header(
        request_id="x", method="raw", method_version=1, protocol_version=PROTOCOL_VERSION, pair_fingerprint="f:raw",
        n_layers=ad.n_layers, n_tokens=len(PROMPT) - 1, prompt_ids=PROMPT, consumer="same",
        sampling=pb.SamplingParams(max_new_tokens=2))))]
    for layer in range(ad.n_layers):
        if layer == drop_layer:
            continue
        tensors = m.encode_layer(state, layer, 0)
        if shape_t is not None:
            tensors = {k: v[:, :, :shape_t] for k, v in tensors.items()}
        out += [totals.add(f) for f in layer_frames(layer, tensors)]
    out.append(totals.trailer())
    if mutate:
        mutate(out)
    return out


@pytest.mark.parametrize("info,kw,code", [
    ("bad checksum", dict(mutate=lambda fs: setattr(fs[3].chunk, "crc32c", fs[3].chunk.crc32c ^ 1)),
     grpc.StatusCode.DATA_LOSS),
    ("missing layer", dict(drop_layer=1), grpc.StatusCode.INVALID_ARGUMENT),
    ("wrong shape", dict(shape_t=10), grpc.StatusCode.INVALID_ARGUMENT),
    ("wrong dtype", dict(mutate=lambda fs: setattr(fs[1].chunk, "dtype", "F64")), grpc.StatusCode.INVALID_ARGUMENT),
    ("no trailer", dict(mutate=lambda fs: fs.pop()), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_corrupt_streams_are_refused_and_the_consumer_keeps_serving(services, base, info, kw, code):
    from shared.rpc import scd_pb2_grpc as pbg

    with grpc.insecure_channel(services.consumer_addresses["same"]) as ch:
        stub = pbg.ConsumerStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Transfer(iter(_frames(base, **kw)), timeout=30))
        assert ei.value.code() == code, f"{info}: {ei.value.code()} {ei.value.details()}"
        ok = list(stub.Transfer(iter(_frames(base)), timeout=30))
        assert len(ok) == 2 and ok[-1].finish_reason == "length"


def test_a_producer_says_which_methods_an_uncalibrated_consumer_is_refused_and_what_it_is_served(base, caplog):
    """A pair registered and served before its calibration: every request that named no method was
    refused (the default is scd) with no word at start, and the refusal did not say what would be
    served."""
    from shared.domain import GenerateRequest
    from shared.errors import PreconditionFailed

    s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0},
                              consumers={"fresh": {"address": "127.0.0.1:1"}})
    with caplog.at_level("WARNING", logger="scd.producer"):
        engine = ProducerEngine(s, base)
    said = caplog.text
    assert "consumer 'fresh' has no calibration for scd-reuse, scd, auto: requests for them are refused" in said
    assert "The default method 'scd' is one of them" in said
    # each command that makes them (auto's table is --method auto: it said `scd calibrate --pair fresh` only)
    assert "run `scd calibrate --pair fresh` and `scd calibrate --pair fresh --method auto`, then restart" in said
    assert engine.servable("fresh") == ["oracle", "raw", "quant"]
    with pytest.raises(PreconditionFailed) as e:
        engine.prepare(GenerateRequest(prompt=tuple(PROMPT), consumer="fresh"))
    assert e.value.param == "method"
    assert str(e.value).startswith("the request names no method and the producer's default, 'scd', needs "
                                   "calibration artifacts for consumer 'fresh': name a method it is served "
                                   "(oracle, raw, quant), or run `scd calibrate --pair fresh`, then restart")
    with pytest.raises(PreconditionFailed, match="^method 'auto' needs the operating table for consumer 'fresh': "
                                                 "run `scd calibrate --pair fresh --method auto`, then restart"):
        engine.prepare(GenerateRequest(prompt=tuple(PROMPT), consumer="fresh", method="auto"))
    served = engine.prepare(GenerateRequest(prompt=tuple(PROMPT), consumer="fresh", method="quant"))
    assert served.method.kind == "quant"
