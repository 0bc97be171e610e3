"""``scd bench --fleet`` in its smallest form: one tiny producer in front of two tiny consumers over
real network namespaces (no timings asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.artifacts import store
from shared.codecs import CodecContext
from shared.model.fingerprint import weights_fingerprint
from shared.model.hf_adapter import ModelAdapter
from shared.model.loading import load_model
from shared.model.prompt import PromptFormat
from shared.model.tiny import perturbed, save_pretrained, tiny_model, tiny_tokenizer
from tests.integration.test_bench import _left, interrupt_when_shown, needs_netns
from tools.calibration.auto import operating_table
from tools.data import Item


@pytest.fixture(scope="module")
def fleet_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    base, tok = tiny_model("llama", n_layers=4), tiny_tokenizer()
    dirs = {}
    for name, model in (("producer", base), ("a", perturbed(base, 0.2)), ("b", perturbed(base, 0.1))):
        dirs[name] = Path(save_pretrained(model, root / name, tok))
    env = dict(os.environ, SCD_PAIRS=str(root / "pairs.json"), OMP_NUM_THREADS="1")
    g = torch.Generator().manual_seed(5)
    val = [Item(id=f"v{i}", kind="qa" if i % 2 else "lm", prefix_len=0,
                prompt_ids=torch.randint(3, 256, (128,), generator=g).tolist()) for i in range(4)]
    p = ModelAdapter(load_model(dirs["producer"]))  # as the services load it (the fingerprints must match)
    for name in ("a", "b"):
        subprocess.run([sys.executable, "-m", "tools.cli", "pair", "add", name, "--producer", str(dirs["producer"]),
                        "--consumer", str(dirs[name]), "--store", str(root / "store")], env=env, check=True,
                       capture_output=True)
        c = ModelAdapter(load_model(dirs[name]))  # each member's operating table, measured (auto needs it)
        table = operating_table(p, c, PromptFormat(tok), val, CodecContext(p), CodecContext(c),
                                candidates=("raw", "quant", "quant:bits=8"), progress=False)
        store.save_profile(root / "store", name, "auto", table, weights_fingerprint(p.model),
                           weights_fingerprint(c.model))
    return env, root


@needs_netns
def test_fleet_bench_smallest_form(fleet_env, tmp_path):
    env, root = fleet_env
    out = tmp_path / "fleet.json"
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "bench", "--fleet", "--pairs", "a,b", "--methods",
                             "oracle,raw,auto", "--tokens", "100", "--bandwidths", "100", "--repeats", "2",
                             "--clients", "2", "--threads", "1", "--json", str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert not _left(proc.pid), "the benchmark left its namespaces behind"
    line = json.loads(stdout.strip().splitlines()[-1])
    res = json.loads(out.read_text())
    pol = {r["policy"]: r for r in res["policies"]}
    assert set(line["fleet"]) == set(pol) == {"oracle", "raw", "auto"}
    for r in pol.values():
        assert r["requests"] == 4  # 2 prompts x 2 consumers
        assert sorted(x["consumer"] for x in r["runs"]) == ["a", "a", "b", "b"]
        assert r["throughput_rps"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0
    assert pol["raw"]["bytes_per_request"] > 10 * pol["oracle"]["bytes_per_request"] > 0
    tables = {n: {p["label"]: p["kl"] for p in json.loads((root / "store" / f"{n}.auto.json").read_text())["points"]}
              for n in ("a", "b")}
    assert pol["oracle"]["mean_kl"] == 0.0
    assert pol["raw"]["mean_kl"] == pytest.approx(sum(tables[c]["raw"] for c in ("a", "b")) / 2)
    for r in pol["auto"]["runs"]:  # what auto served, named by its table label, with that point's KL
        assert r["served"] in tables[r["consumer"]] and r["kl"] == tables[r["consumer"]][r["served"]]
    assert pol["oracle"]["throughput_vs_oracle"] == 1.0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_netns
def test_fleet_bench_interrupted_reports_the_policies_it_measured(fleet_env, tmp_path):
    """Ctrl-C lost every policy's results; those whose requests were all made are now reported (the
    JSON marked interrupted), the queued requests are dropped, and the command exits 130."""
    env, _ = fleet_env
    out = tmp_path / "fleet.json"
    proc, stdout = interrupt_when_shown(
        [sys.executable, "-m", "tools.cli", "bench", "--fleet", "--pairs", "a,b", "--methods", "oracle,raw", "--tokens",
         "100", "--bandwidths", "1", "--repeats", "40", "--clients", "2", "--threads", "1", "--json", str(out)],
        b"raw]", env=env)
    assert proc.returncode == 130, stdout[-2000:]
    assert not _left(proc.pid)
    res = json.loads(out.read_text())
    assert res["config"]["interrupted"] and [r["policy"] for r in res["policies"]] == ["oracle"]
    assert res["policies"][0]["requests"] == 80


def test_fleet_refuses_pairs_of_different_producers_and_unknown_pairs(fleet_env, monkeypatch):
    from tools.bench import fleet
    from tools.bench.netns import BenchError

    env, root = fleet_env
    monkeypatch.setenv("SCD_PAIRS", env["SCD_PAIRS"])
    with pytest.raises(BenchError, match="not registered"):
        fleet._members(fleet.FleetConfig(pairs=("a", "nope")))
