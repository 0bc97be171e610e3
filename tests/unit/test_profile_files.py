"""A pair's profiles in the store are only ``<store>/<pair>.<kind>.json`` of a known kind: a pair
whose name is another's dotted prefix (``a`` and ``a.b``) is not shown the other's."""

import json

from typer.testing import CliRunner

from shared.model.tiny import perturbed, save_pretrained, tiny_model, tiny_tokenizer
from tools.assets import registry
from tools.cli import app


def test_profile_kinds_are_the_engines():
    from shared.engine import PROFILE_KINDS

    assert set(registry.PROFILE_KINDS) == set(PROFILE_KINDS)


def test_profile_files_match_only_the_pairs_own(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    for f in ("a.b.spectrum.json", "a.b.auto.json", "a.ridge.json", "a.ridge.safetensors", "ab.spectrum.json"):
        (store / f).write_text("{}")
    assert registry.profile_files(store, "a") == {"ridge": store / "a.ridge.json"}
    assert registry.profile_files(store, "a.b") == {"auto": store / "a.b.auto.json",
                                                      "spectrum": store / "a.b.spectrum.json"}
    assert registry.profile_files(tmp_path / "none", "a") == {}


def test_pair_show_lists_only_its_own_profiles(home, tmp_path):
    base = tiny_model("llama", n_layers=2)
    tok = tiny_tokenizer()
    prod = save_pretrained(base, tmp_path / "base", tok)
    cons = save_pretrained(perturbed(base, 0.2), tmp_path / "ft", tok)
    a = registry.add("a", prod, cons)
    registry.add("a.b", prod, cons)
    store = a.store_dir()
    store.mkdir(parents=True, exist_ok=True)
    (store / "a.b.spectrum.json").write_text(json.dumps({"producer_fingerprint": a.producer_fingerprint,
                                                         "consumer_fingerprint": a.consumer_fingerprint}))
    assert registry.stored(a) == {}
    assert set(registry.stored(registry.get("a.b"))) == {"spectrum"}
    res = CliRunner().invoke(app, ["pair", "show", "a"])
    assert res.exit_code == 0, res.output
    assert "a.b.spectrum.json" not in res.output and "none in" in res.output
