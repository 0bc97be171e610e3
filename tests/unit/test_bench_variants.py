"""Benchmarked method variants: a kind with settings, sent as the request's method parameters."""

import pytest

from tools.bench.netns import BenchError
from tools.bench.runner import variant


def test_a_plain_kind_and_a_kind_with_settings():
    assert variant("scd") == ("scd", {})
    assert variant("scd:block_tokens=0.5") == ("scd", {"block_tokens": "0.5"})
    assert variant("droidspeak:blocks=13-25;x=1") == ("droidspeak", {"blocks": "13-25", "x": "1"})


@pytest.mark.parametrize("bad", ["scd:block_tokens", "scd:=1"])
def test_a_setting_without_key_or_value_is_refused_with_an_example(bad):
    with pytest.raises(BenchError, match="KEY=VALUE"):
        variant(bad)


def test_a_setting_given_twice_in_one_label_is_refused():
    """``scd:block_tokens=0.35;block_tokens=0.2`` ran the second value without a word."""
    with pytest.raises(BenchError, match="sets block_tokens twice; give each setting once"):
        variant("scd:block_tokens=0.35;block_tokens=0.2")


@pytest.mark.parametrize("args, match", [
    (["--tokens", "1.5"], "--tokens takes comma-separated positive whole numbers"),
    (["--tokens", "500,x"], "--tokens takes comma-separated positive whole numbers"),
    (["--tokens", "0"], "--tokens takes comma-separated positive whole numbers"),
    (["--tokens", ""], "--tokens takes comma-separated positive whole numbers"),  # not the default grid
    (["--bandwidths", "fast"], "--bandwidths takes comma-separated positive numbers"),
    (["--bandwidths", ""], "--bandwidths takes comma-separated positive numbers"),
    (["--bandwidths", "nan"], "--bandwidths takes comma-separated positive numbers"),
    (["--bandwidths", "-5"], "--bandwidths takes comma-separated positive numbers"),
    (["--delay-ms", "inf"], "takes a finite number"),  # reached netem
    (["--delay-ms", "nan"], "takes a finite number, got nan"),  # said "greater than or equal to 0"
    (["--delay-ms", "-5"], "greater than or equal to 0"),
    (["--methods", ","], "--methods needs at least one name"),
    (["--methods", ""], "--methods needs at least one name"),
    (["--fleet", "--pairs", " "], "--pairs needs at least one name"),
    (["--fleet", "--pairs", ""], "--pairs needs at least one name"),
    (["--fleet", "--tokens", "1.5"], "--tokens takes comma-separated positive whole numbers"),
    (["--fleet", "--bandwidths", "100,1000"], "--bandwidths takes one value with --fleet"),
    (["--methods", "oracle,scd:block_tokens=7"], "scd:block_tokens=7: invalid settings for method 'scd': "
                                                 "block_tokens: Input should be less than or equal to 1"),
    (["--methods", "raw:bits=8"], "raw:bits=8: invalid settings for method 'raw': bits: not a known setting"),
    (["--fleet", "--methods", "raw,auto:link_mbps=0"], "auto:link_mbps=0: invalid settings for method 'auto': "
                                                       "link_mbps: Input should be greater than or equal to 0.001"),
    (["--fleet", "--methods", "scd:nope=1"], "scd:nope=1: invalid settings for method 'scd': nope: not a known"),
])
def test_bench_options_are_refused_before_anything_starts(args, match):
    from typer.testing import CliRunner

    from tools.cli import app

    res = CliRunner().invoke(app, ["bench", *args])
    assert res.exit_code == 2 and match in " ".join(res.output.replace("│", " ").split()), res.output


@pytest.mark.parametrize("args, match", [
    (["--iters", "0"], "greater than or equal to 1"),  # was an IndexError after the models loaded
    (["--tokens", "0"], "greater than or equal to 1"),  # was the service's refusal as a traceback
    (["--methods", "nope"], "unknown methods ['nope']; expected some of"),  # was a KeyError
    (["--methods", "raw,auto"], "unknown methods ['auto']"),  # auto is no transfer of its own to time
])
def test_bench_overlap_options_are_refused_before_the_models_load(args, match):
    from typer.testing import CliRunner

    from tools.cli import app

    res = CliRunner().invoke(app, ["bench-overlap", "--pair", "nope", *args])
    assert res.exit_code == 2 and match in " ".join(res.output.replace("│", " ").split()), res.output


