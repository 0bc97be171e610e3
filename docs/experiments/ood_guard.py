# Research script (issue 16, eighteenth round), kept so that docs/scd-speed.md's numbers can be rerun:
#   .venv/bin/python docs/experiments/short_prompts.py DIR   (writes DIR/wiki_{fr,es}.jsonl, DIR/short_*.jsonl)
#   .venv/bin/python docs/experiments/ood_guard.py DIR N [OUT.json]   (the table: DIR 24 results/ood_guard_r18.json)
# Can the producer tell, from its own prefill, that a prompt is unlike the text the REUSE codes were fit on?
# Per layer, the share of the centered producer K (and V) energy outside the span of the REUSE encoder
# (the part no code can carry): per prompt, averaged over tokens, then its mean over the layers. Printed per
# set of prompts: built-in validation (what calibration fit on and scored), built-in test, French, Spanish,
# short messages; and at the block's entry, the consumer-side gap (see at_entry). Not part of the package and not
# imported by it; excluded from lint. Writes OUT.json (default /tmp/ood_guard.json).
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(2)
from shared.artifacts import store
from tools.cli.common import items, pair_models

pm = pair_models("strong")
P = pm.producer
folder = pm.store(None) / "strong"
meta, pt = store.load(folder, "producer")
L = P.n_layers
d = Path(sys.argv[1])
n = int(sys.argv[2])
parts = ("kv",) if meta.reuse_code == "joint" else ("k", "v")
proj = {}
for layer in range(L):
    for kv in parts:
        e = pt[f"enc.{kv}.{layer}"].double()
        q, _ = torch.linalg.qr(e)  # an orthonormal basis of the encoder's span
        proj[kv, layer] = (q.float(), pt[f"mu_p.{kv}.{layer}"].float())
code_layers = [l for l in range(L) if l not in set(meta.reuse_fallback_layers)]
print("code layers (scd-reuse sends a code there):", code_layers)

sets = {
    "val-qa": items(pm, "validation", kinds=("qa",))[:n],
    "val-lm": items(pm, "validation", kinds=("lm",))[:n],
    "test-qa": items(pm, "test", kinds=("qa",))[:n],
    "test-lm": items(pm, "test", kinds=("lm",))[:n],
    "heldout": items(pm, "test", kinds=("heldout",))[:n],
}
for name in ("wiki_fr", "wiki_es", "short_20", "short_180"):
    if (d / f"{name}.jsonl").exists():
        sets[name] = items(pm, "test", data_file=d / f"{name}.jsonl")[:n]


C = pm.consumer
_, ct = store.load(folder, "consumer")
a = meta.patch_blocks[0][0]


def rel(x, y):  # E||x - y||^2 / E||y - mean y||^2 over rows
    return float((x - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum().clamp_min(1e-12))


def at_entry(st, ids, start):
    """At the block's entry layer a, the consumer's REUSE K/V (the code, no int8) against its K/V
    from the producer's mapped entry state (what it could compute there), against its own
    (the truth), and raw's (the producer's K/V) against its own."""
    rows = lambda x: x[0, :, start:].transpose(0, 1).reshape(x.shape[2] - start, -1).float()
    xp = torch.cat([rows(st.keys[a]), rows(st.values[a])], 1)
    z = (xp - pt[f"mu_p.kv.{a}"].float()) @ pt[f"enc.kv.{a}"].float()
    reuse = ct[f"mu_c.kv.{a}"].float() + z @ ct[f"dec.kv.{a}"].float()
    h = st.residual[a][0].float()
    w, mp, mc = (ct[f"entry.{x}.{a}"].float() for x in ("w", "mu_p", "mu_c"))
    hm = h + (h - mp) @ w + (mc - mp)
    hm[0] = h[0]
    k, v = C.kv_from_residual(a, hm.unsqueeze(0))
    est = torch.cat([rows(k), rows(v)], 1)
    cs = C.prefill(ids)
    own = torch.cat([rows(cs.keys[a]), rows(cs.values[a])], 1)
    return {"reuse_vs_est": rel(reuse, est), "reuse_vs_own": rel(reuse, own), "raw_vs_own": rel(xp, own),
            "est_vs_own": rel(est, own)}


def outside(ids, start):
    st = P.prefill(ids, residual_layers=[a])
    per_layer = []
    for layer in range(L):
        shares = []
        k, v = (x[0, :, start:].transpose(0, 1).reshape(x.shape[2] - start, -1).float()
                for x in (st.keys[layer], st.values[layer]))
        for kv, rows in ((("kv", torch.cat([k, v], 1)),) if parts == ("kv",) else (("k", k), ("v", v))):
            q, mu = proj[kv, layer]
            c = rows - mu
            res = c - (c @ q) @ q.T
            shares.append(float((res.pow(2).sum(1) / c.pow(2).sum(1).clamp_min(1e-12)).mean()))
        per_layer.append(sum(shares) / len(shares))
    return per_layer, at_entry(st, ids, start)


block = list(range(*meta.patch_blocks[0]))
cols = {"code layers": code_layers, "block layers": block}
out = {}
print(f"{'set':10} {'n':>3}  " + "  ".join(f"{c + ' min/max':>19}" for c in cols) + f"  {'entry gap min/max':>17}  "
      "reuse-vs-own raw-vs-own est-vs-own (means)")
for name, its in sets.items():
    got = [outside(it.prompt_ids, it.prefix_len) for it in its]
    rows = torch.tensor([g[0] for g in got])  # [prompts, layers]
    ent = {k: torch.tensor([g[1][k] for g in got]) for k in got[0][1]}
    shares = {c: rows[:, ls].mean(1) for c, ls in cols.items()}
    e = ent["reuse_vs_est"]
    out[name] = {"n": len(its), "rows": [[round(x, 5) for x in r] for r in rows.tolist()],
                 **{c: [round(x, 5) for x in v.tolist()] for c, v in shares.items()},
                 **{k: [round(x, 5) for x in v.tolist()] for k, v in ent.items()}}
    print(f"{name:10} {len(its):3d}  " + "  ".join(f"{float(v.min()):9.4f} {float(v.max()):9.4f}"
                                               for v in shares.values())
          + f"  {float(e.min()):8.4f} {float(e.max()):8.4f}  {float(ent['reuse_vs_own'].mean()):.3f} "
          f"{float(ent['raw_vs_own'].mean()):.3f} {float(ent['est_vs_own'].mean()):.3f}", flush=True)
Path(sys.argv[3] if len(sys.argv) > 3 else "/tmp/ood_guard.json").write_text(json.dumps(out))
