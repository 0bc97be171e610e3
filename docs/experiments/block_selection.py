# Research script (issue 16, twelfth and thirteenth rounds), kept so that docs/scd-speed.md's selection table can be rerun:
#   SPLIT=validation .venv/bin/python docs/experiments/block_selection.py 48 0.25 sum,nosink,sum:p1,sum:q16
#   SPLIT=test .venv/bin/python docs/experiments/block_selection.py 24 0.25 sum,csum,cqk,cqkm,sum@1
# Variants (the producer's score of each position, from which `top_positions` takes the share):
#   sum     the served rule: softmax attention of the last 32 tokens, summed over heads, queries, block layers
#   max     the largest attention any head and query pays a position; hmax: per head summed over queries, max over heads
#   nosink  each query's attention renormalized without its top position (the sink) before summing
#   X:qN    the last N tokens as queries instead of 32; X:p1  the score half max-pooled over +-1 position
#   X:cC    per prompt, as many positions as cover the share C of the score (the last 16 and the sink aside): an adaptive share
#   csum    the consumer's OWN attention from its own prefill (knowledge no consumer has: the ceiling of selection)
#   cqk     the consumer's norms and q/k projections applied to the producer's residual stream at each block layer
#   cqkm    cqk, the entry layer's state first mapped by the calibrated entry map; cqk1: the entry layer only
#   X+fb    the block layers (and the exit layer) send the producer's own int8 K/V for the positions left out, not REUSE codes
#   X+nat   (diagnostic) the positions left out take the consumer's own K/V at the block layers: the ceiling of better codes
#   X+natA-B  the same at block layers A..B only (which layers' K/V carry the gap)
#   X+zB    every REUSE code quantized at B bits (the calibrated levels: 5)
#   X+ridge the positions left out take the pair's ridge profile's mapped K/V (the producer's K/V, full width, fp32)
#   X+hnN   ... take a full-width ridge map (fitted here on 24 QA + 24 LM calibration prompts, ALPHA x mean variance,
#           moments cached in /tmp) from the producer's normalized pre-attention input at the layer (hn1), with the block
#           entry's (hn2), with the layer before's (hn3): what any code of the producer's per-position states can reach
#   X@S     the variant at block_tokens=S instead of the command line's share (sum@1: the whole block)
# ITEMS=3,9 keeps only those of the first N prompts.
# Teacher-forced KL against the Oracle's greedy answer, per prompt (no generation). Writes /tmp/sel_*.json.
# Not part of the package and not imported by it; excluded from lint.
"""Probe: which positions a token-sparse block recomputes (producer-side score variants), validation QA."""
import json, sys, time
import torch
torch.set_num_threads(2)
import shared.codecs as sc
from shared.codecs.scd import SCD, PairArtifacts
from shared.codecs import CodecContext
from shared.artifacts import store
from tools.cli.common import pair_models, items
from tools.eval.harness import evaluate, codec_method
import torch.nn.functional as F
import os
SPLIT = os.environ.get("SPLIT", "validation")

VAR = {"v": "sum"}
NATIVE = {}
orig_make = sc.make_method
def substitute(m, layers, source):
    """The consumer method ``m``'s K/V of the positions left out, at ``layers``, taken from ``source(layer)``
    (K/V [1, H, T, D] of the whole prompt) instead of its REUSE codes."""
    orig = m._reuse
    def sub(layer, tensors):
        k, v = orig(layer, tensors)
        if layer not in layers:
            return k, v
        t = k.shape[2]
        k2, v2 = source(layer)
        return k2[:, :, -t:].to(k.dtype), v2[:, :, -t:].to(v.dtype)
    m._reuse = sub

def mk(*a, **k):
    m = orig_make(*a, **k)
    sel, _, opt = VAR["v"].partition("+")
    m._sel = sel
    if (opt.startswith(("nat", "hn")) or opt == "ridge") and hasattr(m, "blocks") and m.art.side == "consumer":
        blk = {l for a_, b_ in m.blocks for l in range(a_, b_ + 1)}
        if opt.startswith("nat"):  # the ceiling of better codes; natA-B: at block layers A..B only
            if opt != "nat":
                lo, hi = map(int, opt[3:].split("-"))
                blk = {l for l in blk if lo <= l <= hi}
            substitute(m, blk, lambda layer: (NATIVE["s"].keys[layer], NATIVE["s"].values[layer]))
        else:  # a full-width calibrated map of the producer's states
            substitute(m, blk, lambda layer, opt=opt: MAPS[opt](layer, NATIVE["p"]))
    if opt.startswith("z") and hasattr(m, "levels"):  # every REUSE code at this many bits
        m.levels = {**m.levels, "z": int(opt[1:])}
    if opt == "fb" and hasattr(m, "blocks"):  # the block layers' codes as the producer's own int8 K/V instead of REUSE codes
        m.fallback = m.fallback | {l for a_, b_ in m.blocks for l in range(a_, b_ + 1)}
    return m
