"""The token-sparse block's guard through the real services: the producer decides after its prefill,
sends the header then, with the whole block's settings for a prompt above the artifacts' guard; the
consumer makes the method from the header as usual. ``scd-reuse`` the same way, with the producer's own
K/V as ``raw`` sends them."""

from tiny_pairs import calibrate_all, random_prompts

from consumer_service.engine import ConsumerEngine
from consumer_service.settings import ConsumerSettings
from producer_service.engine import ProducerEngine
from producer_service.settings import ProducerSettings
from shared.artifacts import store
from shared.codecs import CodecContext, make_method
from shared.codecs.scd import PairArtifacts
from shared.model.fingerprint import weights_fingerprint
from shared.model.hf_adapter import ModelAdapter
from shared.model.tiny import perturbed, tiny_model
from tools import client
from tools.inprocess import InProcessServices

PROMPT = random_prompts(1, 45, 98)[0]
SPARSE = "scd:block_tokens=0.5;block_min_tokens=16"  # 22 of the prompt's 44 positions


def test_a_prompt_above_the_guard_is_served_the_whole_block(tmp_path):
    base = tiny_model("llama", n_layers=4)
    producer, consumer = ModelAdapter(base), ModelAdapter(perturbed(base, 0.08))
    calibrate_all(producer, consumer, "g", tmp_path)
    pfp, cfp = weights_fingerprint(producer.model), weights_fingerprint(consumer.model)
    meta, pt = store.load(tmp_path / "g", "producer", pfp, cfp)
    _, ct = store.load(tmp_path / "g", "consumer", pfp, cfp)
    assert meta.block_guard > 0  # calibration set one
    m = make_method("scd", CodecContext(producer, PairArtifacts(meta, pt, "producer")),
                    {"block_tokens": "0.5", "block_min_tokens": "16"})
    u = m.unlike_calibration(producer.prefill(PROMPT[:-1]), 0)
    store.save(tmp_path, meta.model_copy(update={"block_guard": u / 2}), pt, ct)  # this prompt is above it

    cs = ConsumerSettings.load(model={"path": "-"}, server={"port": 0}, name="g", methods=["scd", "scd-reuse", "raw"],
                               artifact_store=str(tmp_path))

    def make_producer(addresses):
        ps = ProducerSettings.load(model={"path": "-"}, server={"port": 0}, methods=["scd", "scd-reuse", "raw"],
                                   default_method="scd",
                                   consumers={n: {"address": a, "artifacts": str(tmp_path / n)}
                                              for n, a in addresses.items()})
        return ProducerEngine(ps, producer.model)

    with InProcessServices([ConsumerEngine(cs, consumer.model)], make_producer) as svc:
        def gen(method):
            return client.generate(svc.producer_address, client.request(PROMPT, "g", method, max_new_tokens=8),
                                   timeout=60)

        pm = svc._servicer.metrics
        whole, guarded = gen("scd"), gen(SPARSE)
        assert pm.value("resettled_requests_total", consumer="g", method="scd") == 1
        unguarded = gen(SPARSE + ";block_guard=none")
        assert pm.value("resettled_requests_total", consumer="g", method="scd") == 1
        # both of scd-reuse's guards off (the block's and the layer guard): the codes
        raw, reuse, codes = gen("raw"), gen("scd-reuse"), gen("scd-reuse:guard=none;layer_guard=none")
        assert pm.value("resettled_requests_total", consumer="g", method="scd-reuse") == 1
    assert reuse.token_ids == raw.token_ids and reuse.timings.payload_bytes == raw.timings.payload_bytes
    assert codes.timings.payload_bytes < raw.timings.payload_bytes
    assert guarded.token_ids == whole.token_ids
    assert guarded.timings.payload_bytes == whole.timings.payload_bytes  # the whole block's tensors, not the share's
    assert unguarded.timings.payload_bytes > whole.timings.payload_bytes
