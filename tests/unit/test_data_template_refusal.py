"""A line of the operator's prompts that the pair's chat template refuses (Gemma's "System role not
supported", Mistral's "Conversation roles must alternate") is a data file error naming FILE:LINE,
and the check of the whole file (``user.counts`` with the pair's format) finds it whatever its split."""

import json

import pytest

from shared.model.prompt import PromptFormat
from shared.model.tiny import CHAT_TEMPLATE, tiny_tokenizer
from tools.data import user

REFUSING = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
            + CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def fmt():
    tok = tiny_tokenizer()
    tok.chat_template = REFUSING
    return PromptFormat(tok)


def _line(split: str) -> str:
    """A system-role record that falls into ``split``."""
    for k in range(1000):
        obj = {"prompt": [{"role": "system", "content": f"Be terse {k}."}, {"role": "user", "content": "Hi?"}]}
        if user.split_of(obj) == split:
            return json.dumps(obj)
    raise AssertionError(split)


def test_a_refused_line_names_its_file_and_line(tmp_path, fmt):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "What is 2+2?"}\n' + _line("test") + "\n")
    with pytest.raises(user.DataFileError, match=r"p\.jsonl:2: the chat template refuses these messages: System "
                                                 "role not supported"):
        user.load(f, fmt, "test")


def test_the_whole_file_check_finds_a_refused_line_in_any_split(tmp_path, fmt):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(['{"prompt": "What is 2+2?"}', '{"prompt": "Name a colour."}', _line("calibration")]) + "\n")
    assert sum(user.counts(f).values()) == 3  # without the format: the lines parse
    with pytest.raises(user.DataFileError, match=r"p\.jsonl:3: the chat template refuses these messages"):
        user.counts(f, fmt=fmt)
    with pytest.raises(user.DataFileError, match=r"p\.jsonl:1: the prompt has \d+ tokens; the limit is 4"):
        user.counts(f, fmt=fmt, max_tokens=4)
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "What is 2+2?"}\n{"prompt": [{"role": "user", "content": "Hi?"}]}\n')
    assert sum(user.counts(ok, fmt=fmt).values()) == 2


def test_the_cli_finds_a_refused_line_before_the_models_load(home, tmp_path, monkeypatch):
    """`scd drift`/`eval`/`calibrate --data` said the template's refusal without file or line, and after
    the models had loaded."""
    from typer.testing import CliRunner

    from shared.model.tiny import save_pretrained, tiny_model
    from tools.assets import registry
    from tools.cli import app

    tok = tiny_tokenizer()
    tok.chat_template = REFUSING
    base = tiny_model("llama", n_layers=2)
    producer = save_pretrained(base, tmp_path / "base", tok)
    registry.add("strict", producer, producer)
    for module in ("evaluate", "calibrate"):  # each command's own reference
        monkeypatch.setattr(f"tools.cli.{module}.pair_models", lambda *a, **k: pytest.fail("the models were loaded"))
    plain = {}  # a plain prompt in every split: only the template can refuse the file
    for k in range(1000):
        obj = {"prompt": f"What is {k} + 1?"}
        plain.setdefault(user.split_of(obj), json.dumps(obj))
    f = tmp_path / "p.jsonl"
    f.write_text(plain["calibration"] + "\n" + _line("calibration") + "\n" + plain["validation"] + "\n" +
                 plain["test"] + "\n")
    for args in (["drift"], ["eval"], ["anatomy"], ["calibrate"]):
        res = CliRunner().invoke(app, [*args, "--pair", "strict", "--data", str(f)])
        said = " ".join(res.output.replace("│", " ").split())
        assert res.exit_code != 0 and "p.jsonl:2: the chat template refuses these messages" in said, (args, said)
