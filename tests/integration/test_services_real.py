"""The real SmolLM2 pair through both services: a text prompt streams a real answer."""

import pytest

from tools import client, data


@pytest.fixture(scope="module")
def services(real_assets, tokenizer):
    from consumer_service.engine import ConsumerEngine
    from consumer_service.settings import ConsumerSettings
    from producer_service.engine import ProducerEngine
    from producer_service.settings import ProducerSettings
    from tools.assets.models import consumer_dir, load_model, producer_dir
    from tools.inprocess import InProcessServices

    base = load_model(producer_dir())
    from shared.paths import STORE_DIR

    cons = ConsumerEngine(ConsumerSettings.load(model={"path": "-"}, name="strong", server={"port": 0},
                                                artifact_store=str(STORE_DIR)),
                          load_model(consumer_dir("strong")), tokenizer)
    same = ConsumerEngine(ConsumerSettings.load(model={"path": "-"}, name="base", server={"port": 0},
                                                methods=["oracle", "raw"]), base, tokenizer)

    def make_producer(addrs):
        s = ProducerSettings.load(model={"path": "-"}, server={"port": 0}, default_method="raw", consumers={
            n: {"address": a, **({"artifacts": str(STORE_DIR / n)} if n == "strong" else {})}
            for n, a in addrs.items()})
        return ProducerEngine(s, base, tokenizer)

    with InProcessServices([cons, same], make_producer) as svc:
        yield svc


def test_text_prompt_streams_an_answer(services):
    res = client.generate(services.producer_address,
                          client.request("What is the capital of France?", "base", "raw", max_new_tokens=12))
    assert "Paris" in res.text
    assert res.timings.ttft_ms > 0 and res.timings.wire_bytes > 0


def test_native_prefix_cuts_the_payload_and_oracle_matches_local(services, tokenizer):
    from shared.model.hf_adapter import ModelAdapter
    from tools.assets.models import consumer_dir, load_model

    item = data.load("qa", "test", 1)[0]
    on = client.generate(services.producer_address, client.request(item.prompt_ids, "strong", "raw", max_new_tokens=4))
    off = client.generate(services.producer_address,
                          client.request(item.prompt_ids, "strong", "raw", max_new_tokens=4, native_prefix=False))
    assert on.timings.payload_bytes < off.timings.payload_bytes
    ora = client.generate(services.producer_address,
                          client.request(item.prompt_ids, "strong", "oracle", max_new_tokens=6))
    local = ModelAdapter(load_model(consumer_dir("strong")))
    ref = local.greedy(local.own_cache(item.prompt_ids[:-1]), item.prompt_ids[-1], 6)
    stop = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    n = next((i + 1 for i, t in enumerate(ref) if t in stop), len(ref))
    assert ora.token_ids == ref[:n]


def test_committed_scd_artifacts_serve_the_prepared_pair(services):
    """The committed artifacts match the models `scd assets` builds (fingerprints), and scd streams
    with under a third of raw's payload."""
    item = data.load("qa", "test", 2)[1]
    scd = client.generate(services.producer_address, client.request(item.prompt_ids, "strong", "scd", max_new_tokens=4))
    raw = client.generate(services.producer_address, client.request(item.prompt_ids, "strong", "raw", max_new_tokens=4))
    assert scd.timings.method == "scd" and scd.token_ids
    assert scd.timings.payload_bytes * 3 < raw.timings.payload_bytes


def test_scd_needs_artifacts_for_that_consumer(services):
    import grpc

    with pytest.raises(grpc.RpcError) as ei:
        client.generate(services.producer_address, client.request([1, 2, 3], "base", "scd"))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "scd calibrate" in ei.value.details()
