"""The built-in pairs' names (strong, mild, code, verse) are theirs. `scd pair add strong ...` of a
user's own folders was accepted, and the next `scd assets` (which `make demo` and `make test` run)
replaced that registration with the built-in pair without a word: the user's pair was gone."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from shared.model.tiny import perturbed, save_pretrained, tiny_model, tiny_tokenizer
from tools.assets import registry
from tools.cli import app


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    base, tok = tiny_model("llama", n_layers=2), tiny_tokenizer()
    return {"producer": save_pretrained(base, root / "base", tok),
            "consumer": save_pretrained(perturbed(base, 0.2), root / "ft", tok),
            "builtin": save_pretrained(perturbed(base, 0.1), root / "builtin-ft", tok)}


def test_a_built_in_name_is_refused_for_a_users_pair(home, folders):
    with pytest.raises(registry.RegistryError, match="'strong' is a built-in pair's .*choose another name"):
        registry.add("strong", folders["producer"], folders["consumer"])
    res = CliRunner().invoke(app, ["pair", "add", "verse", "--producer", folders["producer"], "--consumer",
                                   folders["consumer"], "--replace"])
    assert res.exit_code != 0 and "choose another name" in res.output, res.output
    assert registry.names() == []
    registry.add("strong-2", folders["producer"], folders["consumer"])  # a name beside it is the user's


def test_scd_assets_leaves_a_users_pair_of_a_built_in_name_and_says_so(home, folders, monkeypatch):
    """A registry written before the names were reserved: `scd assets` registers the other built-in
    pairs, keeps the user's entry as it was, and ends with a message that says how to untangle them."""
    from tools import data
    from tools.assets import models

    # the registration step is what is under test: the built-in folders stand in as already made
    monkeypatch.setattr(models, "convert_producer", lambda: folders["producer"])
    monkeypatch.setattr(models, "build_consumer", lambda p: folders["builtin"])
    monkeypatch.setattr(models, "producer_dir", lambda: folders["producer"])
    monkeypatch.setattr(models, "consumer_dir", lambda p: folders["builtin"])
    monkeypatch.setattr(data, "is_ready", lambda: True)
    registry.add("mine", folders["producer"], folders["consumer"])  # renamed below: what the registry held before
    body = json.loads(registry.registry_path().read_text())
    body["pairs"]["mild"] = dict(body["pairs"].pop("mine"), name="mild")
    registry.registry_path().write_text(json.dumps(body))
    before = registry.get("mild")

    res = CliRunner().invoke(app, ["assets"])
    assert res.exit_code != 0, res.output
    assert "pair 'mild'" in res.output and "scd pair remove mild" in res.output, res.output
    assert registry.get("mild") == before and not before.builtin
    assert all(registry.get(p).builtin for p in models.PAIRS if p != "mild")


def test_scd_assets_pair_prepares_only_the_consumers_named(home, folders, monkeypatch):
    """A node serving one consumer needs two models, not five (~0.5 GB each): `--pair` names them;
    an unknown name is a usage error naming the built-in pairs, before anything is built."""
    from tools import data
    from tools.assets import models

    built: list[str] = []
    monkeypatch.setattr(models, "convert_producer", lambda: folders["producer"])
    monkeypatch.setattr(models, "build_consumer", lambda p: built.append(p) or folders["builtin"])
    monkeypatch.setattr(models, "producer_dir", lambda: folders["producer"])
    monkeypatch.setattr(models, "consumer_dir", lambda p: folders["builtin"])
    monkeypatch.setattr(data, "is_ready", lambda: True)

    res = CliRunner().invoke(app, ["assets", "--pair", "code,strong", "--pair", "code"])
    assert res.exit_code == 0, res.output
    assert built == ["strong", "code"] and registry.names() == ["code", "strong"]
    with pytest.raises(registry.NotFound, match=r"unknown pair 'mild' .*run `scd assets --pair mild`"):
        registry.get("mild")  # a built-in pair left out: how to add it alone

    for bad in (["--pair", "strong,strnog"], ["--pair", ","]):
        res = CliRunner().invoke(app, ["assets", *bad])
        assert res.exit_code == 2 and "strong, mild, code, verse" in res.output, res.output
        assert "--pair" in res.output
    assert built == ["strong", "code"]
