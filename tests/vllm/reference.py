"""What the project's own services and ``scd eval`` give for one prompt, for the vLLM connector's test
to compare against (run with the project's environment: ``.venv/bin/python tests/vllm/reference.py
IN.json OUT.json``). IN: {"ids": [...], "new_tokens": N, "pair": "strong"}. OUT: the services' greedy
tokens with raw (native prefix off), the Oracle's greedy continuation (the teacher-forced target of
``scd eval``) with its log-probabilities over the vocabulary (``OUT.json.oracle.pt``), and the
harness's KL per method on that prompt."""

from __future__ import annotations

import json
import sys


def main(src: str, dst: str) -> None:
    import torch

    from consumer_service.engine import ConsumerEngine
    from consumer_service.settings import ConsumerSettings
    from producer_service.engine import ProducerEngine
    from producer_service.settings import ProducerSettings
    from shared.engine import load_context
    from shared.model.fingerprint import weights_fingerprint
    from shared.model.hf_adapter import clone_cache
    from tools import client
    from tools.cli.common import pair_models
    from tools.data import Item
    from tools.eval.harness import MAX_NEW_TOKENS, evaluate, methods
    from tools.inprocess import InProcessServices

    spec = json.loads(open(src).read())
    ids, pair = [int(i) for i in spec["ids"]], spec.get("pair", "strong")
    pm = pair_models(pair)
    store = pm.store() / pair
    cons = ConsumerEngine(ConsumerSettings.load(model={"path": "-"}, name=pair, server={"port": 0},
                                                artifact_store=str(pm.store())), pm.consumer.model, pm.tok)

    def make_producer(addrs):
        s = ProducerSettings.load(model={"path": "-"}, server={"port": 0}, default_method="raw",
                                  consumers={n: {"address": a, "artifacts": str(store)} for n, a in addrs.items()})
        return ProducerEngine(s, pm.producer.model, pm.tok)

    with InProcessServices([cons], make_producer) as svc:
        res = client.generate(svc.producer_address, client.request(ids, pair, "raw", max_new_tokens=spec["new_tokens"],
                                                                    native_prefix=False, stop=()))
    c = pm.consumer
    own = c.build_cache(*(lambda s: (s.keys, s.values))(c.prefill(ids[:-1])))
    target = c.greedy(clone_cache(own, c.config), ids[-1], MAX_NEW_TOKENS, pm.fmt.stop_ids)
    oracle_lp = c.score(clone_cache(own, c.config), ids[-1], target)[: len(target)]  # [len(target), vocab]
    torch.save(oracle_lp.float().cpu(), dst + ".oracle.pt")
    pfp, cfp = weights_fingerprint(pm.producer.model), weights_fingerprint(c.model)
    pctx = load_context(pm.producer, store, "producer", pfp, cfp)
    cctx = load_context(c, store, "consumer", pfp, cfp)
    kinds = list(spec.get("methods", ["raw", "scd-reuse"]))
    item = Item(id="vllm-test", kind="qa", prompt_ids=ids, prefix_len=0)
    # the connector sends its header before vLLM's forward, so it serves scd-reuse without its guard: so does this
    unguarded = {"scd-reuse": {"guard": "none"}}
    ev = evaluate(pm.producer, c, pm.fmt, [item], methods(kinds, pctx, cctx, unguarded), native_prefix=False,
                  progress=False, generate=False)
    out = {"services_raw": list(res.token_ids), "services_method": res.timings.method, "target": target,
           "oracle_logprobs": dst + ".oracle.pt",
           "kl": {k: ev["methods"][k]["kl"] for k in kinds}}
    open(dst, "w").write(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