sc.make_method = mk

def mass(m, layer, hidden, keys, nq, how):
    x = hidden.to(m.device, m.dtype); t = x.shape[1]; nq = max(1, min(nq, t))
    q = m.apply_rope(m.queries(layer, x[:, t - nq:]), t - nq)
    k = m.apply_rope(keys.to(m.device, m.dtype), 0).repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
    s = (q @ k.transpose(-1, -2)) * m.head_dim ** -0.5
    qpos = torch.arange(t - nq, t).view(-1, 1)
    s = s.masked_fill(torch.arange(t).view(1, -1) > qpos, float("-inf"))
    p = torch.softmax(s.float(), -1)[0]  # [H, nq, T]
    if how == "sum":
        return p.sum((0, 1))
    if how == "max":
        return p.amax((0, 1))
    if how == "hmax":  # per head: summed over queries, normalized by head total; max over heads
        return p.sum(1).amax(0)
    if how == "nosink":  # renormalize each row without its top-1 (sink) then sum
        top = p.argmax(-1, keepdim=True)
        p = p.scatter(-1, top, 0.0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        return p.sum((0, 1))
    raise ValueError(how)

def scores(self, state, block):
    m = self.ctx.model
    a, b = block
    how = getattr(self, "_sel", "sum")
    NATIVE["s"] = CONS.prefill(state.token_ids[0].tolist())
    NATIVE["p"] = state
    nq = 32
    base = how
    pool = 0
    cover = None
    if ":" in how:
        base, opt = how.split(":")
        if opt.startswith("q"): nq = int(opt[1:])
        if opt.startswith("p"): pool = int(opt[1:])
        if opt.startswith("c"): cover = float(opt[1:])
    sc_ = 0
    if base.startswith("cqk"):
        tot = 0
        for layer in (range(a, b) if base != "cqk1" else [a]):
            r = state.residual[layer]
            if layer == a and base in ("cqk1", "cqkm"):
                w, mp, mc = (CART.t(f"entry.{x}.{a}", r.device) for x in ("w", "mu_p", "mu_c"))
                x0 = r[0].float(); r = (x0 + (x0 - mp) @ w + (mc - mp)); r[0] = x0[0]; r = r.unsqueeze(0)
            tot = tot + CONS.attention_mass(layer, r, nq)
        return tot
    if base == "csum":
        cs = CONS.prefill(state.token_ids[0].tolist(), hidden_layers=list(range(a, b)))
        state = cs
        base = "sum"
    for layer in range(a, b):
        sc_ = sc_ + mass(m, layer, state.hidden[layer], state.keys[layer], nq, base)
    if pool:
        sc_ = F.max_pool1d(sc_.view(1, 1, -1), 2 * pool + 1, 1, pool).view(-1) * 0.5 + sc_ * 0.5
    COV["k"] = None
    if cover is not None:  # as many positions as cover this share of the score (the last 16 aside)
        t = sc_.float().clone(); t[-16:] = 0; t[0] = 0  # the sink (position 0) is kept by its score anyway
        cum = t.sort(descending=True).values.cumsum(0) / t.sum()
        COV["k"] = min(t.shape[0], int((cum < cover).sum()) + 2 + 16)
        SHARES.setdefault(how, []).append(COV["k"] / t.shape[0])
    return sc_
COV, SHARES = {"k": None}, {}
_n_keep = SCD.n_keep
def n_keep(self, n_tokens, start):
    if ":c" in getattr(self, "_sel", "") and COV["k"] is not None:
        return COV["k"]
    return _n_keep(self, n_tokens, start)
SCD.n_keep = n_keep
SCD._scores = scores

pm = pair_models("strong")
folder = pm.store(None) / "strong"
meta, pt = store.load(folder, "producer"); _, ct = store.load(folder, "consumer")
pctx, cctx = CodecContext(pm.producer), CodecContext(pm.consumer)
pctx.artifacts, cctx.artifacts = PairArtifacts(meta, pt, "producer"), PairArtifacts(meta, ct, "consumer")
n = int(sys.argv[1]); share = sys.argv[2]; variants = sys.argv[3].split(",")
its = items(pm, SPLIT, kinds=("qa",))[:n]
if os.environ.get("ITEMS"):  # only these indices of the first n
    its = [its[int(i)] for i in os.environ["ITEMS"].split(",")]
CONS = pm.consumer
CART = cctx.artifacts
MAPS = {}
if any("+ridge" in v for v in variants):
    from safetensors.torch import load_file
    from shared.codecs.ridge import apply as ridge_apply
    RT = load_file(str(pm.store(None) / "strong.ridge.safetensors"))
    MAPS["ridge"] = lambda layer, st: ridge_apply(RT, st.keys, st.values, layer, 0, CONS.head_dim)
HN = sorted({v.partition("+")[2] for v in variants if "+hn" in v})
if HN:  # hnK: ridge from the producer's normalized pre-attention input at the layer (hn1), + the entry layer's (hn2), + layer-1's (hn3)
    from tools.calibration.linalg import Moments, ridge
    a0, b0 = meta.patch_blocks[0]
    lay = list(range(a0, b0 + 1))
    cal = items(pm, "calibration", kinds=("qa",))[:24] + items(pm, "calibration", kinds=("lm",))[:24]
    feats = {"hn1": lambda st, l: [st.hidden[l]], "hn2": lambda st, l: [st.hidden[l], st.hidden[a0]],
             "hn3": lambda st, l: [st.hidden[l], st.hidden[l - 1]]}
    mom, width = {}, {}  # the joint moments of [producer features | consumer K/V] per variant and layer
    t1 = time.time()
    cache = {o: f"/tmp/hn_mom_{o}_{len(cal)}.pt" for o in HN}
    for o in HN:
        if os.path.exists(cache[o]):
            for l, (n_, sum_, gram) in torch.load(cache[o]).items():
                mom[(o, l)] = Moments(sum_.shape[0]); mom[(o, l)].n, mom[(o, l)].sum, mom[(o, l)].gram = n_, sum_, gram
    todo = [o for o in HN if not os.path.exists(cache[o])]
    for it in (cal if todo else []):
        ids = it.prompt_ids
        ps = pm.producer.prefill(ids, hidden_layers=list(range(a0 - 1, b0 + 1)))
        cs = pm.consumer.prefill(ids)
        for o in todo:
            for l in lay:
                x = torch.cat([f[0, 1:] for f in feats[o](ps, l)], -1)  # position 0 (the sink) not fitted
                y = torch.cat([cs.keys[l][0].permute(1, 0, 2).flatten(1), cs.values[l][0].permute(1, 0, 2).flatten(1)], -1)[1:]
                mom.setdefault((o, l), Moments(x.shape[1] + y.shape[1])).add(torch.cat([x, y], -1).double())
    for o in todo: torch.save({l: (mom[(o, l)].n, mom[(o, l)].sum, mom[(o, l)].gram) for l in lay}, cache[o])
    W = {}
    ALPHA = float(os.environ.get("ALPHA", "1e-3"))
    for (o, l), mm in mom.items():  # ridge with an unpenalized intercept; penalty ALPHA x the features' mean second moment
        d = mm.sum.shape[0] - 2 * CONS.kv_dim
        c, mu = mm.cov(), mm.mean
        w = ridge(c[:d, :d], c[:d, d:], ALPHA * float(torch.diagonal(mm.cov(center=False))[:d].mean()))
        W[(o, l)] = torch.cat([w, (mu[d:] - mu[:d] @ w).unsqueeze(0)]).float()  # [features + 1, K/V]
    print(f"fitted {HN} on {len(cal)} prompts in {time.time()-t1:.0f}s", flush=True)
    H, D = CONS.n_kv_heads, CONS.head_dim
    def mk_map(o):
        def f(layer, st):
            x = torch.cat([z[0] for z in feats[o](st, layer)], -1).float()
            y = torch.cat([x, torch.ones(x.shape[0], 1)], -1) @ W[(o, layer)]
            k, v = y[:, :H * D], y[:, H * D:]
            return (k.view(-1, H, D).permute(1, 0, 2).unsqueeze(0), v.view(-1, H, D).permute(1, 0, 2).unsqueeze(0))
        return f
    for o in HN:
        MAPS[o] = mk_map(o)
runners = {}
for v in variants:
    vv, _, sh = v.partition("@")
    VAR["v"] = vv
    runners[v] = codec_method("scd", pctx, cctx, {"block_tokens": sh or share})
runners = {"oracle": codec_method("oracle", pctx, cctx, None), **runners}
hidden = sorted({l for r in runners.values() for l in getattr(r, "hidden_layers", ())} | (set(range(a0 - 1, b0 + 1)) if HN else set()))
residual = sorted({l for r in runners.values() for l in getattr(r, "residual_layers", ())} | {l for a_, b_ in meta.patch_blocks for l in range(a_, b_)})
# per-item KL: run evaluate per item
t0 = time.time()
per = {v: [] for v in runners}
for i, it in enumerate(its):
    r = evaluate(pm.producer, pm.consumer, pm.fmt, [it], runners, True, hidden_layers=hidden, residual_layers=residual, progress=False, generate=False)
    for v in runners:
        per[v].append(r["methods"][v]["kl"])
    print(i, f"{time.time()-t0:.0f}s", {v: round(per[v][-1], 3) for v in variants}, flush=True)
print({v: round(sum(x)/len(x), 4) for v, x in per.items()})
for v, x in SHARES.items():
    print(v, "adaptive shares: mean", round(sum(x) / len(x), 3), "min", round(min(x), 3), "max", round(max(x), 3))
    per[v + " shares"] = x
json.dump(per, open(f"/tmp/sel_{SPLIT}_{share}_{n}_{sys.argv[3]}.json", "w"))
