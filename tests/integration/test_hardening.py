"""Hardening against an outside tester's classes of defects (tiny models, the real services): empty
answers, memory a stream may make the consumer allocate, out-of-range and non-text values over
HTTP, chunked bodies, consistent liars, undecodable envelopes, unbounded echoes, trickling peers,
the real status behind an aborted stream, and the small protocol checks (readiness is in
test_readiness.py). Each test fails on the code before these fixes. Every wait is a bounded poll;
nothing asserts a timing."""

from __future__ import annotations

import asyncio
import json
import tracemalloc

import grpc
import httpx2 as httpx
import lz4.frame
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ops_common import MD, PROMPT, TOKEN, cons, gen, http, idle, make_frames
from ops_support import wait_for

from shared.rpc import scd_pb2 as pb
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.wire import StreamTotals, chunk_crc, layer_frames
from tools import client

H = {"Authorization": f"Bearer {TOKEN}"}


def transfer(svc, consumer, frames, timeout=30):
    with grpc.insecure_channel(svc.consumer_addresses[consumer]) as ch:
        return list(pbg.ConsumerStub(ch).Transfer(iter(frames), timeout=timeout, metadata=MD))


def refused(svc, consumer, frames, timeout=30) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        transfer(svc, consumer, frames, timeout)
    return ei.value


# ---------------------------------------------------------------------------- 1. empty answers
def test_an_answer_that_stops_at_once_is_a_normal_empty_answer(svc, monkeypatch):
    for name in ("same", "chat"):  # every token is a stop token: the greedy answer is empty
        monkeypatch.setattr(cons(svc, name).engine, "stop_ids", frozenset(range(256)))
    events = list(client.stream(svc.producer_address, client.request(PROMPT, consumer="same", method="raw",
                                                                      max_new_tokens=32), token=TOKEN))
    assert len(events) == 1 and events[0].index == 0 and events[0].text == ""
    assert events[0].finish_reason == "stop" and events[0].timings.completion_tokens == 1  # the stop token
    r = httpx.post(http(svc) + "/v1/chat/completions", headers=H, timeout=60,
                   json={"model": "chat", "messages": [{"role": "user", "content": "tell me about the sea."}],
                         "max_tokens": 32})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["message"]["content"] == "" and c["finish_reason"] == "stop"
    r = httpx.post(http(svc) + "/v1/completions", headers=H, timeout=60,
                   json={"model": "chat", "prompt": "the sea", "max_tokens": 32, "stream": True})
    assert r.status_code == 200 and '"finish_reason": "stop"' in r.text and r.text.rstrip().endswith("[DONE]")


# ---------------------------------------------------------------------------- 2. memory amplification
def _declaring(layer, name, nbytes, dtype="U8"):
    raw = bytes(64)
    c = pb.TensorChunk(name=name, layer=layer, dtype=dtype, shape=[nbytes], offset=0, raw_size=len(raw),
                       data=lz4.frame.compress(raw))
    c.crc32c = chunk_crc(c, raw)
    return pb.KVFrame(chunk=c)


@pytest.mark.parametrize("name", ["k", "zz"])
def test_a_stream_declaring_huge_tensors_makes_the_consumer_allocate_nothing(svc, name):
    """64 chunks of 64 bytes that declare 256 MiB each: refused at the first, before anything is
    held (tracemalloc sees every allocation of the in-process consumer)."""
    frames = make_frames(svc, "same")[:1] + [_declaring(0, f"{name}{i}" if i else name, 256 << 20)
                                             for i in range(64)]
    tracemalloc.start()
    try:
        err = refused(svc, "same", frames)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "declare" in err.details()
    assert peak < 64 << 20, f"{peak:,} bytes allocated while refusing the stream"
    wait_for(lambda: idle(svc, "same"), what="the consumer to hold nothing")


