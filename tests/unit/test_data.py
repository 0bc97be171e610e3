"""The evaluation data: disjoint splits, answers in context, lengths in range, hashes verified."""

import hashlib
import json

import pytest

from shared.paths import data_dir
from tools import data


@pytest.fixture(scope="module")
def splits(real_assets):
    return {s: data.load("qa", s) for s in data.SPLITS}


def test_counts_and_lengths(splits, tokenizer):
    for split, items in splits.items():
        assert len(items) == data.QA_COUNTS[split]
        for it in items:
            assert data.MIN_TOKENS <= len(it.prompt_ids) <= data.MAX_TOKENS
            assert it.answer and it.answer in tokenizer.decode(it.prompt_ids)


def test_splits_are_disjoint_by_passage(splits, tokenizer):
    answers = {s: {it.answer for it in items} for s, items in splits.items()}
    assert not answers["test"] & answers["calibration"]
    assert not answers["test"] & answers["validation"]
    assert not answers["validation"] & answers["calibration"]


def test_every_prompt_starts_with_the_same_template_prefix(splits):
    first = splits["test"][0]
    prefix = first.prompt_ids[: first.prefix_len]
    assert first.prefix_len > 10
    for items in splits.values():
        assert all(it.prompt_ids[: it.prefix_len] == prefix for it in items)


def test_lm_items_have_heldout_continuations(real_assets):
    for it in data.load("lm", "test"):
        assert len(it.continuation_ids) == data.LM_CONTINUATION and it.prefix_len == 0


def test_manifest_hashes_match_and_tampering_is_refused(real_assets, tmp_path):
    manifest = json.loads((data_dir() / "manifest.json").read_text())
    for name, meta in manifest["files"].items():
        assert hashlib.sha256((data_dir() / name).read_bytes()).hexdigest() == meta["sha256"]
    for name in ("manifest.json", "qa_test.jsonl"):
        (tmp_path / name).write_bytes((data_dir() / name).read_bytes())
    with open(tmp_path / "qa_test.jsonl", "a") as f:
        f.write("\n")
    with pytest.raises(ValueError, match="sha256"):
        data.load("qa", "test", root=tmp_path)


def test_operator_prompts_file(tmp_path, tokenizer):
    from shared.model.prompt import PromptFormat
    from tools.data import user

    fmt = PromptFormat(tokenizer)
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "What is 2+2?", "answer": "4"}\nplain text prompt\n')
    items = user.load(f, fmt)
    assert [it.answer for it in items] == ["4", ""]
    assert items[1].prompt_ids == fmt.encode("plain text prompt")[0] and items[1].prefix_len == len(fmt.prefix_ids)
    f.write_text('{"answer": "x"}\n')
    with pytest.raises(ValueError, match="prompt"):
        user.load(f, fmt)
    f.write_text("1999\nnull\ntrue\n3.5e2\n")  # text lines that also parse as JSON scalars stay text
    assert [it.prompt for it in user.load(f, fmt)] == ["1999", "null", "true", "3.5e2"]
    f.write_text('[1, 2]\n')
    with pytest.raises(user.DataFileError, match="p.jsonl:1: expected a JSON object"):
        user.load(f, fmt)


@pytest.mark.parametrize("content,match", [
    (b'{"prompt": "fine"}\n\xff\xfe binary\n', r"p.jsonl:2: not UTF-8 text \(byte 0xff at offset 19\)"),
    (b"", "no prompts found"),
    (b'{"promt": "a", "answer": "b"}\n', "p.jsonl:1: expected a JSON object.*it has 'promt': did you mean"),
    (b'{"prompt": "broken\n', "p.jsonl:1: looks like JSON but does not parse"),
    (b'{"prompt": "  "}\n', "p.jsonl:1: empty prompt"),
    (b'{"prompt": 5}\n', r'p.jsonl:1: "prompt" must be text or a list of chat messages .* not a number'),
    (b'{"prompt": {"role": "user"}}\n', r'p.jsonl:1: "prompt" must be text .* not an object'),
    (b'{"prompt": "a", "answer": ["x"]}\n', 'p.jsonl:1: "answer" must be text, not a list'),
    (b'{"prompt": "a", "id": 1.5}\n', 'p.jsonl:1: "id" must be text or a whole number, not a number'),
    (b'{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}\n', 'p.jsonl:1: give "prompt" or "messages"'),
    (b'{"messages": []}\n', 'p.jsonl:1: "messages" must be a non-empty list'),
    (b'{"messages": [{"role": "assistant", "content": "x"}]}\n', "p.jsonl:1: the chat is only the assistant's"),
    (b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}], "answer": "y"}\n',
     'p.jsonl:1: the chat ends with the assistant'),
    (b'{"messages": [{"role": "user"}]}\n', 'p.jsonl:1: message 0 must be an object with string "role" and "content"'),
])
def test_an_unusable_prompts_file_is_refused_with_its_line(tmp_path, tokenizer, content, match):
    from shared.model.prompt import PromptFormat
    from tools.data import user

    f = tmp_path / "p.jsonl"
    f.write_bytes(content)
    with pytest.raises(user.DataFileError, match=match):
        user.load(f, PromptFormat(tokenizer))


