# Research script (issue 57), kept so that docs/results.md's long-prompt numbers can be rerun:
#   .venv/bin/python docs/experiments/length_anatomy.py ROWS.jsonl [METHOD ...] [--out OUT.json]
# Where a method's rebuilt cache departs from the consumer's own (the Oracle's), by layer and by
# position: for each prompt, each layer's relative error of K and of V over positions in buckets of
# 1,000, for raw transfer and each method (default: scd). Does the error grow with the position,
# and in which layers (the PATCH block's, the REUSE layers before or after it)? Not part of the
# package; excluded from lint.
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(2)
from shared.codecs import parse_variant
from shared.engine import load_context
from tools.cli.common import pair_models
from tools.data import user
from tools.eval.harness import Context, codec_method

args = [a for a in sys.argv[1:] if not a.startswith("--")]
out_path = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else Path("/tmp/length_anatomy.json")
rows_path, labels = Path(args[0]), (args[1:] or ["scd"])
pm = pair_models("strong")
folder = pm.store(None) / "strong"
pctx, cctx = load_context(pm.producer, folder, "producer"), load_context(pm.consumer, folder, "consumer")
runners = {lab: codec_method(*parse_variant(lab), pctx, cctx) for lab in ["raw", *labels]}
hidden = sorted({l for r in runners.values() for l in r.hidden_layers})
residual = sorted({l for r in runners.values() for l in r.residual_layers})
BUCKET = 1000
report = {}
for it in user.load(rows_path, pm.fmt):
    ids = it.prompt_ids[:-1]
    ps = pm.producer.prefill(ids, hidden_layers=hidden, residual_layers=residual)
    cs = pm.consumer.prefill(ids)
    ctx = Context(it, ps, cs, it.prefix_len)
    own = pm.consumer.build_cache(cs.keys, cs.values)
    report[it.id] = {}
    for lab, run in runners.items():
        cache = run(ctx, pm.consumer).cache
        per = {}
        for l in range(pm.consumer.n_layers):
            for name, a, b in (("k", cache.layers[l].keys, own.layers[l].keys),
                               ("v", cache.layers[l].values, own.layers[l].values)):
                t = a.shape[2]
                errs = []
                for s in range(it.prefix_len, t, BUCKET):
                    e = min(t, s + BUCKET)
                    d = (a[:, :, s:e] - b[:, :, s:e]).float().pow(2).sum()
                    errs.append(float(d / b[:, :, s:e].float().pow(2).sum()))
                per[f"{name}.{l}"] = errs
        report[it.id][lab] = per
        print(it.id, lab, "V rel err by 1k bucket, layers 0/7/13/16/20/23/25/29:")
        for l in (0, 7, 13, 16, 20, 23, 25, 29):
            print(f"   {l:2d} " + " ".join(f"{x:.4f}" for x in per[f"v.{l}"]))
out_path.write_text(json.dumps(report))