@pytest.mark.parametrize("args, match", [
    (["--max-new-tokens", "0"], "greater than or equal to 1"),  # was served as the consumer's default
    (["--methods", "raw,nope"], "unknown methods ['nope']; expected some of"),  # was a traceback once the
])                                                                           # producer had refused it
def test_demo_options_are_refused_before_the_services_start(args, match):
    from typer.testing import CliRunner

    from tools.cli import app

    res = CliRunner().invoke(app, ["demo", "--pair", "nope", *args])
    assert res.exit_code == 2 and match in " ".join(res.output.replace("│", " ").split()), res.output


@pytest.mark.parametrize("args, bad", [
    (["--tokens", "5,1000"], "--tokens 5:"),  # shorter than the chat template: refused once the services ran
    (["--tokens", "1000,9000"], "--tokens 9000:"),  # past the model's context (the services' default limit)
    (["--fleet", "--tokens", "9000"], "--tokens 9000:"),
])
def test_a_prompt_length_the_services_would_refuse_is_refused_before_they_start(real_assets, args, bad):
    from typer.testing import CliRunner

    from tools.cli import app

    res = CliRunner().invoke(app, ["bench", "--methods", "raw", *args])
    said = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2 and bad in said and "give lengths from 31 to 8192" in said, res.output


def test_a_model_folder_or_kl_file_named_but_unusable_is_refused_before_the_services_start(real_assets, tmp_path):
    """``--producer-model`` naming a folder with no model ended in a FileNotFoundError traceback; a
    ``--kl-json`` that did not exist or did not parse was ignored without a word (the quality-aware
    target then knew no KL)."""
    from typer.testing import CliRunner

    from tools.cli import app

    (tmp_path / "notes.json").write_text('{"hello": 1}')
    for args, says in ((["--producer-model", str(tmp_path)], f"--producer-model folder {tmp_path} has no config.json"),
                       (["--consumer-model", str(tmp_path / "gone")], "--consumer-model folder"),
                       (["--kl-json", str(tmp_path / "gone.json")], "cannot be read: No such file or directory"),
                       (["--kl-json", str(tmp_path / "notes.json")], "is not an `scd eval --json` file")):
        res = CliRunner().invoke(app, ["bench", "--methods", "raw", "--tokens", "1000", *args])
        said = " ".join(res.output.replace("│", " ").split())
        assert res.exit_code == 2 and says in said, res.output
        assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)


def test_methods_the_pairs_store_cannot_serve_are_named_before_the_services_start(tmp_path):
    """``scd bench`` on a pair without calibration started the services; the consumer stopped after
    loading its model, naming only the store's folder. The methods short of artifacts or a profile
    are named first; the committed store serves every method for the built-in pairs."""
    from tools.assets.registry import default_store, uncalibrated

    kinds = ("oracle", "raw", "quant", "droidspeak", "ridge", "spectrum", "scd-reuse", "scd")
    assert uncalibrated(kinds, tmp_path / "none", "p") == ["droidspeak", "ridge", "spectrum", "scd-reuse", "scd"]
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "meta.json").write_text("{}")
    (tmp_path / "p.droidspeak.json").write_text("{}")
    (tmp_path / "q.ridge.json").write_text("{}")  # another pair's profile
    assert uncalibrated(kinds, tmp_path, "p") == ["ridge", "spectrum"]
    assert uncalibrated(("raw", "auto"), tmp_path, "p") == ["auto"]  # a fleet's policy: the operating table
    (tmp_path / "p.auto.json").write_text("{}")
    assert uncalibrated(("raw", "auto"), tmp_path, "p") == []
    assert uncalibrated(kinds, default_store(builtin=True), "strong") == []


def test_prompts_without_the_built_in_data_are_a_bench_error_not_a_traceback(home):
    """`scd bench` on a machine without `scd assets` ended in a FileNotFoundError traceback."""
    from shared.model.tiny import tiny_tokenizer
    from tools.bench.runner import Prompts

    with pytest.raises(BenchError, match=r"the benchmark's prompts are the built-in QA test passages: .*qa_test.jsonl "
                                         r"is missing; run `scd assets`"):
        Prompts(tiny_tokenizer())
