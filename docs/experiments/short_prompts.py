# Research script (issue 16, seventeenth round), kept so that docs/scd-speed.md's short-prompt numbers can be rerun:
#   .venv/bin/python docs/experiments/short_prompts.py OUT_DIR
#   .venv/bin/scd eval --pair strong --data OUT_DIR/short_20.jsonl --n 30 \
#       --methods "oracle,raw,droidspeak,scd,scd:block_tokens=0.35;block_min_tokens=16,scd:block_tokens=0.35"
# Every other measurement of the token-sparse block used prompts of 300-1,000 positions. This writes user messages
# of 20, 60 and 180 tokens: the first tokens of each built-in LM and QA test item's text (after the chat template's
# head), one per line, which `scd eval --data` wraps in the pair's chat template and splits by hash (its test split,
# ~30 of ~190 lines, is what it scores). Not part of the package; excluded from lint.
from __future__ import annotations

import json
import sys
from pathlib import Path

from tools import data
from tools.assets.models import load_tokenizer

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
out.mkdir(parents=True, exist_ok=True)
tok = load_tokenizer()
items = data.load("lm", "test") + data.load("qa", "test")
for k in (20, 60, 180):
    path = out / f"short_{k}.jsonl"
    with path.open("w") as f:
        for it in items:
            text = tok.decode(it.prompt_ids[it.prefix_len:][:k], skip_special_tokens=True).strip()
            f.write(json.dumps({"prompt": text}) + "\n")
    print(path)
