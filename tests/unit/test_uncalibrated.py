"""A pair registered but not (or not fully) calibrated: `scd eval` and `scd demo` name the methods
whose calibration its store lacks before any model loads or service starts (eval failed after both
models had loaded, one method at a time; the demo answered with the others, then stopped), and a
baseline given the setting its profile would choose runs without the profile."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from shared.model.tiny import perturbed, save_pretrained, tiny_model, tiny_tokenizer
from tools.cli import app


def said(res) -> str:
    return " ".join(res.output.replace("│", " ").split())


@pytest.fixture()
def fresh(home, tmp_path):
    base, tok = tiny_model("llama", n_layers=2), tiny_tokenizer()
    p, c = save_pretrained(base, tmp_path / "base", tok), save_pretrained(perturbed(base, 0.2), tmp_path / "ft", tok)
    res = CliRunner().invoke(app, ["pair", "add", "fresh", "--producer", str(p), "--consumer", str(c), "--store",
                                   str(tmp_path / "store")])
    assert res.exit_code == 0, res.output
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"river city song #{i}. Which word came first?"}) + "\n"
                               for i in range(40)))
    return prompts


@pytest.mark.parametrize("methods, missing", [
    ("oracle,raw,scd", "scd"), ("oracle,scd-reuse,ridge", "scd-reuse, ridge"), ("oracle,auto", "auto"),
    ("droidspeak:blocks=0-1,droidspeak", "droidspeak"),  # one label gives the blocks, the other needs the profile
])
def test_eval_names_the_methods_the_store_lacks_before_the_models_load(fresh, monkeypatch, methods, missing):
    from tools.cli import evaluate

    monkeypatch.setattr(evaluate, "pair_models", lambda *a, **k: pytest.fail("the models loaded"))
    res = CliRunner().invoke(app, ["eval", "--pair", "fresh", "--data", str(fresh), "--methods", methods])
    assert res.exit_code == 2, res.output
    assert f"--methods: {missing} need(s) the pair's calibration" in said(res), res.output
    assert "scd calibrate --pair fresh" in said(res)


def test_a_baseline_given_the_setting_its_profile_would_choose_runs_without_the_profile(fresh, tmp_path):
    out = tmp_path / "eval.json"
    res = CliRunner().invoke(app, ["eval", "--pair", "fresh", "--data", str(fresh), "--n", "2", "--no-answers",
                                   "--methods", "oracle,droidspeak:blocks=0-1", "--json", str(out)])
    assert res.exit_code == 0, res.output  # it said "no droidspeak profile" (only --param's setting counted)
    assert set(json.loads(out.read_text())["methods"]) == {"oracle", "droidspeak:blocks=0-1"}


def test_demo_names_the_methods_the_store_lacks_before_the_services_start(fresh, monkeypatch):
    from tools import demo

    monkeypatch.setattr(demo, "run", lambda *a, **k: pytest.fail("the services started"))
    res = CliRunner().invoke(app, ["demo", "--pair", "fresh", "--data", str(fresh)])
    assert res.exit_code == 2 and "--methods: scd need(s) the pair's calibration" in said(res), res.output
