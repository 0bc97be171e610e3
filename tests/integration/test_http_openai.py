"""The OpenAI front's contract beyond well-formed values: features this server lacks are refused with
the field named (never answered without them), their neutral values are served, and settings errors
read as one plain sentence (no validator report)."""

from __future__ import annotations

import httpx2 as httpx
import pytest
from ops_common import PROMPT, TOKEN, http

H = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize("path,extra,field", [
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"suffix": " end"}, "suffix"),
    ("/v1/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/completions", {"presence_penalty": -1}, "presence_penalty"),
    ("/v1/completions", {"logit_bias": {"5": -100}}, "logit_bias"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"max_tokens": 3, "max_completion_tokens": 5}, "max_completion_tokens"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
     "modalities"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
])
def test_an_openai_feature_the_server_lacks_is_refused_not_ignored(svc, path, extra, field):
    """An answer without what was asked for (logprobs, JSON output, a tool call) would look like a
    normal one; the 400 names the field instead."""
    body = {"model": "chat", "max_tokens": 2, **extra, **({"messages": [{"role": "user", "content": "hi"}]}
                                                          if "chat" in path else {"prompt": "hi there"})}
    r = httpx.post(http(svc) + path, headers=H, json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    msg = r.json()["error"]["message"]
    assert f"{field}: " in msg and "Value error" not in msg, msg


@pytest.mark.parametrize("neutral", [{"echo": False}, {"logprobs": None}, {"best_of": 1}, {"frequency_penalty": 0},
                                     {"presence_penalty": 0.0}, {"logit_bias": {}}, {"suffix": ""}])
def test_neutral_values_of_unsupported_features_are_served(svc, neutral):
    r = httpx.post(http(svc) + "/v1/completions", headers=H, timeout=60,
                   json={"model": "chat", "prompt": "hi there", "max_tokens": 2, **neutral})
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_null_is_the_default_of_every_optional_field(svc, path):
    """OpenAI's API takes null for an optional field (client libraries send ``temperature: null``);
    ``temperature``, ``top_p``, ``n``, ``stream`` and the SCD fields answered 400 "should be a valid
    number"."""
    nulls = {k: None for k in ("temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
                               "max_completion_tokens", "method", "method_params", "native_prefix", "modalities",
                               "audio", "logprobs", "tools", "tool_choice", "response_format")}
    body = {"model": "chat", "max_tokens": 2, **nulls, **({"messages": [{"role": "user", "content": "hi"}]}
                                                          if "chat" in path else {"prompt": "hi there"})}
    r = httpx.post(http(svc) + path, headers=H, json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text[:300]
    r = httpx.post(http(svc) + path, headers=H, json={**body, "model": None}, timeout=60)  # not for what is required
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text[:300]


@pytest.mark.parametrize("path,extra,said", [
    ("/v1/chat/completions", {"response_format": {"type": "text"}, "tools": [], "tool_choice": "auto",
                              "max_tokens": 2, "max_completion_tokens": 2}, None),
    ("/v1/completions", {"temperature": 11}, "invalid sampling settings: temperature: Input should be less than"),
    ("/v1/completions", {"stop": [""]},
     "invalid sampling settings: stop: send at most 16 stop strings of 1 to 256 characters"),
    ("/v1/completions", {"stop": ["x" * 257]},
     "invalid sampling settings: stop: send at most 16 stop strings of 1 to 256 characters"),
    ("/v1/completions", {"top_p": 0, "temperature": 1.0}, "top_p: Input should be greater than 0"),
    ("/v1/completions", {"method": "raw", "method_params": {"bogus": "1"}},
     "invalid settings for method 'raw': bogus: not a known setting (its settings: dtype"),
])
def test_settings_errors_read_as_one_plain_sentence(svc, path, extra, said):
    body = {"model": "chat", "max_tokens": 2, **extra, **({"messages": [{"role": "user", "content": "hi"}]}
                                                          if "chat" in path else {"prompt": "hi there"})}
    r = httpx.post(http(svc) + path, headers=H, json=body, timeout=60)
    if said is None:
        assert r.status_code == 200, r.text[:300]
        return
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and said in msg, msg
    assert "pydantic" not in msg and "[type=" not in msg and "validation error for" not in msg, msg
    # the producer's own check, before its prefill, as every consumer's (not relayed: "consumer 'chat': ...")
    assert not msg.startswith("consumer"), msg


@pytest.mark.parametrize("method,said", [("droidspeak", "transfer method 'droidspeak' is not enabled on this producer"),
                                         ("droidspeek", "unknown transfer method 'droidspeek'")])
def test_a_method_the_producer_does_not_offer_is_told_apart_from_a_typo(svc, method, said):
    r = httpx.post(http(svc) + "/v1/completions", headers=H, timeout=60,
                   json={"model": "chat", "prompt": "hi there", "max_tokens": 2, "method": method})
    assert r.status_code == 404 and said in r.json()["error"]["message"], r.text[:300]


def test_a_model_can_be_retrieved_by_name_and_an_unknown_route_says_what_is_served(svc):
    """``client.models.retrieve(NAME)`` is GET /v1/models/NAME; a wrong path or method gets an
    OpenAI-style body saying what there is, not a bare "Not Found"."""
    r = httpx.get(http(svc) + "/v1/models/chat", headers=H, timeout=30)
    assert r.status_code == 200 and r.json()["id"] == "chat" and r.json()["object"] == "model", r.text
    r = httpx.get(http(svc) + "/v1/models/nosuch", headers=H, timeout=30)
    assert r.status_code == 404 and "unknown model 'nosuch'; this producer serves [" in r.json()["error"]["message"]
    r = httpx.post(http(svc) + "/v1/embeddings", headers=H, json={"input": "x"}, timeout=30)
    msg = r.json()["error"]["message"]
    assert r.status_code == 404 and "'/v1/embeddings' is not served here" in msg and "/v1/chat/completions" in msg
    r = httpx.get(http(svc) + "/v1/completions", headers=H, timeout=30)
    assert r.status_code == 405 and "GET is not allowed on '/v1/completions'; use POST" in r.json()["error"]["message"]
    # a trailing '/' was FastAPI's 307 to the path without it, which a POST client does not follow (no body)
    for path in ("/v1/completions/", "/v1/models/chat/", "/health/"):
        r = httpx.request("POST" if "compl" in path else "GET", http(svc) + path, headers=H, json={}, timeout=30)
        assert r.status_code == 404 and f"send it to '{path[:-1]}', without the trailing '/'" in \
            r.json()["error"]["message"], r.text


def test_the_consumers_http_side_answers_unknown_routes_the_same_way(svc):
    port = svc.consumer_servers["lease"].http.port
    r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=H, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 404 and "is not served here; this server serves GET /health, GET /metrics" in err["message"]
    assert err["code"] == "NOT_FOUND"
    # the OpenAI API sent to the consumer (the two services' ports mixed up) is told where it is served
    assert "this is an SCD consumer's HTTP port: send OpenAI API requests to the producer's http.port" in err["message"]
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers=H, json={"model": "lease"}, timeout=30)
    assert r.status_code == 404 and "to the producer's http.port" in r.json()["error"]["message"], r.text
    r = httpx.get(f"http://127.0.0.1:{port}/nosuch", headers=H, timeout=30)  # not an API path: no such hint
    assert r.status_code == 404 and "producer" not in r.json()["error"]["message"], r.text


def _access(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "scd.access"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_clients_request_id_is_sent_back_and_logged_by_both_services(svc, caplog, stream):
    """X-Request-Id: echoed, the response's id, and the id of the producer's and the consumer's request
    log lines (one line each, with the outcome and the tokens)."""
    caplog.set_level("INFO", logger="scd.access")
    r = httpx.post(http(svc) + "/v1/completions", headers={**H, "X-Request-Id": "trace-42/a"}, timeout=60,
                   json={"model": "chat", "prompt": "hi there", "max_tokens": 2, "stream": stream})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42/a", r.text[:300]
    assert '"id": "cmpl-trace-42/a"' in r.text if stream else r.json()["id"] == "cmpl-trace-42/a"
    lines = [x for x in _access(caplog) if x.startswith("request=trace-42/a ")]
    assert len(lines) == 2, _access(caplog)  # the producer's and the consumer's
    producer = next(x for x in lines if "consumer=chat" in x)
    assert "method=raw outcome=ok" in producer and "completion_tokens=2" in producer, producer
    consumer = next(x for x in lines if "consumer=" not in x)
    assert "outcome=ok" in consumer and "completion_tokens=2" in consumer and "bytes_in=" in consumer, consumer


def test_without_a_request_id_one_is_made_and_a_bad_one_is_refused(svc, caplog):
    caplog.set_level("INFO", logger="scd.access")
    r = httpx.post(http(svc) + "/v1/completions", headers=H, timeout=60,
                   json={"model": "chat", "prompt": "hi there", "max_tokens": 2})
    rid = r.headers["x-request-id"]
    assert r.status_code == 200 and len(rid) == 32 and r.json()["id"] == "cmpl-" + rid
    assert any(x.startswith(f"request={rid} ") for x in _access(caplog)), _access(caplog)
    for bad in ("x" * 129, "tab\there", "é"):
        r = httpx.post(http(svc) + "/v1/completions", headers={**H, "X-Request-Id": bad.encode("latin-1")},
                       timeout=60, json={"model": "chat", "prompt": "hi there", "max_tokens": 2})
        assert r.status_code == 400 and "X-Request-Id must be 1-128 printable ASCII characters" in \
            r.json()["error"]["message"], r.text[:300]
    r = httpx.post(http(svc) + "/v1/completions", headers={**H, "X-Request-Id": "é".encode()}, timeout=60,
                   json={"model": "chat", "prompt": "hi there", "max_tokens": 2})
    assert r.status_code == 400 and "got 'é'" in r.json()["error"]["message"], r.text[:300]  # was 'Ã©'


def test_a_failed_request_is_logged_with_its_outcome(svc, caplog):
    caplog.set_level("INFO", logger="scd.access")
    r = httpx.post(http(svc) + "/v1/completions", headers={**H, "X-Request-Id": "no-such"}, timeout=60,
                   json={"model": "chat", "prompt": "hi there", "max_tokens": 2, "method": "droidspeek"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "no-such"
    assert any(x.startswith("request=no-such consumer=chat method=unknown outcome=not_found")
               for x in _access(caplog)), _access(caplog)


def test_a_method_with_settings_is_taken_as_the_cli_writes_it(svc, base, tok):
    """`scd generate --method raw:dtype=float32`, `scd bench --methods ...` and the README write a method
    with its settings as KIND:KEY=VALUE; sent as a request's method it was "unknown transfer method"."""
    import grpc
    from ops_common import gen

    from producer_service.engine import ProducerEngine
    from producer_service.settings import ProducerSettings
    from tools.inprocess import InProcessServices

    fp16 = gen(svc, consumer="same", method="raw", max_new_tokens=2).timings.wire_bytes
    fp32 = gen(svc, consumer="same", method="raw", method_params={"dtype": "float32"}, max_new_tokens=2)
    assert fp32.timings.wire_bytes > fp16
    as_label = gen(svc, consumer="same", method="raw:dtype=float32", max_new_tokens=2)
    assert as_label.timings.wire_bytes == fp32.timings.wire_bytes and as_label.token_ids == fp32.token_ids
    r = httpx.post(http(svc) + "/v1/completions", headers=H, timeout=60, json={
        "model": "same", "prompt": "hi there", "max_tokens": 2, "method": "raw:dtype=float32"})
    assert r.status_code == 200 and r.json()["scd_timings"]["method"] == "raw", r.text[:300]
    def refused_raw() -> float:  # a method with settings is counted under its kind (was "unknown")
        text = httpx.get(http(svc) + "/metrics", headers=H, timeout=10).text
        line = 'scd_producer_requests_total{fallback="none",method="raw",outcome="invalid_argument"} '
        return sum(float(x[len(line):]) for x in text.splitlines() if x.startswith(line))

    before = refused_raw()
    for kw, said in [(dict(method="raw:dtype=float32", method_params={"dtype": "float16"}), "give each setting once"),
                     (dict(method="raw:dtype"), "settings are KEY=VALUE"),
                     (dict(method="raw:dtype=float8"), "dtype: Input should be")]:
        with pytest.raises(grpc.RpcError) as ei:
            gen(svc, consumer="same", max_new_tokens=2, **kw)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and said in ei.value.details(), ei.value.details()
    assert refused_raw() == before + 3

    def make_producer(addresses):  # the operator's default may carry settings too; a request's own win
        s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, default_method="raw:dtype=float32",
                                  consumers={"same": {"address": svc.consumer_addresses["same"]}},
                                  security={"token": TOKEN}, health_probe_s=0)
        return ProducerEngine(s, base, tok)

    with InProcessServices([], make_producer) as s:
        from tools import client

        def sent(**kw) -> int:
            req = client.request(PROMPT, consumer="same", max_new_tokens=2, **kw)
            return client.generate(s.producer_address, req, timeout=60, token=TOKEN).timings.wire_bytes
        assert sent() == fp32.timings.wire_bytes and sent(method_params={"dtype": "float16"}) == fp16


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "   ", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "model": "nope"}, "model"),
    ("/v1/completions", {"prompt": "hi", "model": "chat,nope"}, "model"),
    ("/v1/completions", {"prompt": "hi", "model": "chat,,"}, "model"),
    ("/v1/completions", {"prompt": "hi", "method": "nope"}, "method"),
    ("/v1/completions", {"prompt": "hi", "method": "raw:dtype"}, "method"),
    ("/v1/completions", {"prompt": "hi", "method": "raw:dtype=float32", "method_params": {"dtype": "float16"}},
     "method_params"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, "tools"),
    # found by the engines (the producer's, or the consumer's, relayed): named in the body's words
    ("/v1/completions", {"prompt": "hi", "temperature": 11}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": [str(i) for i in range(17)]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, "prompt"),
    ("/v1/completions", {"model": "short", "prompt": list(range(3, 40))}, "prompt"),
    ("/v1/chat/completions", {"model": "short", "messages": [{"role": "user", "content": "hi " * 20}]}, "messages"),
    ("/v1/completions", {"prompt": "hi", "method": "raw:dtype=float8"}, "method"),
    ("/v1/completions", {"prompt": "hi", "method": "raw:dtype=float32;dtype=float16"}, "method"),
    ("/v1/completions", {"prompt": "hi", "method": "raw", "method_params": {"dtype": "float8"}},
     "method_params.dtype"),
    ("/v1/completions", {"prompt": "hi", "method_params": {"bogus": "1"}}, "method_params.bogus"),
    ("/v1/completions", {"prompt": "hi", "method_params": {"bo.gus": "1"}}, "method_params.bo.gus"),
    # settings the model cannot take, found when the method is made (param was null)
    ("/v1/completions", {"prompt": "hi", "method": "quant", "method_params": {"group_size": "7"}},
     "method_params.group_size"),
    ("/v1/completions", {"prompt": "hi", "method": "quant:group_size=7"}, "method"),
])
def test_an_error_names_the_field_at_fault_as_openai_does(svc, path, body, param):
    """OpenAI's error object has ``param`` (the openai client's ``e.param``); it was null for what the
    producer's or the consumer's engine found wrong (a sampling value, a prompt over a limit, a
    method's setting)."""
    import openai

    oc = openai.OpenAI(base_url=http(svc) + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
    body = {"model": "chat", **body}
    with pytest.raises(openai.APIStatusError) as ei:
        oc.post(path.removeprefix("/v1"), body=body, cast_to=object)
    assert ei.value.status_code in (400, 404) and ei.value.body["param"] == param, ei.value.body
    if param.startswith("max_") and body[param] > 1:  # a consumer's limit, in the body's words (was max_new_tokens=)
        assert f"{param}=" in ei.value.body["message"] and "max_new_tokens" not in ei.value.body["message"]


def test_a_request_for_an_unknown_model_is_counted_and_logged(svc, caplog):
    """A client sending to a consumer the producer does not know shows in the requests metric (and the
    request log) as not_found, over HTTP as over gRPC."""
    import logging

    def not_found() -> float:
        line = 'scd_producer_requests_total{fallback="none",method="raw",outcome="not_found"} '
        text = httpx.get(http(svc) + "/metrics", headers=H, timeout=10).text
        return sum(float(x[len(line):]) for x in text.splitlines() if x.startswith(line))

    before = not_found()
    with caplog.at_level(logging.INFO, logger="scd.access"):
        r = httpx.post(http(svc) + "/v1/completions", headers=H, timeout=60,
                       json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    assert not_found() == before + 1
    assert "consumer=nope" in caplog.text and "outcome=not_found" in caplog.text, caplog.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_include_usage_ends_the_stream_with_a_usage_chunk(svc, path):
    """OpenAI's ``stream_options.include_usage``: the other chunks' ``usage`` is null, and a last chunk
    with no choices carries it (clients read the usage there: it was on the last token's chunk, and
    the option was ignored)."""
    import openai

    oc = openai.OpenAI(base_url=http(svc) + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
    kw = dict(model="chat", max_tokens=3, stream=True, stream_options={"include_usage": True})
    if "chat" in path:
        chunks = list(oc.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        chunks = list(oc.completions.create(prompt="hi there", **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    *rest, last = chunks
    assert last.choices == [] and last.usage is not None and all(c.usage is None for c in rest), chunks
    assert last.usage.completion_tokens == 3 and last.usage.total_tokens == last.usage.prompt_tokens + 3
    assert text and rest[-1].choices[0].finish_reason == "length"
    plain = httpx.post(http(svc) + "/v1/completions", headers=H, timeout=60,  # without it: as before
                       json={"model": "chat", "prompt": "hi there", "max_tokens": 3, "stream": True}).text
    assert '"choices": []' not in plain and '"completion_tokens": 3' in plain, plain[-600:]


@pytest.mark.parametrize("model", ["chat", "chat,same"])
def test_every_streamed_chat_choice_has_the_same_keys(svc, model):
    """The role chunk's choice had no ``logprobs`` key; every other chunk's has it (null)."""
    import json

    r = httpx.post(http(svc) + "/v1/chat/completions", headers=H, timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
    choices = [c for x in r.text.splitlines() if x.startswith("data: {") for c in json.loads(x[6:])["choices"]]
    assert len(choices) >= 3 and all({"index", "delta", "finish_reason", "logprobs"} <= set(c) for c in choices), \
        choices  # (a fan-out's choices also name their model)


def test_stream_options_include_usage_sums_a_fan_out(svc):
    r = httpx.post(http(svc) + "/v1/completions", headers=H, timeout=60, json={
        "model": "chat,same", "prompt": PROMPT, "max_tokens": 2, "stream": True, "native_prefix": False,
        "stream_options": {"include_usage": True}})
    import json

    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    *rest, last = chunks
    assert last["choices"] == [] and all(c["usage"] is None for c in rest), chunks
    done = [c["choices"][0]["scd_timings"] for c in rest if c["choices"][0].get("scd_timings")]
    assert len(done) == 2 and last["usage"]["completion_tokens"] == 4
    assert last["usage"]["prompt_tokens"] == sum(t["prompt_tokens"] for t in done)
    # without include_usage the summed usage is on the last chunk, as one consumer's stream has it (it had none)
    r = httpx.post(http(svc) + "/v1/completions", headers=H, timeout=60, json={
        "model": "chat,same", "prompt": PROMPT, "max_tokens": 2, "stream": True, "native_prefix": False})
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    *rest, last = chunks
    assert all("usage" not in c for c in rest) and last["choices"][0]["finish_reason"], chunks
    assert last["usage"] == {"prompt_tokens": sum(t["prompt_tokens"] for t in done), "completion_tokens": 4,
                             "total_tokens": sum(t["prompt_tokens"] for t in done) + 4}, last


def test_stream_options_without_stream_is_refused(svc):
    r = httpx.post(http(svc) + "/v1/completions", headers=H, timeout=60, json={
        "model": "chat", "prompt": "hi there", "max_tokens": 2, "stream_options": {"include_usage": True}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "stream_options", err
    assert "stream_options is only allowed with stream: true" in err["message"], err


@pytest.mark.parametrize("send, status, said", [
    (dict(json={"model": "chat", "prompt": "hi", "max_tokens": "2"}), 400, "max_tokens: Input should be"),
    (dict(json={"model": "chat", "prompt": "   "}), 400, "prompt is empty"),
    (dict(json={"model": "chat,nope", "prompt": "hi"}), 404, "unknown consumer 'nope'"),
    (dict(content=b"x" * (2 << 20)), 413, "max_http_body_bytes"),
    (dict(json={"model": "chat", "prompt": "hi"}, headers={"Authorization": "Bearer wrong"}), 401, "wrong bearer"),
])
def test_a_request_refused_before_the_engine_is_counted_and_logged(svc, caplog, send, status, said):
    """Refusals of the HTTP front itself (a body that does not validate, an empty prompt, a fan-out to
    an unknown consumer, a body too large, a wrong token) were in no metric and no request log line:
    an operator saw nothing of a client sending them."""
    import logging

    def answered(code: int) -> float:
        line = f'scd_producer_http_responses_total{{path="/v1/completions",status="{code}"}} '
        text = httpx.get(http(svc) + "/metrics", headers=H, timeout=10).text
        return sum(float(x[len(line):]) for x in text.splitlines() if x.startswith(line))

    before = answered(status)
    with caplog.at_level(logging.INFO, logger="scd.access"):
        headers = {**H, "X-Request-Id": "front-1", **send.get("headers", {})}
        r = httpx.post(http(svc) + "/v1/completions", timeout=60, headers=headers,
                       **{k: v for k, v in send.items() if k != "headers"})
    assert r.status_code == status and said in r.json()["error"]["message"], r.text[:300]
    assert answered(status) == before + 1
    lines = [x for x in _access(caplog) if x.startswith("request=front-1 ")]
    assert len(lines) == 1 and 'http="POST /v1/completions"' in lines[0] and f"status={status}" in lines[0], \
        (lines, caplog.text)  # logged before the client had its answer
    assert said.split("'")[0] in lines[0], lines


def test_a_request_the_engine_refused_is_logged_once_and_other_paths_are_counted_as_other(svc, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="scd.access"):
        r = httpx.post(http(svc) + "/v1/completions", headers={**H, "X-Request-Id": "engine-1"}, timeout=60,
                       json={"model": "chat", "prompt": "hi", "method": "droidspeek"})
    assert r.status_code == 404
    lines = [x for x in _access(caplog) if x.startswith("request=engine-1 ")]
    assert len(lines) == 1 and "outcome=not_found" in lines[0], lines  # the engine's line, not a second one
    httpx.get(http(svc) + "/v1/nothing-here", headers=H, timeout=10)
    text = httpx.get(http(svc) + "/metrics", headers=H, timeout=10).text
    assert 'scd_producer_http_responses_total{path="other",status="404"}' in text
    assert "nothing-here" not in text  # the path label stays a bounded set


@pytest.mark.parametrize("send, status", [
    (dict(json={"model": "chat", "prompt": "hi", "max_tokens": "2"}), 400),
    (dict(json={"model": "chat,nope", "prompt": "hi"}), 404),
    (dict(content=b"x" * (2 << 20)), 413),
    (dict(json={"model": "chat", "prompt": "hi"}, headers={"Authorization": "Bearer wrong"}), 401),
    (dict(json={"model": "chat", "prompt": "hi", "max_tokens": 2}), 200),
])
def test_every_answer_carries_a_request_id_and_a_refusals_log_line_shows_it(svc, caplog, send, status):
    """The docs say every HTTP answer carries X-Request-Id; the front's own refusals (a body that does
    not validate, a fan-out to an unknown consumer, a body too large, a wrong token) had none."""
    import logging

    for given in ("trace-7", None):
        headers = {**H, **({"X-Request-Id": given} if given else {}), **send.get("headers", {})}
        with caplog.at_level(logging.INFO, logger="scd.access"):
            r = httpx.post(http(svc) + "/v1/completions", timeout=60, headers=headers,
                           **{k: v for k, v in send.items() if k != "headers"})
        rid = r.headers.get("x-request-id")
        assert r.status_code == status and rid == (given or rid) and rid and len(rid) <= 128, (r.status_code, rid)
        assert any(x.startswith(f"request={rid} ") for x in _access(caplog)), (rid, _access(caplog))
