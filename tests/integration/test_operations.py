"""Production readiness with tiny models: the OpenAI-compatible HTTP front (driven by the official
``openai`` client), bearer tokens, compatibility policies, TLS and size bounds (faults, load and
fuzzing are in ``test_faults.py``). Every wait is a bounded poll; nothing asserts a timing."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx2 as httpx
import pytest
from ops_common import MD, PROMPT, TOKEN, cons, gen, http, idle, local_greedy, make_frames
from ops_support import self_signed

from consumer_service.engine import ConsumerEngine
from consumer_service.settings import ConsumerSettings
from producer_service.engine import ProducerEngine
from producer_service.settings import ProducerSettings
from shared.rpc import scd_pb2 as pb
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.wire import PROTOCOL_VERSION
from tools import client
from tools.inprocess import InProcessServices


# ---------------------------------------------------------------------------- HTTP front
def test_openai_client_streams_through_the_http_front(svc, tok):
    import openai

    oc = openai.OpenAI(base_url=http(svc) + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
    assert sorted(m.id for m in oc.models.list()) == sorted(svc.consumer_addresses)

    want = gen(svc, prompt=tok("Once upon a time", add_special_tokens=False)["input_ids"], consumer="chat",
                max_new_tokens=8, native_prefix=False)
    chunks = list(oc.completions.create(model="chat", prompt="Once upon a time", max_tokens=8, stream=True))
    assert len(chunks) >= 2 and all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason

    full = oc.completions.create(model="chat", prompt="Once upon a time", max_tokens=8)
    assert full.choices[0].text == want.text and full.usage.completion_tokens == len(want.token_ids)  # a stop token
    # counts, as vLLM counts it

    msgs = [{"role": "user", "content": "Say something."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    want_chat = gen(svc, prompt=tok(text, add_special_tokens=False)["input_ids"], consumer="chat", max_new_tokens=6)
    chat = list(oc.chat.completions.create(model="chat", messages=msgs, max_tokens=6, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat) == want_chat.text

    with pytest.raises(openai.NotFoundError, match="unknown consumer"):
        oc.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens=100000; this consumer allows at most"):
        oc.completions.create(model="chat", prompt="hello", max_tokens=100000)


def test_native_prefix_is_on_unless_a_grpc_request_turns_it_off(svc):
    """A gRPC request that left the field out got the prefix off (proto3's false), while HTTP, the CLI
    and the docs say on: the producer sent the prefix's K/V too."""
    from shared.rpc import scd_pb2 as pb

    def wire(**kw):
        req = pb.GenerateRequest(text="Describe the sea.", consumer="chat", method="raw",
                                 sampling=pb.SamplingParams(max_new_tokens=1), **kw)
        return client.generate(svc.producer_address, req, timeout=60, token=TOKEN).timings.wire_bytes

    unset, on, off = wire(), wire(native_prefix=True), wire(native_prefix=False)
    assert unset == on < off, (unset, on, off)


def test_health_and_metrics_on_both_services(svc):
    gen(svc, consumer="lease", method="raw", max_new_tokens=3)
    h = {"authorization": f"Bearer {TOKEN}"}
    assert httpx.get(http(svc) + "/health").json()["status"] == "ok"
    text = httpx.get(http(svc) + "/metrics", headers=h).text
    for name in ("scd_producer_requests_total", "scd_producer_ttft_seconds", "scd_producer_wire_bytes_total",
                 "scd_producer_encode_seconds", "scd_producer_frames_total", "scd_producer_inflight_requests"):
        assert name in text, name
    pm = svc._servicer.metrics
    assert pm.value("requests_total", method="raw", outcome="ok", fallback="none") >= 1
    assert pm.value("wire_bytes_total", method="raw") > 0
    consumer_http = f"http://127.0.0.1:{svc.consumer_servers['lease'].http.port}"
    assert httpx.get(consumer_http + "/health").status_code == 200
    ctext = httpx.get(consumer_http + "/metrics", headers=h).text
    for name in ("scd_consumer_reconstruct_seconds", "scd_consumer_cache_bytes_held", "scd_consumer_queue_length",
                 "scd_consumer_frames_total", "scd_consumer_wire_bytes_total", "scd_consumer_ttft_seconds"):
        assert name in ctext, name
    cm = cons(svc, "lease").metrics
    assert cm.value("requests_total", method="raw", outcome="ok", fallback="none") >= 1
    assert cm.value("frames_total", method="raw") >= 3


# ---------------------------------------------------------------------------- auth
def test_wrong_or_missing_token_is_refused_on_grpc_and_http(svc):
    req = client.request(PROMPT, consumer="same", method="raw", max_new_tokens=2)
    for token in (None, "wrong"):
        with pytest.raises(grpc.RpcError) as ei:
            client.generate(svc.producer_address, req, timeout=30, token=token)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in ei.value.details()
    with grpc.insecure_channel(svc.consumer_addresses["same"]) as ch:  # the consumer checks it too
        with pytest.raises(grpc.RpcError) as ei:
            list(pbg.ConsumerStub(ch).Transfer(iter(make_frames(svc, "same")), timeout=30))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as ei:
            pbg.ConsumerStub(ch).Info(pb.InfoRequest(), timeout=10, metadata=(("authorization", "Bearer x"),))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert pbg.ConsumerStub(ch).Info(pb.InfoRequest(), timeout=10, metadata=MD).name == "same"
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # health stays open for probes

        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1

    import openai

    bad = openai.OpenAI(base_url=http(svc) + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="chat", prompt="hi", max_tokens=2)
    for path, method in (("/v1/models", "GET"), ("/metrics", "GET"), ("/v1/completions", "POST"),
                         ("/v1/chat/completions", "POST")):
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = httpx.request(method, http(svc) + path, headers=headers, json={"model": "chat", "prompt": "x"})
            assert r.status_code == 401, (path, headers, r.status_code)
            assert "bearer token" in r.json()["error"]["message"]
    for value, says in (("Basic d3Jvbmc=", "not a bearer token (scheme 'Basic')"),  # it said 'wrong bearer token'
                        (TOKEN, "not a bearer token (a value with no scheme)")):
        r = httpx.get(http(svc) + "/v1/models", headers={"authorization": value})
        assert r.status_code == 401 and says in r.json()["error"]["message"], r.text
        assert "'Authorization: Bearer <token>'" in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as ei:
        client.generate(svc.producer_address, req, timeout=30, metadata=(("authorization", TOKEN),))
    assert "not a bearer token" in ei.value.details() and "metadata 'authorization: Bearer" in ei.value.details()
    assert httpx.get(http(svc) + "/health").status_code == 200
    assert svc._servicer.metrics.value("auth_failures_total", transport="grpc") >= 2
    assert svc._servicer.metrics.value("auth_failures_total", transport="http") >= 8
    assert gen(svc, consumer="same", method="raw", max_new_tokens=2).finish_reason  # still serving


# ---------------------------------------------------------------------------- compatibility
def test_fingerprint_mismatch_fail_policy_says_what_to_update(svc):
    with pytest.raises(grpc.RpcError) as ei:
        gen(svc, consumer="picky", method="raw", max_new_tokens=2)
    assert ei.value.code() == grpc.StatusCode.INTERNAL  # the producer's weights: not the client's to fix
    assert "producer weights" in ei.value.details() and "recalibrate" in ei.value.details()
    assert "consumers.picky.address" in ei.value.details(), ei.value.details()
    assert idle(svc, "picky")


def test_fingerprint_mismatch_recompute_policy_prefills_on_the_consumer(svc):
    cs = cons(svc, "picky-recompute")
    before = cs.metrics.value("fallback_recompute_total", reason="fingerprint")
    res = gen(svc, consumer="picky-recompute", method="raw", max_new_tokens=6)
    assert res.timings.fallback_recompute
    own = svc._consumers[3].adapter.model  # the consumer's own prefill, not the producer's cache
    assert res.token_ids == local_greedy(own, PROMPT, 6)
    assert cs.metrics.value("fallback_recompute_total", reason="fingerprint") == before + 1
    assert cs.metrics.value("requests_total", method="raw", outcome="ok", fallback="fingerprint") >= 1
    assert svc._servicer.metrics.value("requests_total", method="raw", outcome="ok", fallback="recompute") >= 1
    ok = gen(svc, consumer="same", method="raw", max_new_tokens=3)
    assert not ok.timings.fallback_recompute


@pytest.mark.parametrize("field,value,side", [("protocol_version", PROTOCOL_VERSION + 1, "update the consumer"),
                                              ("protocol_version", 0, "update the producer"),
                                              ("method_version", 0, "update the producer"),
                                              ("method_version", 9, "update the consumer")])
def test_version_mismatch_is_failed_precondition_naming_the_side(svc, field, value, side):
    with grpc.insecure_channel(svc.consumer_addresses["same"]) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            frames = iter(make_frames(svc, "same", **{field: value}))
            list(pbg.ConsumerStub(ch).Transfer(frames, timeout=30, metadata=MD))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and side in ei.value.details()


# ---------------------------------------------------------------------------- TLS
def test_tls_and_mutual_tls_between_client_producer_and_consumer(base, tmp_path):
    pem = self_signed(tmp_path)
    if pem is None:
        pytest.skip("openssl CLI not available to make a test certificate")
    cert = Path(pem["cert"]).read_bytes()
    mtls = {"token": TOKEN, "tls_cert": pem["cert"], "tls_key": pem["key"], "tls_client_ca": pem["cert"]}
    cons = ConsumerEngine(ConsumerSettings.load(model={"path": "unused"}, server={"port": 0}, name="tls",
                                                methods=["raw"], security=mtls), base)

    def make_producer(addresses):
        sec = {"token": TOKEN, "tls_cert": pem["cert"], "tls_key": pem["key"], "peer_ca": pem["cert"]}
        s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, default_method="raw",
                                  consumers={n: {"address": a} for n, a in addresses.items()}, http={"port": 0},
                                  security=sec)
        return ProducerEngine(s, base)

    with InProcessServices([cons], make_producer) as s:
        req = client.request(PROMPT, consumer="tls", method="raw", max_new_tokens=3)
        res = client.generate(s.producer_address, req, timeout=60, token=TOKEN, root_certificates=cert)
        assert len(res.token_ids) == 3  # client -TLS-> producer -mutual TLS-> consumer
        with pytest.raises(grpc.RpcError) as ei:  # plaintext to a TLS server
            client.generate(s.producer_address, req, timeout=10, token=TOKEN)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.secure_channel(s.consumer_addresses["tls"], grpc.ssl_channel_credentials(cert)) as ch:
            with pytest.raises(grpc.RpcError):  # no client certificate: the consumer refuses the handshake
                pbg.ConsumerStub(ch).Info(pb.InfoRequest(), timeout=10, metadata=MD)
        s._run(s._servicer.probe_once())  # the producer's probe reaches its consumer over mutual TLS too
        r = httpx.get(f"https://127.0.0.1:{s.producer_server.http.port}/health", verify=pem["cert"], timeout=10)
        assert r.status_code == 200 and r.json()["consumers"] == {"tls": "serving"}, r.text