def test_numbered_records_and_null_fields_are_read(tmp_path, tokenizer):
    """A record numbered with an integer id, or with "answer": null, as datasets are often written,
    was refused ('"id" must be a string')."""
    from shared.model.prompt import PromptFormat
    from tools.data import user

    f = tmp_path / "p.jsonl"
    f.write_text('{"id": 7, "prompt": "What is 2+2?", "answer": null, "continuation": null}\n')
    item = user.load(f, PromptFormat(tokenizer))[0]
    assert (item.id, item.answer, item.continuation) == ("7", "", "")


def test_a_chat_fine_tuning_file_is_read_as_prompts_and_answers(tmp_path, tokenizer):
    """A fine-tune's own training data is usually a chat file ({"messages": [...]}, OpenAI's format);
    it was refused ('expected a JSON object with a "prompt"'). The last assistant message is the answer."""
    from shared.model.prompt import PromptFormat
    from tools.data import user

    fmt = PromptFormat(tokenizer)
    chat = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}]
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": chat + [{"role": "assistant", "content": "4", "weight": 1}]}) + "\n"
                 + json.dumps({"messages": chat, "id": 3}) + "\n")
    a, b = user.load(f, fmt)
    assert (a.answer, a.prompt, a.prompt_ids) == ("4", chat, fmt.encode(chat)[0])
    assert (b.answer, b.prompt, b.id) == ("", chat, "3")
    # as the chat API reads them: text parts joined, null content empty, developer is system
    f.write_text(json.dumps({"messages": [
        {"role": "developer", "content": "Be terse."}, {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]}) + "\n")
    (c,) = user.load(f, fmt)
    assert c.answer == "4" and c.prompt == [{"role": "system", "content": "Be terse."},
                                            {"role": "assistant", "content": ""},
                                            {"role": "user", "content": "What is 2+2?"}]
    f.write_text(json.dumps({"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}))
    with pytest.raises(user.DataFileError, match="p.jsonl:1: message 0 content part 0 is a 'image_url' part"):
        user.load(f, fmt)
    # the same record written as prompt + answer falls into the same split
    as_chat = user._from_chat({"messages": chat + [{"role": "assistant", "content": "4"}]}, "x")
    assert as_chat == {"prompt": chat, "answer": "4"}
    assert user.split_of(as_chat) == user.split_of({"prompt": chat, "answer": "4"})


def test_a_prompts_path_that_is_a_folder_or_starts_with_a_bom(tmp_path, tokenizer):
    from shared.model.prompt import PromptFormat
    from tools.data import user

    fmt = PromptFormat(tokenizer)
    with pytest.raises(user.DataFileError, match="is a folder; give a JSONL or text file"):
        user.load(tmp_path, fmt)
    f = tmp_path / "bom.jsonl"
    f.write_bytes('\ufeff{"prompt": "What is 2+2?"}\n'.encode())  # as some editors save UTF-8
    assert user.load(f, fmt)[0].prompt == "What is 2+2?"


def test_heldout_domain_is_windows_of_license_text_never_in_the_splits(tmp_path, tokenizer):
    from shared.model.prompt import PromptFormat

    fmt = PromptFormat(tokenizer)
    words = " ".join(f"clause {i} shall apply to the licensee" for i in range(900))
    (tmp_path / "LICENSE-A").write_text(words)
    (tmp_path / "LICENSE-B").write_text(words.upper())
    got = data.heldout_items(fmt, root=tmp_path)
    again = data.heldout_items(fmt, root=tmp_path)
    assert [it.prompt_ids for it in got] == [it.prompt_ids for it in again] and len(got) >= 4
    ids = {n: fmt._ids(p.read_text()) for n, p in (("LICENSE-A", tmp_path / "LICENSE-A"),
                                                   ("LICENSE-B", tmp_path / "LICENSE-B"))}
    for it in got:
        name, pos = it.id.split("-", 1)[1].rsplit("-", 1)
        n = len(it.prompt_ids)
        assert data.MIN_TOKENS <= n <= 1200 and len(it.continuation_ids) == data.LM_CONTINUATION
        assert ids[name][int(pos): int(pos) + n + data.LM_CONTINUATION] == it.prompt_ids + it.continuation_ids
    assert len(data.heldout_items(fmt, 2, root=tmp_path)) == 2
    with pytest.raises(FileNotFoundError, match="base-files"):
        data.heldout_items(fmt, root=tmp_path / "none")


@pytest.mark.parametrize("command, split", [
    (["demo"], "test"),  # was a DataFileError traceback (a missing file: the same)
    (["eval"], "test"),  # these four failed the same way, but after both models had loaded
    (["drift"], "test"),
    (["anatomy"], "validation"),
    (["calibrate", "--method", "ridge"], "validation"),
])
def test_a_prompts_file_without_the_split_a_command_needs_is_refused_before_anything_loads(tmp_path, command, split):
    from typer.testing import CliRunner

    from tools.cli import app
    from tools.data import user

    path = tmp_path / "few.jsonl"
    path.write_text('{"prompt": "What is 2+2?"}\n')  # the calibration split
    assert user.counts(path)[split] == 0
    res = CliRunner().invoke(app, [*command, "--pair", "no-such-pair", "--data", str(path)])
    said = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and f"no prompts in the {split} split" in said, res.output
    res = CliRunner().invoke(app, [*command, "--pair", "no-such-pair", "--data", str(tmp_path / "none.jsonl")])
    assert res.exit_code == 2 and "does not exist" in res.output, res.output


def test_a_prompts_file_with_few_prompts_in_a_split_a_command_uses_is_said_to_be_small(tmp_path):
    from typer.testing import CliRunner

    from tools.cli import app
    from tools.data import user

    path = tmp_path / "small.jsonl"
    path.write_text('{"prompt": "What is 2+2?", "answer": "4"}\n{"prompt": "Name a color.", "answer": "red"}\n'
                    '{"prompt": "Capital of France?"}\n')
    n = user.counts(path)
    assert (n["calibration"], n["validation"], n["test"]) == (2, 1, 0)
    res = CliRunner().invoke(app, ["calibrate", "--pair", "no-such-pair", "--data", str(path)])
    said = " ".join(res.output.replace("│", " ").split())
    assert "has few prompts: 1 in the validation split (layers, ranks and fallbacks are chosen on them; 16+" in said
    assert "2 in the calibration split (the codes are fitted on them; 32+ recommended)" in said, res.output
    assert "no-such-pair" in said  # and then it goes on, to the pair that does not exist
    enough = {"calibration": 0, "validation": 16, "test": 3}  # an empty split is refused elsewhere, not warned
    assert user.few_prompts(path, enough, ("calibration", "validation")) is None
    assert "3 in the test split" in (user.few_prompts(path, enough, ("test",)) or "")


@pytest.mark.parametrize("builtin", [False, True])
def test_an_own_pair_without_the_built_in_prompts_is_told_of_data(home, capsys, builtin):
    """`scd eval --pair mine` on a machine without `scd assets` said only to run it; an own pair can
    take its own prompts instead."""
    from types import SimpleNamespace

    import typer

    from tools.cli.common import PairModels, items

    pm = PairModels(SimpleNamespace(builtin=builtin, name="mine"), None, None, None, None)
    with pytest.raises(typer.Exit):
        items(pm, "test")
    said = capsys.readouterr().err
    assert "qa_test.jsonl is missing; run `scd assets`" in said, said
    assert ("give pair 'mine' your own with --data FILE" in said) is not builtin, said


def test_repeated_lines_are_called_repeats_when_a_split_is_empty_or_small(tmp_path):
    """40 copies of one prompt: 40 in one split and none in the others, which said only "add prompts"."""
    from tools.data import user

    path = tmp_path / "copies.jsonl"
    path.write_text('{"prompt": "What is 2+2?"}\n' * 40)
    n = user.counts(path)
    empty = next(s for s in ("validation", "test") if n[s] == 0)
    said = str(user.empty_split(path, empty, n))
    assert "39 of its lines repeat an earlier line" in said, said
    path.write_text("".join(f'{{"prompt": "Question {i}?"}}\n' for i in range(40)))
    assert "repeat an earlier line" not in str(user.empty_split(path, "test", user.counts(path)))


def test_other_fields_of_a_row_are_its_metadata(tmp_path, tokenizer, caplog):
    """Real JSONL files carry metadata columns (a source, a category): they were refused ("unknown
    fields"); now each row keeps them as ``meta`` (for ``scd eval --rows-json``), its split is that of
    its prompt alone, and one warning names them."""
    from shared.model.prompt import PromptFormat
    from tools.data import user

    fmt = PromptFormat(tokenizer)
    f = tmp_path / "m.jsonl"
    f.write_text('{"prompt": "What is 2+2?", "src": "news", "n": 3, "tags": ["a"]}\n{"prompt": "Hi", "src": "docs"}\n')
    with caplog.at_level("WARNING", logger="scd.data"):
        a, b = user.load(f, fmt)
    assert a.meta == {"src": "news", "n": 3, "tags": '["a"]'} and b.meta == {"src": "docs"}
    assert [r.getMessage() for r in caplog.records if "metadata" in r.getMessage()][0].count("'src'") == 1
    assert user.split_of({"prompt": "Hi"}) == user.split_of({"prompt": "Hi", "meta": {"src": "docs"}})