def test_admission_charges_the_declared_payload_before_the_transfer(svc):
    eng = cons(svc, "same").engine
    from shared.domain import HeaderReceived
    from shared.rpc.convert import header_from_pb

    h = header_from_pb(make_frames(svc, "same")[0].header)
    req = eng.open(HeaderReceived(h).header)
    a = eng.adapter
    cache = (len(PROMPT) + req.sampling.max_new_tokens) * a.n_layers * 2 * a.n_kv_heads * a.head_dim * 4
    payload = a.n_layers * 2 * a.n_kv_heads * (len(PROMPT) - 1) * a.head_dim * 2  # raw fp16 K and V
    assert eng.cache_estimate(req) == cache + payload


# ---------------------------------------------------------------------------- 3. out-of-range values over HTTP
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", '{"model": "chat", "prompt": "hi there", "max_tokens": 4294967296}'),
    ("/v1/completions", '{"model": "chat", "prompt": "hi there", "seed": 18446744073709551616}'),
    ("/v1/completions", '{"model": "chat", "prompt": [5, -1]}'),
    ("/v1/completions", '{"model": "chat", "prompt": [5, 4294967296]}'),
    ("/v1/completions", '{"model": "chat", "prompt": [5, 999999]}'),
    ("/v1/completions", '{"model": "chat", "prompt": "\\ud800 sea"}'),
    ("/v1/chat/completions", '{"model": "chat", "messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("/v1/completions", '{"model": "chat", "prompt": "hi there", "temperature": NaN}'),
    ("/v1/completions", '{"model": "chat", "prompt": "hi there", "stop": ["\\ud800"]}'),
    ("/v1/completions", '{"model": "chat", "prompt": "hi there", "max_tokens": 100000}'),
    ("/v1/completions", '{"model": "' + "x" * 100_000 + '", "prompt": "hi there"}'),
    ("/v1/chat/completions", '{"model": "chat", "messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": 5}]}]}'),
    ("/v1/chat/completions", '{"model": "chat", "messages": [{"role": "user", "content": [7]}]}'),
    ("/v1/completions", '{"model": "chat", "prompt": "hi there", "method": "raw", "method_params": {"dtype": 5}}'),
    ("/v1/completions", '{"model": "chat", "prompt": "hi there", "method": "raw", "method_params": {"bogus": [1]}}'),
    ("/v1/completions", '[1, 2, 3]'),
    ("/v1/completions", '{"model": "chat", "prompt": "hi there", "max_tokens": true}'),  # not 1
    ("/v1/completions", '{"model": "chat", "prompt": "hi there", "stream": "yes"}'),
    ("/v1/completions", '{"model": "chat", "prompt": "hi there", "temperature": "0.5"}'),
    ("/v1/completions", '{"model": "chat", "prompt": [5, true]}'),
    ("/v1/completions", '{"model": "chat", "prompt": "hi there", "n": 2}'),
    ("/v1/chat/completions", '{"model": "chat", "messages": [{"role": "user"}]}'),
    ("/v1/chat/completions", '{"model": "chat", "messages": [{"role": "system", "content": " "}, '
                             '{"role": "user", "content": [{"type": "text", "text": ""}]}]}'),
    ("/v1/chat/completions", '{"model": "chat", "messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}'),
])
def test_bad_values_get_a_4xx_with_an_openai_error_body(svc, path, body):
    r = httpx.post(http(svc) + path, headers={**H, "content-type": "application/json"}, content=body.encode(),
                   timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["message"] and err["type"] and len(r.text) < 4000


@pytest.mark.parametrize("content_type,body,said", [
    ("application/json", b"", "the request has no body"),
    ("application/json", b"null", "the body must be a JSON object"),
    ("text/plain", b'{"model": "chat", "prompt": "hi there"}', "the body must be a JSON object with Content-Type"),
    ("application/json", b'{"model": "chat", "prompt": "hi there"} {}', "the body is not valid JSON (at character"),
    ("application/json", b'{"model": "chat", "prompt": "\\ud800 sea"}',
     "prompt holds a character that is not valid Unicode text at position 0"),
    ("application/json", b'{"model": "chat", "prompt": "\xff"}', "the body is not text (utf-8: invalid start byte"),
    ("application/json", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("application/json", b'{"model": "chat", "prompt": [5, -1]}',  # one complaint, not one per union branch
     "prompt: send a string or a list of token ids (whole numbers 0 to 4294967295), one prompt per request (item 1: "),
    ("application/json", b'{"model": "chat", "prompt": "hi there", "stop": 5}', "stop: send a string or a list of "
                                                                                "strings"),
    # valid JSON that Python's int() will not read: was "could not be read as JSON"
    ("application/json", b'{"model": "chat", "prompt": "hi", "max_tokens": ' + b"1" * 5000 + b"}",
     "a whole number of more than 4,300 digits"),
    ("application/json", b'{"model": "chat", "prompt": "hi", "user_note": ' + b"9" * 500_000 + b"}",
     "a whole number of more than 4,300 digits"),
])
def test_a_body_that_is_not_one_json_object_is_told_so(svc, content_type, body, said):
    r = httpx.post(http(svc) + "/v1/completions", headers={**H, "content-type": content_type}, content=body,
                   timeout=60)
    assert r.status_code == 400 and said in r.json()["error"]["message"], r.text[:300]
    assert ".str" not in r.text and "list[" not in r.text  # no union branch's type name


def test_null_in_nested_options_is_not_given_and_a_text_part_needs_its_text(svc):
    r = httpx.post(http(svc) + "/v1/completions", headers=H, timeout=60,
                   json={"model": "chat", "prompt": "hi there", "max_tokens": 2, "stream": True,
                         "stream_options": {"include_usage": None}})  # was a 400: "Input should be a valid boolean"
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text[:300]
    r = httpx.post(http(svc) + "/v1/chat/completions", headers=H, timeout=60,
                   json={"model": "chat", "max_tokens": 2,
                         "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text"}]}]})
    assert r.status_code == 400 and "a text part holds its text" in r.json()["error"]["message"], r.text[:300]
    r = httpx.post(http(svc) + "/v1/completions", headers=H, timeout=60,
                   json={"model": "chat", "prompt": "hi there", "best_of": 0})
    assert r.status_code == 400 and "best_of other than 1" in r.json()["error"]["message"], r.text[:300]


