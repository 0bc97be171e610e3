"""Every registered method, on a tiny calibrated pair of every supported family, through the real
gRPC services: the consumer's tokens equal those of the same method run in process (encode, the
wire's frames, decode), the Oracle's equal the consumer's own greedy decode, and raw in float32
between identical weights is exact. Then the same in bfloat16, from folders loaded in bf16 with
artifacts calibrated in fp32: every method casts its codes, aligners and recompute blocks right."""

import pytest
import torch
from tiny_pairs import calibrate_all, random_prompts

from consumer_service.engine import ConsumerEngine
from consumer_service.settings import ConsumerSettings
from producer_service.engine import ProducerEngine
from producer_service.settings import ProducerSettings
from shared.artifacts import store
from shared.codecs import CODECS, CodecContext
from shared.codecs.scd import PairArtifacts
from shared.model.fingerprint import weights_fingerprint
from shared.model.hf_adapter import ModelAdapter, clone_cache
from shared.model.tiny import FAMILIES, perturbed, tiny_model
from tools import client
from tools.eval.harness import Context, codec_method
from tools.inprocess import InProcessServices

METHODS = sorted(CODECS)
PROMPT = random_prompts(1, 45, 99)[0]
N_NEW = 6


def _contexts(producer: ModelAdapter, consumer: ModelAdapter, name: str, store_dir):
    pfp, cfp = weights_fingerprint(producer.model), weights_fingerprint(consumer.model)
    meta, pt = store.load(store_dir / name, "producer", pfp, cfp)
    _, ct = store.load(store_dir / name, "consumer", pfp, cfp)
    profiles = {k: store.load_profile(store_dir, name, k, pfp, cfp) for k in ("droidspeak", "spectrum", "ridge")}
    return (CodecContext(producer, PairArtifacts(meta, pt, "producer"), profiles),
            CodecContext(consumer, PairArtifacts(meta, ct, "consumer"), profiles))


def _in_process(kind, producer, consumer, pctx, cctx):
    """The method run in process exactly as the evaluation harness runs it: (greedy tokens, cache)."""
    from tools.data import Item

    item = Item(id="p", kind="user", prompt_ids=PROMPT, prefix_len=0)
    run = codec_method(kind, pctx, cctx)
    ctx = Context(item, producer.prefill(PROMPT[:-1], hidden_layers=getattr(run, "hidden_layers", ()),
                                         residual_layers=getattr(run, "residual_layers", ())),
                  consumer.prefill(PROMPT[:-1]), 0)
    cache = run(ctx, consumer).cache
    return consumer.greedy(clone_cache(cache), PROMPT[-1], N_NEW), cache


def _services(producer, consumer, name, store_dir):
    cs = ConsumerSettings.load(model={"path": "-"}, server={"port": 0}, name=name, methods=METHODS,
                               artifact_store=str(store_dir))
    engine = ConsumerEngine(cs, consumer.model)

    def make_producer(addresses):
        ps = ProducerSettings.load(model={"path": "-"}, server={"port": 0}, methods=METHODS, default_method="raw",
                                   consumers={n: {"address": a, "artifacts": str(store_dir / n)}
                                              for n, a in addresses.items()})
        return ProducerEngine(ps, producer.model)

    return InProcessServices([engine], make_producer)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_through_the_services(family, tmp_path):
    base = tiny_model(family, n_layers=4, sliding_window=16 if family in ("mistral", "gemma2") else None)
    producer, consumer = ModelAdapter(base), ModelAdapter(perturbed(base, 0.08))
    name = f"tiny-{family}"
    calibrate_all(producer, consumer, name, tmp_path)
    pctx, cctx = _contexts(producer, consumer, name, tmp_path)
    with _services(producer, consumer, name, tmp_path) as svc:
        for kind in METHODS:
            res = client.generate(svc.producer_address, client.request(PROMPT, name, kind, max_new_tokens=N_NEW),
                                  timeout=60)
            want, _ = _in_process(kind, producer, consumer, pctx, cctx)
            assert res.token_ids == want, f"{family} {kind}: services gave {res.token_ids}, in process {want}"
            assert res.timings.method == kind
        local = consumer.greedy(consumer.own_cache(PROMPT[:-1]), PROMPT[-1], N_NEW)
        assert _in_process("oracle", producer, consumer, pctx, cctx)[0] == local


@pytest.mark.parametrize("family", FAMILIES)
def test_raw_float32_between_identical_weights_is_exact(family):
    from tools.data import Item

    a = ModelAdapter(tiny_model(family, n_layers=3, sliding_window=16 if family == "gemma2" else None))
    ctx = CodecContext(a)
    item = Item(id="p", kind="user", prompt_ids=PROMPT, prefix_len=0)
    got = codec_method("raw", ctx, ctx, {"dtype": "float32"})(
        Context(item, a.prefill(PROMPT[:-1]), a.prefill(PROMPT[:-1]), 0), a).cache
    own = a.own_cache(PROMPT[:-1])
    for layer in range(a.n_layers):
        torch.testing.assert_close(got.layers[layer].values, own.layers[layer].values, atol=0, rtol=0)
        torch.testing.assert_close(got.layers[layer].keys, own.layers[layer].keys, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    """A tiny llama pair saved as folders; calibrated on the fp32 load; loaded again in bf16."""
    from shared.model.loading import load_model
    from shared.model.tiny import save_pretrained

    root = tmp_path_factory.mktemp("bf16")
    base = tiny_model("llama", n_layers=4)
    pdir = save_pretrained(base, root / "p")
    cdir = save_pretrained(perturbed(base, 0.08), root / "c")
    p32, c32 = ModelAdapter(load_model(pdir)), ModelAdapter(load_model(cdir))
    calibrate_all(p32, c32, "tiny-bf16", root / "store")
    p16 = ModelAdapter(load_model(pdir, dtype=torch.bfloat16))
    c16 = ModelAdapter(load_model(cdir, dtype=torch.bfloat16))
    return p32, c32, p16, c16, root / "store"


@pytest.mark.parametrize("kind", [m for m in METHODS if m != "oracle"])
def test_bfloat16_reconstruction_matches_float32(kind, bf16_pair):
    """The same artifacts (fp32 calibration) serve a bf16 pair: its reconstructed cache is bf16 and
    within bf16 rounding of the fp32 reconstruction."""
    p32, c32, p16, c16, store_dir = bf16_pair
    _, cache32 = _in_process(kind, p32, c32, *_contexts(p32, c32, "tiny-bf16", store_dir))
    _, cache16 = _in_process(kind, p16, c16, *_contexts(p16, c16, "tiny-bf16", store_dir))
    for layer in range(c16.n_layers):
        for a, b in ((cache16.layers[layer].keys, cache32.layers[layer].keys),
                     (cache16.layers[layer].values, cache32.layers[layer].values)):
            assert a.dtype == torch.bfloat16
            err = float((a.float() - b).norm() / b.norm())
            assert err < 0.05, f"{kind} layer {layer}: bf16 vs fp32 relative error {err:.3f}"


def test_bfloat16_every_method_through_the_services(bf16_pair):
    _, _, p16, c16, store_dir = bf16_pair
    pctx, cctx = _contexts(p16, c16, "tiny-bf16", store_dir)
    with _services(p16, c16, "tiny-bf16", store_dir) as svc:
        for kind in METHODS:
            res = client.generate(svc.producer_address, client.request(PROMPT, "tiny-bf16", kind,
                                                                       max_new_tokens=N_NEW), timeout=60)
            assert res.token_ids == _in_process(kind, p16, c16, pctx, cctx)[0], kind