def test_security_settings_are_validated():
    from shared.errors import ConfigError

    with pytest.raises(ConfigError, match="token or token_file"):
        ConsumerSettings.load(model={"path": "x"}, security={"token": "a", "token_file": "/x"})
    with pytest.raises(ConfigError, match="tls_cert and tls_key"):
        ProducerSettings.load(model={"path": "x"}, security={"tls_cert": "/x"})
    s = ConsumerSettings.load(model={"path": "x"}, security={"token_file": "/nonexistent/token"})
    with pytest.raises(ConfigError, match="token_file"):
        s.security.check()
    for token in ("pässwort", "two words", "tab\there"):  # no client could send it
        s = ConsumerSettings.load(model={"path": "x"}, security={"token": token})
        with pytest.raises(ConfigError, match="printable ASCII without spaces"):
            s.security.check()
    assert ConsumerSettings.load(model={"path": "x"}, security={"token": " a+b/c=~!\n"}).security.bearer() == "a+b/c=~!"


def test_tls_files_are_checked_for_what_they_hold(tmp_path):
    """gRPC took any bytes as a certificate and then failed to bind, which the service reported as
    "cannot listen ...; is another server using it?" after loading its model. Each file is read as
    what its setting takes, and the mistake named, before the model loads."""
    import subprocess

    from shared.errors import ConfigError
    from shared.rpc.security import SecuritySettings

    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    one, two = self_signed(tmp_path / "one"), self_signed(tmp_path / "two")
    if one is None or two is None:
        pytest.skip("openssl CLI not available to make a test certificate")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    locked = tmp_path / "locked.pem"
    subprocess.run(["openssl", "pkey", "-in", one["key"], "-aes256", "-passout", "pass:x", "-out", str(locked)],
                   check=True, capture_output=True, timeout=60)
    SecuritySettings(tls_cert=one["cert"], tls_key=one["key"], tls_client_ca=two["cert"], peer_ca=one["cert"]).check()
    for kw, said in [
        (dict(tls_cert=str(junk), tls_key=one["key"]), "security.tls_cert: " + str(junk) + " holds no PEM certificate"),
        (dict(tls_cert=one["key"], tls_key=one["cert"]), "holds no PEM certificate"),  # the two swapped
        (dict(tls_cert=one["cert"], tls_key=one["cert"]), "security.tls_key: " + one["cert"] + " holds no PEM private"),
        (dict(tls_cert=one["cert"], tls_key=two["key"]), "security.tls_cert and tls_key: the key is not the "),
        (dict(tls_cert=one["cert"], tls_key=str(locked)), "is encrypted; set the key unencrypted"),
        (dict(tls_cert=one["cert"], tls_key=one["key"], tls_client_ca=str(junk)), "security.tls_client_ca: "),
        (dict(peer_ca=one["key"]), "security.peer_ca: " + one["key"] + " holds no PEM certificate"),
        (dict(peer_ca=str(tmp_path)), "cannot read security.peer_ca"),
    ]:
        with pytest.raises(ConfigError) as e:
            SecuritySettings(**kw).check()
        assert said in str(e.value), (kw, str(e.value))


