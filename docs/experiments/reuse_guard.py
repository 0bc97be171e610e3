# Research script (issue 57), kept so that docs/calibration.md's REUSE-guard numbers can be rerun:
#   .venv/bin/python docs/experiments/reuse_guard.py HELDOUT.jsonl N_PER_KIND [OUT.json]
# Per layer and prompt: the share of the producer's centred K/V energy outside the REUSE encoder's span
# (what no code carries: the guard's statistic), and the relative error against the consumer's own K/V of
# the REUSE code's reconstruction (fp32, before int8) and of the producer's K/V as they are (raw). Printed
# per set: built-in validation (what calibration fit and scored), each kind of the held-out file. Does the
# statistic tell, per layer, where the code is worse than raw? Not part of the package; excluded from lint.
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

torch.set_num_threads(2)
from shared.artifacts import store
from shared.model.hf_adapter import to_rows
from tools.cli.common import items, pair_models
from tools.data import user

pm = pair_models("strong")
P, C = pm.producer, pm.consumer
folder = pm.store(None) / "strong"
meta, pt = store.load(folder, "producer")
_, ct = store.load(folder, "consumer")
L = P.n_layers
assert meta.reuse_code == "joint"
span = {}
for l in range(L):
    q, _ = torch.linalg.qr(pt[f"enc.kv.{l}"].double())
    span[l] = q.float()

n = int(sys.argv[2])
sets = {"val": items(pm, "validation", kinds=("qa",))[: n // 2] + items(pm, "validation", kinds=("lm",))[: n // 2]}
for it in user.load(Path(sys.argv[1]), pm.fmt):
    k = it.meta.get("kind", "user")
    sets.setdefault(k, [])
    if len(sets[k]) < n:
        sets[k].append(it)

out = {}
for name, its in sets.items():
    acc = defaultdict(list)
    for it in its:
        ids = it.prompt_ids[:-1]
        sp, sc = P.prefill(ids), C.prefill(ids)
        s = it.prefix_len
        for l in range(L):
            xp = torch.cat([to_rows(sp.keys[l][:, :, s:]), to_rows(sp.values[l][:, :, s:])], 1).float()
            xc = torch.cat([to_rows(sc.keys[l][:, :, s:]), to_rows(sc.values[l][:, :, s:])], 1).float()
            mu_p = pt[f"mu_p.kv.{l}"].float()
            z = (xp - mu_p) @ pt[f"enc.kv.{l}"].float()
            xh = ct[f"mu_c.kv.{l}"].float() + z @ ct[f"dec.kv.{l}"].float()
            d = xp - mu_p
            outside = d - (d @ span[l]) @ span[l].T
            norm = xc.pow(2).sum()
            acc["share", l].append(float(outside.pow(2).sum() / d.pow(2).sum()))
            acc["code", l].append(float((xh - xc).pow(2).sum() / norm))
            acc["raw", l].append(float((xp - xc).pow(2).sum() / norm))
    out[name] = {f"{a}.{l}": v for (a, l), v in acc.items()}
    print(f"== {name} ({len(its)} prompts): per layer mean share / code err / raw err; layers where code > raw")
    worse = []
    for l in range(L):
        m = {a: sum(acc[a, l]) / len(acc[a, l]) for a in ("share", "code", "raw")}
        frac = sum(c > r for c, r in zip(acc["code", l], acc["raw", l])) / len(its)
        print(f"  {l:2d} share {m['share']:.3f} code {m['code']:.4f} raw {m['raw']:.4f} code>raw on {frac:.0%}")
        if m["code"] > m["raw"]:
            worse.append(l)
    print("  code worse than raw on average at layers", worse)
Path(sys.argv[3] if len(sys.argv) > 3 else "/tmp/reuse_guard.json").write_text(json.dumps(out))