def test_method_params_may_be_json_values(svc):
    r = httpx.post(http(svc) + "/v1/chat/completions", headers=H, timeout=60,
                   json={"model": "chat", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                         "max_tokens": 2, "method": "raw", "method_params": {"dtype": "float32"}})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("consumer", ["", None])
def test_a_grpc_request_that_names_no_consumer_is_invalid_not_unknown(svc, consumer):
    from shared.rpc import scd_pb2 as pb

    req = pb.GenerateRequest(text="Hi there", **({} if consumer is None else {"consumer": consumer}))
    with pytest.raises(grpc.RpcError) as ei:
        list(client.stream(svc.producer_address, req, timeout=30, token=TOKEN))
    # was NOT_FOUND "unknown consumer ''"
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "names no consumer" in ei.value.details()
    assert gen(svc, consumer="same", method="raw", max_new_tokens=1).token_ids


def test_a_one_token_prompt_is_served(svc):
    r = httpx.post(http(svc) + "/v1/completions", headers=H, timeout=60,
                   json={"model": "chat", "prompt": [7], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 2  # the document-start token, then the prompt
    assert gen(svc, consumer="same", method="raw", prompt=[7], max_new_tokens=2).token_ids


def test_bearer_scheme_is_case_insensitive(svc):
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert httpx.get(http(svc) + "/v1/models", headers={"Authorization": f"{scheme} {TOKEN}"}).status_code == 200
        with grpc.insecure_channel(svc.consumer_addresses["same"]) as ch:
            md = (("authorization", f"{scheme} {TOKEN}"),)
            assert pbg.ConsumerStub(ch).Info(pb.InfoRequest(), timeout=10, metadata=md).name == "same"
    assert httpx.get(http(svc) + "/v1/models", headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401


# ---------------------------------------------------------------------------- 4. restart
def test_a_restarted_http_front_binds_its_port_at_once():
    """The old run's connections linger in TIME_WAIT; the new run must still bind (SO_REUSEADDR)."""
    from fastapi import FastAPI

    from shared.rpc.http import HTTPServer

    async def main():
        app = FastAPI()

        @app.get("/ping")
        async def ping():
            return {"ok": True}

        first = HTTPServer(app, "127.0.0.1", 0, grace_s=1)
        port = await first.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        assert b"200" in await reader.readline()
        await first.stop()  # the server closes the kept-alive connection first: its side waits in TIME_WAIT
        writer.close()
        second = HTTPServer(app, "127.0.0.1", port, grace_s=1)
        assert await second.start() == port
        await second.stop()

    asyncio.run(main())


# ---------------------------------------------------------------------------- 5. chunked bodies
def test_a_chunked_body_over_the_limit_is_413_as_it_arrives(svc):
    limit = svc.producer_engine.settings.max_http_body_bytes
    sent = {"n": 0}

    def body():
        yield b'{"model": "chat", "prompt": "'
        for _ in range(4 * limit // 65536):
            sent["n"] += 65536
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(http(svc) + "/v1/completions", headers={**H, "content-type": "application/json"},
                   content=body(), timeout=60)
    assert r.status_code == 413 and "max_http_body_bytes" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- 6. consistent liars
def _raw_stream(svc, consumer, edit):
    """A raw stream of PROMPT whose layer-1 tensors pass through ``edit`` (checksums recomputed)."""
    frames = make_frames(svc, consumer)
    header, totals = frames[0], StreamTotals()
    from shared.codecs import CodecContext, make_method
    from shared.model.hf_adapter import ModelAdapter

    ad = ModelAdapter(svc._consumers[0].adapter.model)
    state, m = ad.prefill(PROMPT[:-1]), make_method("raw", CodecContext(ad))
    out = [totals.add(header)]
    for layer in range(ad.n_layers):
        tensors = m.encode_layer(state, layer, 0)
        out += [totals.add(f) for f in layer_frames(layer, edit(tensors) if layer == 1 else tensors)]
    return out + [totals.trailer()]


def _nan(t):
    t = t.clone()
    t[0, 0, 0, 0] = float("nan")
    return t


@pytest.mark.parametrize("case,edit,code", [
    ("bf16 where f16 is declared", lambda t: {**t, "k": t["k"].bfloat16()}, grpc.StatusCode.INVALID_ARGUMENT),
    ("i32 where f16 is declared", lambda t: {**t, "k": t["k"].view(torch.int32)}, grpc.StatusCode.INVALID_ARGUMENT),
    ("a row short", lambda t: {**t, "v": t["v"][:, :, 1:].contiguous()}, grpc.StatusCode.INVALID_ARGUMENT),
    ("an extra tensor", lambda t: {**t, "r_scale": torch.ones(1, dtype=torch.float16)},
     grpc.StatusCode.INVALID_ARGUMENT),
    ("NaN", lambda t: {**t, "k": _nan(t["k"])}, grpc.StatusCode.DATA_LOSS),
    ("Inf", lambda t: {**t, "v": t["v"] * float("inf")}, grpc.StatusCode.DATA_LOSS),
])
def test_a_consistent_liar_is_refused(svc, case, edit, code):
    err = refused(svc, "same", _raw_stream(svc, "same", edit))
    assert err.code() == code, (case, err.details())
    wait_for(lambda: idle(svc, "same"), what="the consumer to hold nothing")


def test_trailer_raw_bytes_are_checked(svc):
    frames = make_frames(svc, "same")
    frames[-1].trailer.raw_bytes += 1
    assert refused(svc, "same", frames).code() == grpc.StatusCode.DATA_LOSS


def test_recompute_fallback_drains_the_stream(svc):
    c = cons(svc, "picky-recompute")
    before = c.metrics.value("frames_total", method="raw")
    frames = make_frames(svc, "picky-recompute")
    events = transfer(svc, "picky-recompute", frames)
    assert events[-1].timings.fallback_recompute
    assert c.metrics.value("frames_total", method="raw") - before == len(frames)


# ---------------------------------------------------------------------------- 8. undecodable envelopes
def test_undecodable_messages_are_invalid_argument_or_data_loss(svc):
    ident = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with grpc.insecure_channel(svc.consumer_addresses["same"]) as ch:
        call = ch.stream_stream("/scd.v1.Consumer/Transfer", **ident)
        with pytest.raises(grpc.RpcError) as ei:
            list(call(iter([b"\xff\xff\xff"]), metadata=MD, timeout=30))
        assert ei.value.code() == grpc.StatusCode.DATA_LOSS
    with grpc.insecure_channel(svc.producer_address) as ch:
        call = ch.unary_stream("/scd.v1.Producer/Generate", **ident)
        bad_utf8 = b"\x0a\x02\xff\xfe" + pb.GenerateRequest(consumer="same").SerializeToString()
        with pytest.raises(grpc.RpcError) as ei:
            list(call(bad_utf8, metadata=MD, timeout=30))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in ei.value.details()
    assert gen(svc, consumer="same", method="raw", max_new_tokens=2).token_ids


# ---------------------------------------------------------------------------- 9. unbounded echo
def test_errors_and_events_do_not_grow_with_the_input(svc):
    with pytest.raises(grpc.RpcError) as ei:
        gen(svc, consumer="c" * 100_000, method="raw", max_new_tokens=2)
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND and len(ei.value.details()) < 1100
    with pytest.raises(grpc.RpcError) as ei:
        req = client.request(PROMPT, consumer="same", method="raw", max_new_tokens=2)
        req.request_id = "r" * 2_000_000
        client.generate(svc.producer_address, req, token=TOKEN, timeout=60)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(ei.value.details()) < 1100
    frames = make_frames(svc, "same")
    frames[0].header.consumer = "n" * 100_000
    err = refused(svc, "same", frames)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and len(err.details()) < 1100


# ---------------------------------------------------------------------------- 10. trickling peers
def test_a_trickling_stream_loses_its_slot_long_before_the_deadline(svc):
    frames = make_frames(svc, "trickle")

    def slow():
        yield frames[0]
        for f in frames[1:]:
            import time

            time.sleep(0.4)  # a few hundred bytes every 0.4 s: far under 200 kB/s
            yield f

    with grpc.insecure_channel(svc.consumer_addresses["trickle"]) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            list(pbg.ConsumerStub(ch).Transfer(slow(), timeout=120, metadata=MD))
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "min_progress_bytes_per_s" in ei.value.details()
    wait_for(lambda: idle(svc, "trickle"), what="the slot to be freed")


def test_a_long_prefill_before_the_first_frame_is_not_taken_for_trickling(svc):
    """The producer sends its header, then prefills (seconds for a long prompt on a CPU): that wait is
    bounded by the frame lease, not by the minimum progress rate, which starts with the data."""
    frames = make_frames(svc, "trickle", max_new=2)

    def prefill_then_stream():
        import time

        yield frames[0]
        time.sleep(1.5)  # 3x the grace: the old watchdog aborted here with "0.0 s of waiting"
        yield from frames[1:]

    with grpc.insecure_channel(svc.consumer_addresses["trickle"]) as ch:
        events = list(pbg.ConsumerStub(ch).Transfer(prefill_then_stream(), timeout=60, metadata=MD))
    assert events and events[-1].finish_reason and not any(e.HasField("error") for e in events)
    wait_for(lambda: idle(svc, "trickle"), what="the slot to be freed")


# ---------------------------------------------------------------------------- 11. the real status reaches the client
def test_an_aio_sender_still_writing_learns_the_real_status_in_band(svc):
    """A grpc.aio sender that keeps writing after the consumer has failed the stream may see only
    INTERNAL "Internal error from Core" as the call's status (a race in gRPC core): the consumer
    sends the status in band first, as the last message, which is what the producer relays."""
    frames = make_frames(svc, "same")
    frames[2].chunk.crc32c ^= 1
    body = frames[:-1]

    async def once():
        async with grpc.aio.insecure_channel(svc.consumer_addresses["same"]) as ch:
            async def writes():
                for f in body:
                    yield f
                for _ in range(2000):  # keeps writing after the consumer has failed the request
                    yield body[5]
                    await asyncio.sleep(0)

            got = []
            with pytest.raises(grpc.aio.AioRpcError):
                async for ev in pbg.ConsumerStub(ch).Transfer(writes(), metadata=MD, timeout=30):
                    got.append(ev)
            return got

    async def main():
        return [await once() for _ in range(8)]

    for got in asyncio.run(main()):
        assert len(got) == 1 and got[0].error.code == "DATA_LOSS" and "crc32c" in got[0].error.message
    wait_for(lambda: idle(svc, "same"), what="the consumer to hold nothing")


def test_the_consumers_status_reaches_the_client_while_the_producer_still_writes(svc):
    long_prompt = (PROMPT * 20)[:600]
    for _ in range(5):
        with pytest.raises(grpc.RpcError) as ei:
            gen(svc, consumer="short", method="raw", prompt=long_prompt, max_new_tokens=2)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
        assert "takes 2 to 8" in ei.value.details()


# ---------------------------------------------------------------------------- the classes, not the examples
_ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=40), st.lists(st.integers(-2**40, 2**40), max_size=4),
                 st.lists(st.dictionaries(st.sampled_from(["role", "content", "type", "text"]),
                                          st.one_of(st.text(max_size=10), st.integers(), st.none()), max_size=3),
                          max_size=2),
                 st.dictionaries(st.text(max_size=8), st.one_of(st.text(max_size=8), st.integers()), max_size=2))
_KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
         "stream", "n", "method", "method_params", "native_prefix", "logprobs", "echo"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       edits=st.dictionaries(st.sampled_from(_KEYS), _ANY, min_size=1, max_size=3))
def test_any_http_body_gets_a_non_5xx_answer_with_an_openai_error_when_refused(svc, path, edits):
    body = {"model": "chat", "max_tokens": 2,
            **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hello there"}),
            **edits}
    data = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    r = httpx.post(http(svc) + path, headers={**H, "content-type": "application/json"}, content=data, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(consumer=st.sampled_from(["same", "chat", "short", "nope", ""]),
       method=st.sampled_from(["", "raw", "oracle", "scd", "bogus"]),
       params=st.dictionaries(st.sampled_from(["dtype", "patch_layers", "x"]),
                              st.sampled_from(["", "float32", "[1]", "nan", "x" * 300]), max_size=2),
       max_new=st.sampled_from([0, 1, 600, 2**32 - 1]), temperature=st.floats(allow_nan=True, allow_infinity=True),
       top_p=st.floats(allow_nan=True, allow_infinity=True), stop=st.lists(st.text(max_size=300), max_size=20),
       prompt=st.one_of(st.text(max_size=50), st.lists(st.integers(0, 2**32 - 1), max_size=30)))
def test_any_generate_request_gets_a_precise_status(svc, consumer, method, params, max_new, temperature, top_p, stop,
                                                    prompt):
    req = client.request(prompt, consumer=consumer, method=method, max_new_tokens=max_new, temperature=temperature,
                         top_p=top_p, stop=tuple(stop), method_params=params)
    try:
        client.generate(svc.producer_address, req, token=TOKEN, timeout=60)
    except grpc.RpcError as e:
        assert e.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), e.details()
        assert len(e.details()) <= 1024


