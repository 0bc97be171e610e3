"""Operator folders that register but could not serve: a damaged tokenizer or chat template, an adapter
whose ranks disagree, a pair whose folders went after registration. Each is refused, or named with what
to do, on one line."""

import json

import pytest
from typer.testing import CliRunner

from shared.errors import SCDError
from tools.assets import registry
from tools.cli import app


@pytest.mark.parametrize("damage,match", [
    ("tokenizer.json truncated", r"the tokenizer in .* cannot be loaded \(JSONDecodeError"),
    ("chat template broken", r"chat template cannot render a user message \(TemplateSyntaxError"),
])
def test_a_damaged_tokenizer_or_chat_template_is_refused_at_registration(home, folders, tmp_path, damage, match):
    """Both were tracebacks, and a broken template registered fine and then failed every command."""
    import shutil

    dst = tmp_path / damage.replace(" ", "-")
    shutil.copytree(folders["consumer"], dst)
    if damage.startswith("tokenizer.json"):
        (dst / "tokenizer.json").write_text((dst / "tokenizer.json").read_text()[:300])
    else:
        (dst / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content ")
    with pytest.raises(SCDError, match=match):
        registry.add("bad", folders["producer"], dst)
    res = CliRunner().invoke(app, ["pair", "add", "bad", "--producer", folders["producer"], "--consumer", str(dst)])
    assert res.exit_code == 2 and "error: " in res.output and "Traceback" not in res.output, res.output
    assert registry.names() == []


def test_a_pair_whose_folder_went_says_how_to_register_it_again(home, folders, tmp_path):
    import shutil

    from tools.cli.common import pair_trouble

    dst = tmp_path / "ft-moved"
    shutil.copytree(folders["consumer"], dst)
    e = registry.add("moved", folders["producer"], dst)
    shutil.rmtree(dst)
    said_ = pair_trouble(e, "model folder does not exist")
    assert f"{dst} moved or went since `scd pair add`" in said_ and "scd pair add moved --producer DIR" in said_
    assert "--replace" in said_ and "moved or went" not in pair_trouble(registry.add("ok", folders["producer"],
                                                                                         folders["consumer"]), "x")


@pytest.mark.parametrize("edit,match", [
    ({"r": 8}, r"has rank 4 but adapter_config.json says r=8"),
    ({"r": 0}, r"r=0; LoRA's rank is a positive integer"),
    ({"lora_alpha": "big"}, r"lora_alpha='big'; it must be a number"),
])
def test_an_adapter_whose_ranks_disagree_is_refused_at_registration(home, folders, tmp_path, edit, match):
    """peft refused such an adapter only when the consumer loaded, with hundreds of lines of size mismatches."""
    import shutil

    dst = tmp_path / "adapter-edited"
    shutil.copytree(folders["adapter"], dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(SCDError, match=match):
        registry.add("bad", folders["producer"], adapter=dst)


def test_an_adapter_whose_a_and_b_ranks_differ_is_refused(home, folders, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    dst = tmp_path / "adapter-mixed"
    shutil.copytree(folders["adapter"], dst)
    w = load_file(str(dst / "adapter_model.safetensors"))
    k = next(k for k in w if "lora_B" in k)
    w[k] = w[k][:, :2].contiguous()
    save_file(w, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SCDError, match=r"has lora_A of rank 4 and lora_B of rank 2; they must be one rank"):
        registry.add("bad", folders["producer"], adapter=dst)


def test_a_store_under_a_file_is_refused_at_registration(home, folders, tmp_path):
    """It registered, and calibration ran to its end before its save failed with a traceback."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SCDError, match=r"the artifact store .*afile/sub is under .*afile, a file"):
        registry.add("mine", folders["producer"], folders["consumer"], store=tmp_path / "afile" / "sub")
    assert registry.names() == []


def test_an_adapter_for_another_base_is_refused_at_load_in_a_few_lines(folders):
    """peft's error lists every mismatched tensor (180 lines for SmolLM2); the message gives the first."""
    from shared.model.loading import load_model

    with pytest.raises(SCDError, match=r"does not fit the model in .*: .*size mismatch.*\(and \d+ more lines\); it "
                                       r"was trained on another base model") as e:
        load_model(folders["producer"], adapter=folders["wide_adapter"])
    assert str(e.value).count("size mismatch") == 1 and "scd assets" not in str(e.value)