def test_http_body_and_prompt_sizes_are_bounded(svc):
    h = {"authorization": f"Bearer {TOKEN}"}
    big = httpx.post(http(svc) + "/v1/completions", headers=h, timeout=30,
                     json={"model": "chat", "prompt": "x" * (1 << 20), "max_tokens": 2})
    assert big.status_code == 413 and "body over" in big.json()["error"]["message"]
    long = httpx.post(http(svc) + "/v1/completions", headers=h, timeout=30,
                      json={"model": "chat", "prompt": [5] * 9000, "max_tokens": 2})
    assert long.status_code == 400 and "limit" in long.json()["error"]["message"]
    bad = httpx.post(http(svc) + "/v1/chat/completions", headers=h, timeout=30, json={"model": "chat", "messages": []})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]


@pytest.mark.parametrize("coding", ["gzip", "br", "deflate, gzip"])
def test_a_compressed_body_is_refused_as_such(svc, coding):
    """A gzip body was read as broken JSON ("the body is not text (utf-8: invalid start byte...)")."""
    import gzip
    import json

    raw = json.dumps({"model": "chat", "prompt": "hi", "max_tokens": 2}).encode()
    r = httpx.post(http(svc) + "/v1/completions", timeout=30, content=gzip.compress(raw),
                   headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json",
                            "content-encoding": coding})
    assert r.status_code == 415 and "send the body uncompressed" in r.json()["error"]["message"], r.text
    ok = httpx.post(http(svc) + "/v1/completions", timeout=30, content=raw,
                    headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json",
                             "content-encoding": "identity"})
    assert ok.status_code == 200, ok.text
