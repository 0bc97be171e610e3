"""One prefill serves every method: the producer's prefill captures the union of what the methods it
offers (and ``auto``'s points) read, so a prompt asked with ``raw``, then ``scd``, then ``auto`` (or
fanned out to consumers served different methods) costs one base prefill. Each method captured only
its own layers, and a cached state that lacked one was prefilled again (10 prefills for 10 requests)."""

from __future__ import annotations

import shutil

import pytest
import torch

from consumer_service.engine import ConsumerEngine
from consumer_service.settings import ConsumerSettings
from producer_service.engine import ProducerEngine
from producer_service.settings import ProducerSettings
from shared.artifacts import store
from shared.engine import load_context
from shared.model.fingerprint import weights_fingerprint
from tools import client
from tools.data import Item
from tools.inprocess import InProcessServices

PROMPT = torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(21)).tolist()
METHODS = ["oracle", "raw", "scd-reuse", "scd", "droidspeak", "auto"]


@pytest.fixture(scope="module")
def svc(tiny_pair, tiny_artifacts, tiny_droidspeak, tmp_path_factory):
    from ops_support import tiny_tokenizer

    from shared.model.prompt import PromptFormat
    from tools.calibration.auto import operating_table

    producer, consumer = tiny_pair
    root = tmp_path_factory.mktemp("one-prefill")
    shutil.copytree(tiny_artifacts[0], root / "tiny")
    pfp, cfp = weights_fingerprint(producer.model), weights_fingerprint(consumer.model)
    store.save_profile(root, "tiny", "droidspeak", tiny_droidspeak, pfp, cfp)
    g = torch.Generator().manual_seed(5)
    val = [Item(id=f"v{i}", kind="lm", prefix_len=0, prompt_ids=torch.randint(3, 256, (40,), generator=g).tolist())
           for i in range(2)]
    pctx, cctx = (load_context(m, root / "tiny", side) for m, side in ((producer, "producer"), (consumer, "consumer")))
    table = operating_table(producer, consumer, PromptFormat(tiny_tokenizer()), val, pctx, cctx,
                            candidates=("raw", "scd-reuse", "scd", "droidspeak"), progress=False)
    store.save_profile(root, "tiny", "auto", table, pfp, cfp)
    cs = ConsumerSettings.load(model={"path": "unused"}, server={"port": 0}, name="tiny", artifact_store=str(root),
                               methods=METHODS[:-1])

    def make_producer(addresses):
        s = ProducerSettings.load(model={"path": "unused"}, server={"port": 0}, methods=METHODS, default_method="raw",
                                  prefill_cache_entries=8, consumers={"tiny": {"address": addresses["tiny"],
                                                                               "artifacts": str(root / "tiny")}})
        return ProducerEngine(s, producer.model)

    with InProcessServices([ConsumerEngine(cs, consumer.model)], make_producer) as s:
        yield s


def test_a_prompt_asked_with_every_method_is_prefilled_once(svc):
    eng = svc.producer_engine
    hidden, residual = eng.capture
    assert hidden and residual  # scd's patch layer, droidspeak's block entries
    metrics = svc._servicer.metrics
    before = {src: metrics.value("prefills_total", source=src) for src in ("run", "shared")}
    for method in ("raw", "scd", "auto", "droidspeak", "scd-reuse", "scd"):
        r = client.generate(svc.producer_address, client.request(PROMPT, "tiny", method, max_new_tokens=2,
                                                                 native_prefix=False), timeout=60)
        assert r.token_ids, method
    ran = metrics.value("prefills_total", source="run") - before["run"]
    shared = metrics.value("prefills_total", source="shared") - before["shared"]
    assert (ran, shared) == (1, 5), (ran, shared)
