"""Fan-out: one prompt to several consumers through one producer, sharing the base prefill."""

import asyncio
import json

import httpx2 as httpx
import pytest
from ops_common import PROMPT, TOKEN, gen, http

H = {"authorization": f"Bearer {TOKEN}"}


def test_concurrent_requests_of_one_prompt_share_one_prefill(svc):
    """Two requests of the same prompt in flight together run one base prefill (whatever the
    prefill cache says); another prompt runs its own."""
    eng = svc._servicer.engine
    a = eng.prepare(_req("same"))
    b = eng.prepare(_req("chat"))
    c = eng.prepare(_req("same", prompt=PROMPT[::-1]))
    calls = []
    real = eng.adapter.prefill

    def counted(ids, **kw):
        calls.append(tuple(ids))
        return real(ids, **kw)

    eng.adapter.prefill = counted
    try:
        async def both():
            return await asyncio.gather(eng.shared_prefill(a), eng.shared_prefill(b), eng.shared_prefill(c))

        (sa, fa), (sb, fb), (sc, fc) = asyncio.run(both())
    finally:
        eng.adapter.prefill = real
    assert sa is sb and (fa, fb) == (False, True)
    assert sc is not sa and fc is False
    assert sorted(calls) == sorted([tuple(PROMPT[:-1]), tuple(PROMPT[::-1][:-1])])
    assert not eng._inflight


def _req(consumer, prompt=PROMPT, method="raw"):
    from shared.domain import GenerateRequest, SamplingRequest

    return GenerateRequest(prompt=tuple(prompt), consumer=consumer, method=method, request_id="r",
                           sampling=SamplingRequest(max_new_tokens=4))


def test_http_model_list_fans_out_and_each_choice_is_that_consumers_answer(svc):
    pm = svc._servicer.metrics
    names = ("chat", "lease")  # "chat" has a tokenizer (its text is checked), "lease" none (its token count is)
    before = {c: pm.value("consumer_requests_total", consumer=c, method="raw") for c in names}
    runs = pm.value("prefills_total", source="run") + pm.value("prefills_total", source="shared")
    res = {c: gen(svc, consumer=c, method="raw", max_new_tokens=5, native_prefix=False) for c in names}
    want = {c: r.text for c, r in res.items()}
    assert want["chat"]
    body = {"model": "chat,lease", "prompt": PROMPT, "max_tokens": 5, "method": "raw", "native_prefix": False}
    r = httpx.post(http(svc) + "/v1/completions", json=body, headers=H, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [(c["index"], c["model"]) for c in out["choices"]] == [(0, "chat"), (1, "lease")]
    assert {c["model"]: c["text"] for c in out["choices"]} == want
    assert {c["model"]: c["scd_timings"]["completion_tokens"] for c in out["choices"]} == \
        {c: r.timings.completion_tokens for c, r in res.items()}
    assert all(c["scd_timings"]["method"] == "raw" and c["finish_reason"] for c in out["choices"])
    want_usage = {k: sum(c["scd_timings"][k] for c in out["choices"]) for k in ("prompt_tokens", "completion_tokens")}
    assert out["usage"] == {**want_usage, "total_tokens": sum(want_usage.values())}
    for c in names:  # the two single requests, and one each in the fan-out
        assert pm.value("consumer_requests_total", consumer=c, method="raw") == before[c] + 2
    assert pm.value("prefills_total", source="run") + pm.value("prefills_total", source="shared") == runs + 4

    # streamed: the chunks of each index make up that consumer's answer
    texts = {0: "", 1: ""}
    with httpx.stream("POST", http(svc) + "/v1/completions", json={**body, "stream": True}, headers=H,
                      timeout=60) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        for c in json.loads(ln[6:])["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {0: want["chat"], 1: want["lease"]}


def test_http_fan_out_reports_a_failing_consumer_in_its_choice(svc):
    """``short`` refuses a 40-token prompt: its choice says why, the other consumer still answers."""
    body = {"model": "same,short", "prompt": PROMPT, "max_tokens": 3, "method": "raw"}
    r = httpx.post(http(svc) + "/v1/completions", json=body, headers=H, timeout=60)
    assert r.status_code == 200, r.text
    ok, bad = r.json()["choices"]
    assert ok["model"] == "same" and "error" not in ok and ok["finish_reason"] in ("length", "stop")
    assert ok["scd_timings"]["completion_tokens"] > 0
    assert bad["model"] == "short" and bad["finish_reason"] == "error"
    assert bad["error"]["code"] == "INVALID_ARGUMENT" and "8" in bad["error"]["message"]
    assert r.json()["usage"]["completion_tokens"] == ok["scd_timings"]["completion_tokens"]  # the one that answered
    # nobody answers: the error of the request, as for one consumer
    r = httpx.post(http(svc) + "/v1/completions", json={**body, "model": "short,picky"}, headers=H, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == bad["error"]["message"]


@pytest.mark.parametrize("model,status,word", [("same,same", 400, "once"), ("same,", 400, "once"),
                                               ("same,nope", 404, "nope")])
def test_http_fan_out_refuses_bad_model_lists(svc, model, status, word):
    r = httpx.post(http(svc) + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2},
                   headers=H, timeout=30)
    assert r.status_code == status and word in r.json()["error"]["message"]
