"""Bring your own models, as a new user would: two folders the project did not build go through
``scd pair add``, ``scd calibrate --data``, ``scd eval --data``, ``scd serve`` and ``scd generate``
as subprocesses, with a registry and an artifact store of their own (nothing in $SCD_HOME or the
repository is touched).

* real: a LoRA on the SmolLM2 producer, fit for a few steps on the Python standard library's own
  docstrings (text the built-in data never uses), merged into a folder; prompts about other modules'
  docstrings. On the held-out split SCD's KL must be below raw transfer's.
* tiny: the same commands on a tiny llama pair whose consumer is a LoRA adapter folder merged at load.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ops_support import VENV_BIN, wait_for

from tools.demo import free_port


def scd(*args: str, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    r = subprocess.run([str(VENV_BIN / "scd"), *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"scd {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


def user_env(tmp: Path) -> dict:
    return dict(os.environ, SCD_PAIRS=str(tmp / "pairs.json"), SCD_STORE=str(tmp / "store"), OMP_NUM_THREADS="2",
                PYTHONUNBUFFERED="1")


def serve_and_generate(pair: str, prompt: str, env: dict, tmp: Path, methods=("scd",)) -> str:
    """``scd serve consumer --pair`` and ``scd serve producer --consumer PAIR=...`` as processes, then
    ``scd generate --pair`` with each method; both services stopped at the end whatever happens."""
    cport, pport = free_port(), free_port()
    procs = []
    try:
        for role, args in (("consumer", ["--pair", pair, "--port", str(cport)]),
                           ("producer", ["--consumer", f"{pair}=127.0.0.1:{cport}", "--port", str(pport)])):
            log = open(tmp / f"{role}.log", "w")
            procs.append(subprocess.Popen([str(VENV_BIN / "scd"), "serve", role, *args], env=env, stdout=log,
                                          stderr=subprocess.STDOUT))
            wait_for(lambda r=role: "listening on" in (tmp / f"{r}.log").read_text() or procs[-1].poll() is not None,
                     timeout=240, what=f"{role} to listen")
            assert procs[-1].poll() is None, (tmp / f"{role}.log").read_text()[-3000:]
        return "".join(scd("generate", "--producer", f"127.0.0.1:{pport}", "--pair", pair, "--method", m,
                           "--max-new-tokens", "12", prompt, env=env, timeout=300).stdout for m in methods)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


# ------------------------------------------------------------------------------------------ real
@pytest.fixture(scope="module")
def byo_pair(real_assets, tmp_path_factory):
    """A fine-tune the project did not build (a LoRA fit on stdlib docstrings, merged into a folder)
    and an operator's JSONL of questions about other modules' documentation."""
    from tools.assets.example_pair import make

    return make(tmp_path_factory.mktemp("byo"), steps=int(os.environ.get("BYO_STEPS", 12)), n_prompts=40,
                prompt_tokens=400)


@pytest.mark.real
def test_bring_your_own_pair_end_to_end(byo_pair, tmp_path):
    env = user_env(tmp_path)
    d = byo_pair
    out = scd("pair", "add", "my-pair", "--producer", d["producer"], "--consumer", d["consumer"], env=env)
    assert "registered pair 'my-pair'" in out.stdout
    small = ["--set", "n_prompts=16", "--set", "max_prompt_tokens=512", "--set", "n_val=6", "--set",
             "aligner_steps=120", "--set", "pool=3", "--set", "budget_k=1", "--set", "ablations=false"]
    cal = scd("calibrate", "--pair", "my-pair", "--data", str(d["data"]), "-q", *small, env=env)
    report = json.loads(cal.stdout.strip().splitlines()[-1])
    assert report["peak_rss_mb"]["total"] < 4096
    scd("calibrate", "--pair", "my-pair", "--data", str(d["data"]), "--method", "droidspeak", "-q", "--set", "n_val=6",
        env=env)
    res = tmp_path / "eval.json"
    scd("eval", "--pair", "my-pair", "--data", str(d["data"]), "--methods", "oracle,raw,scd-reuse,scd,droidspeak",
        "--n", "10", "--no-answers", "--json", str(res), env=env)  # KL only (the tiny pair's test decodes answers)
    body = json.loads(res.read_text())
    kl = {m: r["kl"] for m, r in body["methods"].items()}
    assert body["data"] == str(d["data"]) and body["n"] >= 6
    assert kl["oracle"] == 0.0 and kl["raw"] > 0.01, kl
    assert kl["scd"] < kl["raw"], kl
    assert (tmp_path / "store" / "my-pair" / "meta.json").exists()
    assert not (Path(__file__).parents[2] / "artifacts" / "store" / "my-pair").exists()
    text = serve_and_generate("my-pair", "Which Python module reads and writes ZIP files?", env, tmp_path)
    assert "[scd] TTFT" in text


# ------------------------------------------------------------------------------------------ tiny
@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    from shared.model.tiny import save_pretrained, tiny_model, tiny_tokenizer

    root = tmp_path_factory.mktemp("tiny-byo")
    tok = tiny_tokenizer()
    save_pretrained(tiny_model("llama", n_layers=4), root / "base", tok)
    lora = get_peft_model(tiny_model("llama", n_layers=4), LoraConfig(r=8, lora_alpha=16,
                                                                      target_modules=["k_proj", "v_proj", "o_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    lora.save_pretrained(root / "adapter")
    rng = torch.Generator().manual_seed(1)
    words = ["river", "city", "song", "ship", "queen", "stone", "cloud", "garden"]
    lines = []
    for i in range(40):
        pick = [words[int(j)] for j in torch.randint(0, len(words), (12,), generator=rng)]
        lines.append({"prompt": f"{' '.join(pick)} #{i}. Which word came first?", "answer": pick[0]})
    (root / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


TINY_SETTINGS = ["--set", "r_kv=48", "--set", "r_h=32", "--set", "n_val=4", "--set", "aligner_hidden=32", "--set",
                 "aligner_steps=40", "--set", "aligner_rows=256", "--set", "pool=2", "--set", "budget_k=1", "--set",
                 "block_layers=2", "--set", "val_tokens=8", "--set", "ablations=false"]


def test_tiny_adapter_pair_end_to_end(tiny_folders, tmp_path):
    env = user_env(tmp_path)
    f = tiny_folders
    scd("pair", "add", "tiny-lora", "--producer", str(f / "base"), "--consumer-adapter", str(f / "adapter"), env=env)
    shown = scd("pair", "show", "tiny-lora", env=env).stdout
    assert "consumer_adapter" in shown and str(f / "adapter") in shown
    scd("calibrate", "--pair", "tiny-lora", "--data", str(f / "prompts.jsonl"), "-q", *TINY_SETTINGS, env=env)
    # the newest stages again on the artifacts just made: the entry map refitted, the levels re-chosen
    refined = json.loads(scd("calibrate", "--pair", "tiny-lora", "--data", str(f / "prompts.jsonl"), "--method",
                             "refine", "-q", "--set", "n_val=4", "--set", "val_tokens=8", "--set", "n_prompts=8",
                             env=env).stdout.strip().splitlines()[-1])
    assert refined["entry_map"]["kept"] == (refined["entry_map"]["kl_with"] < refined["entry_map"]["kl_without"])
    assert refined["code_levels"]["kl"] <= refined["code_levels"]["kl_bound"]
    bad = subprocess.run([str(VENV_BIN / "scd"), "calibrate", "--pair", "tiny-lora", "--data",
                          str(f / "prompts.jsonl"), "--method", "refine", "--set", "r_kv=8"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "unknown refine settings ['r_kv']" in bad.stderr
    # scd-reuse's fallback layers selected again on the same artifacts; scd's left as they are
    fb = json.loads(scd("calibrate", "--pair", "tiny-lora", "--data", str(f / "prompts.jsonl"), "--method",
                        "fallback", "-q", "--set", "n_val=4", "--set", "val_tokens=8", "--set", "modes=scd-reuse",
                        env=env).stdout.strip().splitlines()[-1])
    assert set(fb) == {"seconds", "raw_by_kind", "reuse_fallback"} and isinstance(fb["reuse_fallback"]["layers"], list)
    bad = subprocess.run([str(VENV_BIN / "scd"), "calibrate", "--pair", "tiny-lora", "--data",
                          str(f / "prompts.jsonl"), "--method", "fallback", "--set", "modes=scd-typo"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "fallback modes must be some of" in bad.stderr
    for kind, extra in (("droidspeak", ["--set", "budget_layers=2", "--set", "block_len=2", "--set", "n_val=4"]),
                        ("spectrum", ["--set", "trials=2"]), ("ridge", ["--set", "top_ks=[1]", "--set", "n_val=4"])):
        scd("calibrate", "--pair", "tiny-lora", "--data", str(f / "prompts.jsonl"), "--method", kind, "-q", *extra,
            env=env)
    table = scd("calibrate", "--pair", "tiny-lora", "--data", str(f / "prompts.jsonl"), "--method", "auto", "-q",
                "--set", "n_val=4", env=env)  # last: it scores every method the pair now has
    points = json.loads(table.stdout.strip().splitlines()[-1])["points"]
    assert {"raw", "quant", "spectrum", "ridge", "ridge:budget=0.4", "droidspeak", "scd-reuse", "scd"} <= set(points)
    shown = scd("pair", "show", "tiny-lora", env=env).stdout
    assert shown.count("pinned to these weights") == 5, shown
    res = tmp_path / "eval.json"
    scd("eval", "--pair", "tiny-lora", "--data", str(f / "prompts.jsonl"), "--n", "4", "--json", str(res),
        "--methods", "oracle,raw,quant,spectrum,ridge,ridge:k_bits=8;v_bits=8,scd-reuse,scd,droidspeak,auto", env=env)
    body = json.loads(res.read_text())
    assert set(body["methods"]) == {"oracle", "raw", "quant", "spectrum", "ridge", "ridge:k_bits=8;v_bits=8",
                                    "scd-reuse", "scd", "droidspeak", "auto"}
    # a variant label runs the method with its settings, beside the same method's defaults
    assert body["methods"]["ridge:k_bits=8;v_bits=8"]["bytes_per_token"] != body["methods"]["ridge"]["bytes_per_token"]
    assert body["methods"]["oracle"]["kl"] == 0.0 and body["methods"]["raw"]["kl"] > 0
    assert sum(body["auto_choices"].values()) == body["methods"]["auto"]["n"]
    # what each KL was measured with, for `scd bench`: the pair's weights, each method's identity
    from shared.model.loading import folder_fingerprint

    pfp, cfp = folder_fingerprint(f / "base"), folder_fingerprint(f / "base", f / "adapter")
    assert body["models"] == {"producer": pfp, "consumer": cfp}, body["models"]
    ids = {m: r.get("identity") for m, r in body["methods"].items()}
    assert ids.pop("auto") is None and all(v.startswith(pfp + ":") for v in ids.values())
    assert len(set(ids.values())) == 9  # every method and variant its own
    assert set(body["auto_choices"]) <= set(points)
    assert body["answers"] and all(body["methods"][m]["agree_f1"] is not None for m in ("raw", "scd"))
    # --no-answers: the same teacher-forced measures, no greedy answers decoded
    quick = tmp_path / "quick.json"
    scd("eval", "--pair", "tiny-lora", "--data", str(f / "prompts.jsonl"), "--n", "4", "--json", str(quick),
        "--methods", "oracle,raw,scd", "--no-answers", env=env)
    qb = json.loads(quick.read_text())
    assert qb["answers"] is False
    for m in ("raw", "scd"):
        assert qb["methods"][m]["agree_f1"] is None and qb["methods"][m]["task_f1"] is None
        for key in ("kl", "top1", "ppl", "bytes_per_token"):
            assert qb["methods"][m][key] == pytest.approx(body["methods"][m][key], rel=1e-6, abs=1e-9), (m, key)
    text = serve_and_generate("tiny-lora", "river city song. Which word came first?", env, tmp_path,
                              methods=("scd", "auto", "scd:block_tokens=0.5"))
    assert "[scd] TTFT" in text and "tokens at" in text and "auto chose " in text
    # the variant label travels as the method and its settings: the sparse block sends the block layers' codes too
    wire = [int(b.replace(",", "")) for b in re.findall(r"\[scd\] TTFT \d+ ms \| ([\d,]+) bytes", text)]
    assert len(wire) == 2 and wire[1] > wire[0], text
    # the demo (what `make demo` runs) on this pair and its data: each answer streamed, then cold and warm
    # TTFT side by side, both services stopped cleanly
    demo = scd("demo", "--pair", "tiny-lora", "--data", str(f / "prompts.jsonl"), "--methods", "oracle,scd",
               "--max-new-tokens", "4", env=env).stdout
    assert "--- oracle ---" in demo and "--- scd ---" in demo and "cold TTFT  warm TTFT" in demo, demo
    assert re.search(r"^scd +\d+ ms +\d+ ms +[\d,]+ +\d+ ms", demo, re.M), demo
    assert "both services stopped (exit codes [0, 0])" in demo, demo


def test_data_file_errors_are_clear(tiny_folders, tmp_path):
    env = user_env(tmp_path)
    scd("pair", "add", "t", "--producer", str(tiny_folders / "base"), "--consumer-adapter",
        str(tiny_folders / "adapter"), env=env)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    r = subprocess.run([str(VENV_BIN / "scd"), "eval", "--pair", "t", "--data", str(bad), "--methods", "oracle,raw"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and f"{bad}:2" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([str(VENV_BIN / "scd"), "eval", "--pair", "t", "--data", str(tmp_path / "none.jsonl")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stderr[-2000:]


def test_demo_and_soak_say_when_the_services_refuse_their_requests(tiny_folders, tmp_path):
    """A request the demo's or the soak's own services refuse (more tokens than the consumer allows, a
    prompt over the producer's limit) ends the command with the services' message, exit 1 and both
    services stopped: the demo ended in a gRPC traceback; the soak sent minutes of refused requests and
    passed."""
    env = user_env(tmp_path)
    f = tiny_folders
    scd("pair", "add", "t", "--producer", str(f / "base"), "--consumer-adapter", str(f / "adapter"), env=env)
    before = set(subprocess.run(["pgrep", "-f", "tools.cli serve"], capture_output=True, text=True).stdout.split())
    runs = {
        "demo tokens": (["demo", "--pair", "t", "--data", str(f / "prompts.jsonl"), "--methods", "raw",
                         "--max-new-tokens", "100000"], env, "this consumer allows at most"),
        "demo prompt": (["demo", "--pair", "t", "--data", str(f / "prompts.jsonl"), "--methods", "oracle,raw"],
                        dict(env, PRODUCER__MAX_PROMPT_TOKENS="8"), "max_prompt_tokens"),
        "soak tokens": (["soak", "--pair", "t", "--minutes", "0.5", "--max-new-tokens", "100000"], env,
                        "this consumer allows at most"),
    }
    for what, (args, run_env, says) in runs.items():
        r = subprocess.run([str(VENV_BIN / "scd"), *args], env=run_env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 1, (what, r.returncode, r.stdout[-2000:], r.stderr[-3000:])
        assert "error: " in r.stderr and says in r.stderr and "Traceback" not in r.stderr, (what, r.stderr[-3000:])
        assert "INVALID_ARGUMENT" in r.stderr, (what, r.stderr[-3000:])
    left = set(subprocess.run(["pgrep", "-f", "tools.cli serve"], capture_output=True, text=True).stdout.split())
    assert not left - before, "a service was left running"
    # a method the pair has no calibration for is named before the services start (the demo answered
    # with the others, then stopped on it)
    r = subprocess.run([str(VENV_BIN / "scd"), "demo", "--pair", "t", "--data", str(f / "prompts.jsonl")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--methods: scd need(s) the pair's calibration" in r.stderr, r.stderr[-3000:]
    assert "--- oracle ---" not in r.stdout


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_a_held_out_file_is_scored_whole_with_its_rows(tiny_folders, tmp_path):
    """``scd eval --data FILE`` scored only the ~20% of rows its hash puts in the test split; ``--split
    all`` scores every row of a file calibration never read, and ``--rows-json`` gives each row's scores
    beside its id and its other fields (metadata to group by), with KL per prompt length in the JSON."""
    env = user_env(tmp_path)
    scd("pair", "add", "t", "--producer", str(tiny_folders / "base"), "--consumer-adapter",
        str(tiny_folders / "adapter"), env=env)
    rows = [json.loads(x) for x in (tiny_folders / "prompts.jsonl").read_text().splitlines()][:9]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({**r, "id": f"r{i}", "src": ["news", "docs", "verse"][i % 3]}) + "\n"
                            for i, r in enumerate(rows)))
    out, per_row = tmp_path / "all.json", tmp_path / "rows.jsonl"
    r = scd("eval", "--pair", "t", "--data", str(held), "--split", "all", "--methods", "oracle,raw", "--no-answers",
            "--json", str(out), "--rows-json", str(per_row), env=env)
    assert "fields ['src'] are not prompt" in r.stderr and "scoring 9 prompts of the all split" in r.stderr, r.stderr
    body = json.loads(out.read_text())
    assert body["n"] == 9 and body["split"] == "all" and body["methods"]["raw"]["n"] == 9
    lines = [json.loads(x) for x in per_row.read_text().splitlines()]
    assert [x["id"] for x in lines] == [f"r{i}" for i in range(9)]
    assert [x["meta"]["src"] for x in lines] == ["news", "docs", "verse"] * 3
    raw = [x["methods"]["raw"]["kl"] for x in lines]
    assert sum(raw) / 9 == pytest.approx(body["methods"]["raw"]["kl"]) and all(k > 0 for k in raw)
    assert list(body["methods"]["raw"]["kl_by_length"]) == ["<=512"]
    test_only = scd("eval", "--pair", "t", "--data", str(held), "--methods", "oracle,raw", "--no-answers", env=env)
    assert "of the test split" in test_only.stderr and "scoring 9 prompts" not in test_only.stderr
