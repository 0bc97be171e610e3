# Research script (issue 16, tenth round), kept so that docs/scd-speed.md's table can be rerun:
#   .venv/bin/python docs/experiments/reuse_scoring.py N_QA N_LM   (the table: 16 32)
# 'current' is the store's reuse_fallback_layers: the table was made with the sixth round's set (1, 2, 4,
# 16-20, 22, 23), as in `git show a5bf40b:artifacts/store/strong/meta.json`.
# Not part of the package and not imported by it; excluded from lint. Writes /tmp/reuse_scoring.json.
"""Exploratory probe: scd-reuse on strong's validation prompts, with LM text scored on the Oracle's
greedy continuation (what calibration did) and on its real continuation (what scd eval does); raw,
int8 everywhere, the code everywhere, the committed fallback set, then each layer falling back alone."""
import json
import sys
import time

import torch

torch.set_num_threads(2)
from tools.cli.common import pair_models, items
from shared.artifacts import store
from shared.codecs import CodecContext, make_method
from shared.codecs.scd import PairArtifacts
from tools.eval.metrics import kl_top1

pm = pair_models("strong")
P, C = pm.producer, pm.consumer
folder = pm.store(None) / "strong"
meta, pt = store.load(folder, "producer")
_, ct = store.load(folder, "consumer")
L = C.n_layers
allfb = meta.model_copy(update={"reuse_fallback_layers": list(range(L))})

def sides(m):
    p = make_method("scd-reuse", CodecContext(P, PairArtifacts(m, pt, "producer")), {"fallback": "auto"})
    c = make_method("scd-reuse", CodecContext(C, PairArtifacts(m, ct, "consumer")), {"fallback": "auto"})
    return p, c
code_none = (make_method("scd-reuse", CodecContext(P, PairArtifacts(meta, pt, "producer")), {"fallback": "none"}),
             make_method("scd-reuse", CodecContext(C, PairArtifacts(meta, ct, "consumer")), {"fallback": "none"}))
fb_all = sides(allfb)

def decoded(pair, state, start):
    enc, dec = pair
    out = []
    for layer in range(L):
        t = enc.encode_layer(state, layer, start)
        k, v = dec.decode_tensors(layer, {a: b.cpu() for a, b in t.items()})
        out.append((k, v))
    return out

qa = items(pm, "validation", kinds=("qa",))[:int(sys.argv[1])]
lm = items(pm, "validation", kinds=("lm",))[:int(sys.argv[2])]
recs = []
t0 = time.time()
for it in qa + lm:
    ids = it.prompt_ids
    ctx, last = ids[:-1], ids[-1]
    start = it.prefix_len
    ps = P.prefill(ctx); cs = C.prefill(ctx)
    ocache = lambda: C.build_cache(cs.keys, cs.values)
    greedy = C.greedy(ocache(), last, 32, pm.fmt.stop_ids)
    targets = {"greedy": greedy}
    if it.continuation_ids:
        targets["real"] = list(it.continuation_ids)
    olp = {k: C.score(ocache(), last, t)[: len(t)] for k, t in targets.items()}
    code = decoded(code_none, ps, start)
    int8 = decoded(fb_all, ps, start)
    raw = [(ps.keys[l][:, :, start:].half().float(), ps.values[l][:, :, start:].half().float()) for l in range(L)]
    pre = [(cs.keys[l][:, :, :start], cs.values[l][:, :, :start]) for l in range(L)]
    recs.append(dict(kind=it.kind, targets=targets, olp=olp, code=code, int8=int8, raw=raw, pre=pre, last=last))
    print(f"prepared {len(recs)}/{len(qa)+len(lm)} {time.time()-t0:.0f}s", flush=True)

def kl(rec, choice, tgt):
    ks, vs = [], []
    for l in range(L):
        k, v = rec[choice.get(l, "code")][l]
        pk, pv = rec["pre"][l]
        ks.append(torch.cat([pk, k], 2)); vs.append(torch.cat([pv, v], 2))
    t = rec["targets"][tgt]
    lp = C.score(C.build_cache(ks, vs), rec["last"], t)[: len(t)]
    return float(kl_top1(rec["olp"][tgt], lp)[0].mean())

def score(choice, label):
    out = {}
    for kind, tgt in (("qa", "greedy"), ("lm", "greedy"), ("lm", "real")):
        xs = [kl(r, choice, tgt) for r in recs if r["kind"] == kind]
        out[f"{kind}/{tgt}"] = sum(xs) / len(xs)
    print(label, {k: round(v, 4) for k, v in out.items()}, flush=True)
    return out

res = {}
cur = set(meta.reuse_fallback_layers)
res["raw"] = score({l: "raw" for l in range(L)}, "raw")
res["int8_all"] = score({l: "int8" for l in range(L)}, "int8_all")
res["code_all"] = score({}, "code_all")
res["current"] = score({l: "int8" for l in cur}, "current")
res["current_fp16"] = score({l: "raw" for l in cur}, "current_fp16")
per = {}
for l in range(L):
    per[l] = score({l: "int8"}, f"fallback {l}")
res["per_layer"] = per
json.dump(res, open("/tmp/reuse_scoring.json", "w"), indent=1)
print("done", time.time() - t0)
