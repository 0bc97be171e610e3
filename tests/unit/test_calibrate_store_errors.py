"""``scd calibrate --method refine|fallback|guard|auto`` read the pair's artifacts (and auto its
profiles): missing, stale (other weights) or corrupt ones are a one-line ``error:`` with exit code
2, found before the models load, as ``scd eval`` and ``scd serve`` report them; not a traceback."""

import json

import pytest
import torch
from typer.testing import CliRunner

from shared.model.tiny import save_pretrained, tiny_model, tiny_tokenizer
from tools.assets import registry
from tools.cli import app


def said(res) -> str:
    return " ".join(res.output.replace("│", " ").split())


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_pretrained(tiny_model("llama", n_layers=2), tmp_path_factory.mktemp("models") / "m", tiny_tokenizer())


@pytest.fixture()
def pair(home, folder, tmp_path):
    """Pair 'same' (one folder both sides, as the tester registered it), its store and a prompts file."""
    e = registry.add("same", folder, folder)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Question {i}: what is {i} plus {i}?"}) + "\n" for i in range(40)))
    return e, e.store_dir(), data


def _stale(e, store):
    """Well-formed artifacts, calibrated for other weights."""
    from shared.artifacts import store as st
    from shared.artifacts.meta import ArtifactMeta

    meta = ArtifactMeta(pair=e.name, producer_fingerprint="0" * 16, consumer_fingerprint="1" * 16, n_layers=2,
                        n_kv_heads=2, head_dim=16, hidden_size=64, r_k=4, r_v=4, r_h=4, code_bits=8, center=False,
                        patch_layers=[], aligner_hidden=8)
    st.save(store, meta, {"x": torch.zeros(2)}, {"x": torch.zeros(2)})


def _corrupt(e, store):
    (store / e.name).mkdir(parents=True, exist_ok=True)
    (store / e.name / "meta.json").write_text('{"broken')


def _invoke(data, method, *more):
    return CliRunner().invoke(app, ["calibrate", "--pair", "same", "--data", str(data), "--method", method, "-q",
                                    *more])


@pytest.mark.parametrize("method", ["refine", "fallback", "guard"])
@pytest.mark.parametrize("state,match", [(None, "no artifacts at"), (_stale, "were calibrated for producer weights"),
                                         (_corrupt, "is not JSON")])
def test_missing_stale_or_corrupt_artifacts_are_one_line_before_the_models_load(pair, monkeypatch, method, state,
                                                                                match):
    e, store, data = pair
    if state:
        state(e, store)
    monkeypatch.setattr("tools.cli.calibrate.pair_models", lambda *a, **k: pytest.fail("the models loaded"))
    res = _invoke(data, method)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and match in said(res)
    assert [ln for ln in res.output.splitlines() if ln.startswith("error: ")]


def test_autos_profiles_are_checked_before_the_models_load(pair, monkeypatch):
    e, store, data = pair
    store.mkdir(parents=True, exist_ok=True)
    (store / "same.spectrum.json").write_text('{"broken')
    monkeypatch.setattr("tools.cli.calibrate.pair_models", lambda *a, **k: pytest.fail("the models loaded"))
    res = _invoke(data, "auto")
    assert res.exit_code == 2 and "same.spectrum.json is not JSON" in said(res), res.output
    (store / "same.spectrum.json").unlink()
    _stale(e, store)
    res = _invoke(data, "auto")
    assert res.exit_code == 2 and "were calibrated for producer weights" in said(res), res.output


def test_auto_replaces_a_corrupt_old_table(pair):
    """auto's old operating table is what it writes again: an unreadable one does not stop it."""
    e, store, data = pair
    store.mkdir(parents=True, exist_ok=True)
    (store / "same.auto.json").write_text('{"broken')
    res = _invoke(data, "auto", "--set", "candidates=raw", "--set", "n_val=2")
    assert res.exit_code == 0, res.output
    assert json.loads((store / "same.auto.json").read_text())["kind"] == "auto"


def test_a_store_error_after_the_models_load_is_one_line_too(pair, monkeypatch):
    """The check before the models load aside, the method's own reading of the store reports the same way."""
    e, store, data = pair
    monkeypatch.setattr("tools.cli.calibrate._check_store", lambda *a: None)
    res = _invoke(data, "guard")
    assert res.exit_code == 2 and "error: no artifacts at" in said(res), res.output
