"""`scd serve --pair` / `--consumer NAME=...`: what a registered pair gives a service (its model, name,
tokenizer, store, weights fingerprint) are defaults that a file, the environment or --set override,
and the flags beat; weights changed since registration are refused."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.unit.test_registry import said
from tools.assets import registry
from tools.cli import app


@pytest.fixture()
def served(monkeypatch):
    """The settings `scd serve` would serve with (the models are not loaded)."""
    from tools.cli import serve

    got = []
    monkeypatch.setattr(serve, "_serve", lambda load, build, s: got.append(s))
    return got


def test_a_pairs_consumer_settings_are_defaults_that_set_and_the_environment_override(home, folders, served,
                                                                                      monkeypatch, tmp_path):
    """--set name=..., model.path=..., artifact_store=... beside --pair were dropped without a word:
    the pair's values were passed as flags, which beat --set."""
    registry.add("mine", folders["producer"], adapter=folders["adapter"])
    run = lambda *a: CliRunner().invoke(app, ["serve", "consumer", "--pair", "mine", *a])  # noqa: E731
    res = run()
    assert res.exit_code == 0, res.output
    s = served.pop()
    e = registry.get("mine")
    assert (s.name, s.model.path, s.model.adapter, s.tokenizer) == ("mine", folders["producer"], folders["adapter"],
                                                                    e.tokenizer)
    # the pair's producer weights are the ones it accepts (a producer serving other weights was answered)
    assert s.producer_fingerprint == e.producer_fingerprint and s.producer_fingerprint
    res = run("--set", "model.dtype=bfloat16")  # refines the pair's model (was "model.path: Field required")
    assert res.exit_code == 0, res.output
    s = served.pop()
    assert (s.model.path, s.model.adapter, s.model.dtype) == (folders["producer"], folders["adapter"], "bfloat16")
    monkeypatch.setenv("CONSUMER__MODEL__DTYPE", "bfloat16")
    assert run().exit_code == 0 and served.pop().model.adapter == folders["adapter"]
    monkeypatch.delenv("CONSUMER__MODEL__DTYPE")
    res = run("--set", "name=other", "--set", f"model.path={folders['consumer']}",
              "--set", f"artifact_store={tmp_path}")
    assert res.exit_code == 0, res.output
    s = served.pop()
    # the pair's adapter (and tokenizer) go with its own model: another model does not keep them
    assert (s.name, s.model.path, s.model.adapter, s.tokenizer, s.artifact_store) == (
        "other", folders["consumer"], None, None, str(tmp_path))
    monkeypatch.setenv("CONSUMER__NAME", "from-env")
    assert run().exit_code == 0 and served.pop().name == "from-env"
    res = run("--name", "flag", "--set", "name=other")  # a flag beats --set
    assert res.exit_code == 0 and served.pop().name == "flag", res.output
    res = run("--set", "name=bad name")  # now checked, not replaced by the pair's name
    assert res.exit_code != 0 and "bad name" in said(res), res.output


def test_a_registered_consumers_tokenizer_and_artifacts_are_defaults_for_the_producer(home, folders, served):
    registry.add("mine", folders["producer"], folders["consumer"])
    run = lambda *a: CliRunner().invoke(app, ["serve", "producer", "--consumer", "mine=127.0.0.1:5", *a])  # noqa: E731
    res = run()
    assert res.exit_code == 0, res.output
    s = served.pop()
    assert s.consumers["mine"].address == "127.0.0.1:5" and s.consumers["mine"].tokenizer == folders["consumer"]
    assert (s.model.path, s.model.fingerprint) == (folders["producer"], registry.get("mine").producer_fingerprint)
    res = run("--set", f"consumers.mine.tokenizer={folders['producer']}")
    assert res.exit_code == 0, res.output
    assert served.pop().consumers["mine"].tokenizer == folders["producer"]  # was the pair's
    res = run("--set", "model.dtype=bfloat16")  # refines the pairs' producer model (was served without it)
    assert res.exit_code == 0, res.output
    s = served.pop()
    assert (s.model.path, s.model.dtype) == (folders["producer"], "bfloat16")
    res = run("--set", f"model.path={folders['consumer']}")
    assert res.exit_code == 0 and served.pop().model.path == folders["consumer"], res.output
    # consumers of two producers: the hint says why no model is chosen (was a bare "model: Field required")
    registry.add("other", folders["consumer"], folders["producer"])
    res = run("--consumer", "other=127.0.0.1:6")
    assert res.exit_code != 0 and "the registered consumers have different producers" in said(res) and \
        "give --model" in said(res), res.output


def test_a_consumer_folder_without_a_tokenizer_is_served_with_its_pairs(home, folders, tmp_path):
    """`scd pair add` takes the producer's tokenizer for such a folder, and eval used it; the consumer
    service read the model folder only, so it had no chat-template prefix nor stop tokens."""
    import shutil

    from consumer_service.server import load_engine
    from consumer_service.settings import ConsumerSettings
    from shared.model.loading import has_tokenizer

    bare = tmp_path / "ft-no-tokenizer"
    shutil.copytree(folders["consumer"], bare)
    for f in bare.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            f.unlink()
    assert not has_tokenizer(bare)
    e = registry.add("bare", folders["producer"], bare)
    assert e.tokenizer == folders["producer"]
    raw = ["methods=[raw]"]
    no_tok = load_engine(ConsumerSettings.load(overrides=[f"model.path={bare}", *raw]))
    with_tok = load_engine(ConsumerSettings.load(overrides=[f"model.path={bare}", f"tokenizer={e.tokenizer}", *raw]))
    try:
        assert no_tok.tokenizer is None and with_tok.tokenizer is not None
    finally:
        no_tok.close()
        with_tok.close()


def test_a_service_refuses_a_pairs_weights_changed_since_registration(home, folders, served, tmp_path):
    """`scd drift` and `eval` refused them; `scd serve --pair` served the changed weights."""
    import shutil

    from consumer_service.server import load_engine
    from shared.errors import ConfigError

    ft = tmp_path / "ft"
    shutil.copytree(folders["consumer"], ft)
    registry.add("mine", folders["producer"], ft)
    shutil.copy(Path(folders["producer"]) / "model.safetensors", ft / "model.safetensors")  # same shapes, new weights
    res = CliRunner().invoke(app, ["serve", "consumer", "--pair", "mine", "--set", "methods=[raw]"])
    assert res.exit_code == 0, res.output
    s = served.pop()
    assert s.model.fingerprint == registry.get("mine").consumer_fingerprint
    with pytest.raises(ConfigError, match=r"the weights in .*ft changed since the pair was registered"):
        load_engine(s)
    res = CliRunner().invoke(app, ["serve", "consumer", "--pair", "mine", "--set", f"model.path={ft}",
                                   "--set", "methods=[raw]"])
    assert res.exit_code == 0 and served.pop().model.fingerprint is None, res.output  # another model: no pin
