"""An example of "your own models" for trying ``scd pair add`` end to end: a fine-tune of the
SmolLM2 producer that this project did not ship (a LoRA fit for a few steps on the Python standard
library's own docstrings, text the built-in data never uses, merged into a plain folder), and an
operator's JSONL of questions about other modules' documentation.

    python -m tools.assets.example_pair --out /tmp/byo            # ~1 min on 2 cores
    scd pair add my-pair --producer $SCD_HOME/models/smollm2-135m-instruct --consumer /tmp/byo/my-finetune
    scd calibrate --pair my-pair --data /tmp/byo/prompts.jsonl

``--adapter-only`` keeps the LoRA as an adapter folder instead (``scd pair add --consumer-adapter``).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
from pathlib import Path

TRAIN_MODULES = ["collections", "itertools", "functools", "json", "csv", "heapq", "bisect", "string", "textwrap",
                 "random", "math", "statistics", "operator", "copy", "enum", "fractions", "decimal", "datetime"]


def prompt_modules() -> list[str]:
    """Standard-library modules the LoRA never saw, in a fixed order (the prompts are about them)."""
    import sys

    skip = set(TRAIN_MODULES) | {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "pydoc_data"}
    return sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in skip)


def module_doc(name: str) -> str:
    """A module's docstring and those of its public classes and functions."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module missing on this platform is skipped
            return ""
    parts = [inspect.getdoc(mod) or ""]
    for attr in sorted(dir(mod)):
        obj = getattr(mod, attr, None)
        if not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)) and \
                getattr(obj, "__module__", "") == name:
            parts.append(f"{attr}: {inspect.getdoc(obj) or ''}")
    return "\n\n".join(p for p in parts if p.strip())


def prompts(tok, n: int, tokens: int) -> list[dict]:
    """Up to ``n`` prompts of ``tokens`` tokens (a module's documentation is cut into windows of that
    size; a shorter tail window is dropped), each followed by a question whose gold answer is the
    module's name."""
    out = []
    for name in prompt_modules():
        ids = tok(module_doc(name), add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - int(0.8 * tokens) + 1, tokens):
            text = tok.decode(ids[start : start + tokens])
            out.append({"prompt": f"{text}\n\nQuestion: which Python module does the documentation above describe? "
                                  "Answer with its name only.", "answer": name})
            if len(out) >= n:
                return out
    return out


def make(out: Path, steps: int = 12, n_prompts: int = 64, prompt_tokens: int = 1000, adapter_only: bool = False,
         lr: float = 4e-3) -> dict:
    """Write ``out/my-finetune`` (or ``out/my-adapter``) and ``out/prompts.jsonl``; returns their paths."""
    from tools.assets.models import load_tokenizer, producer_dir
    from tools.assets.train import Recipe, fit_lora

    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(producer_dir())
    ids = tok("\n\n".join(module_doc(m) for m in TRAIN_MODULES), add_special_tokens=False)["input_ids"]
    recipe = Recipe(corpus="stdlib-docstrings", rank=32, alpha=64, lr=lr, steps=steps, batch=2, seq_len=128)
    model, loss, seconds = fit_lora(producer_dir(), ids, recipe, desc="example lora")
    paths = {"producer": str(producer_dir())}
    if adapter_only:
        model.save_pretrained(out / "my-adapter")
        paths["adapter"] = str(out / "my-adapter")
    else:
        model.merge_and_unload().save_pretrained(out / "my-finetune")
        tok.save_pretrained(out / "my-finetune")
        paths["consumer"] = str(out / "my-finetune")
    rows = prompts(tok, n_prompts, prompt_tokens)
    (out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths.update(data=str(out / "prompts.jsonl"), n_prompts=len(rows), train_loss=round(loss, 3),
                 train_seconds=round(seconds, 1))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=12, help="LoRA steps (batch 2 x 128 tokens)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--adapter-only", action="store_true", help="keep the LoRA as an adapter folder")
    a = ap.parse_args()
    print(json.dumps(make(a.out, a.steps, a.prompts, a.prompt_tokens, a.adapter_only)))


if __name__ == "__main__":
    main()
