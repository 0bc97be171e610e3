"""The pair registry: operator folders are registered, shown and removed; every bad registration is
refused with one error that names the problem, before any weight is read (and nothing is unpickled)."""

import json
import warnings

import pytest
import torch
from typer.testing import CliRunner

from shared.errors import SCDError
from shared.model.tiny import save_pretrained, tiny_config, tiny_tokenizer
from tools.assets import registry
from tools.cli import app


def said(res) -> str:
    """A CLI run's output as one line: rich's error box borders and line wraps removed."""
    return " ".join(res.output.replace("│", " ").split())


def test_add_list_show_remove(home, folders):
    e = registry.add("mine", folders["producer"], folders["consumer"])
    assert (e.model_type, e.n_layers, e.n_kv_heads, e.head_dim) == ("llama", 2, 2, 16)
    assert e.producer_fingerprint != e.consumer_fingerprint and len(e.producer_fingerprint) == 16
    assert e.store == str(home / "home" / "store")
    a = registry.add("mine-lora", folders["producer"], adapter=folders["adapter"])
    assert a.consumer is None and a.consumer_adapter == folders["adapter"]
    assert a.consumer_fingerprint not in (a.producer_fingerprint, e.consumer_fingerprint)
    assert registry.names() == ["mine", "mine-lora"]
    body = json.loads((home / "home" / "pairs.json").read_text())
    assert body["format_version"] == 1 and set(body["pairs"]) == {"mine", "mine-lora"}
    again = registry.add("mine", folders["producer"], folders["consumer"])  # same folders: a no-op
    assert again.producer_fingerprint == e.producer_fingerprint and again.registered_at == e.registered_at
    assert registry.stored(e) == {}
    registry.remove("mine")
    assert registry.names() == ["mine-lora"]
    with pytest.raises(SCDError, match="unknown pair 'mine'"):
        registry.get("mine")


def test_adapter_consumer_loads_merged_with_the_registered_fingerprint(home, folders):
    from shared.model.loading import load_model

    a = registry.add("lora", folders["producer"], adapter=folders["adapter"])
    folder, adapter = a.consumer_model()
    with warnings.catch_warnings(record=True) as said:  # peft's FutureWarning at every load is not the user's
        warnings.simplefilter("always")
        model = load_model(folder, adapter=adapter)
    assert not [w for w in said if issubclass(w.category, FutureWarning)], [str(w.message) for w in said]
    assert model.scd_fingerprint == a.consumer_fingerprint
    base = load_model(folders["producer"])
    ids = torch.arange(10).unsqueeze(0)
    assert not torch.allclose(model(input_ids=ids).logits, base(input_ids=ids).logits)
    assert "lora" not in " ".join(n for n, _ in model.named_parameters())  # merged, not wrapped


def test_fingerprint_does_not_depend_on_load_dtype(folders):
    from shared.model.loading import load_model

    f32 = load_model(folders["producer"])
    bf16 = load_model(folders["producer"], dtype=torch.bfloat16)
    assert f32.scd_fingerprint == bf16.scd_fingerprint


@pytest.mark.parametrize("case,kwargs,match", [
    ("family", dict(producer="producer", consumer="qwen"),
     "architecture family differs: producer 'llama', consumer 'qwen2'"),
    ("layers", dict(producer="producer", consumer="deeper"), "layer count differs: producer 2, consumer 3"),
    ("vocab", dict(producer="producer", consumer="other_vocab"), "tokenizer vocabularies differ"),
    ("unsupported", dict(producer="gpt2", consumer="consumer"),
     "model_type 'gpt2' is not supported .*supported families"),
    ("pickle", dict(producer="pickled", consumer="consumer"), "only pickled weights .*never unpickled"),
    ("missing", dict(producer="producer", consumer="/nonexistent/folder"),
     "consumer folder /nonexistent/folder does not exist"),
    ("adapter base", dict(producer="producer", adapter="wide_adapter"), "does not fit"),
    ("adapter missing", dict(producer="producer", adapter="consumer"), "has no adapter_config.json"),
    ("both", dict(producer="producer", consumer="consumer", adapter="adapter"), "exactly one of"),
])
def test_bad_registrations_are_refused_with_one_clear_error(home, folders, case, kwargs, match):
    args = {k: folders.get(v, v) for k, v in kwargs.items()}
    with pytest.raises(SCDError, match=match):
        registry.add("bad", args["producer"], args.get("consumer"), args.get("adapter"))
    assert registry.names() == []
    assert not folders["marker"].exists()


def test_pickle_only_adapter_is_refused(home, folders, tmp_path):
    bad = tmp_path / "adapter_bin"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(open(f"{folders['adapter']}/adapter_config.json").read())
    (bad / "adapter_model.bin").write_bytes(b"not read")
    with pytest.raises(SCDError, match="pickled adapter_model.bin"):
        registry.add("bad", folders["producer"], adapter=bad)


def _damaged(folders, root, kind, damage):
    """A copy of the producer folder (``kind`` "model") or of the adapter folder, with ``damage``
    applied to it."""
    import shutil

    src = folders["producer" if kind == "model" else "adapter"]
    dst = root / f"{kind}-{damage}"
    shutil.copytree(src, dst)
    weights = dst / ("model.safetensors" if kind == "model" else "adapter_model.safetensors")
    config = dst / ("config.json" if kind == "model" else "adapter_config.json")
    if damage == "garbage weights":
        weights.write_bytes(b"\x00" * 64)
    elif damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "config not json":
        config.write_text("{ not json")
    elif damage == "config a list":
        config.write_text("[]")
    elif damage == "head not saved":  # an untied model saved without its output projection
        from safetensors.torch import load_file, save_file

        save_file({k: v for k, v in load_file(str(weights)).items() if not k.startswith("lm_head.")}, str(weights),
                  metadata={"format": "pt"})
    else:
        cfg = json.loads(config.read_text())
        edit = {"config invalid": {"hidden_size": 30},  # not a multiple of the head count
                "config a string width": {"hidden_size": "wide"},
                "more layers than saved": {"num_hidden_layers": 3},
                "fewer layers than saved": {"num_hidden_layers": 1},
                "other widths than saved": {"intermediate_size": 48},
                "not lora": {"peft_type": "IA3"}, "no peft type": {"peft_type": None}}[damage]
        cfg.update(edit)
        config.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dst


@pytest.mark.parametrize("kind,damage,match", [
    ("model", "garbage weights", "model.safetensors is not a readable safetensors file"),
    ("model", "truncated weights", "model.safetensors is not a readable safetensors file"),
    ("model", "config not json", "config.json is not valid JSON"),
    ("model", "config a list", "config.json must hold a JSON object"),
    ("model", "config invalid", "config.json is not a valid llama config .*hidden size"),
    ("model", "config a string width", "config.json is not a valid llama config .*hidden_size"),
    ("model", "more layers than saved", "weight.* its config.json calls for are not in its safetensors .*layers.2"),
    ("model", "fewer layers than saved", "not part of the model its config.json describes .*layers.1"),
    ("model", "other widths than saved", "do not have the shape its config.json gives .*mlp"),
    ("model", "head not saved", "are not in its safetensors files .*lm_head.weight"),
    ("adapter", "garbage weights", "adapter_model.safetensors is not a readable safetensors file"),
    ("adapter", "config not json", "adapter_config.json is not valid JSON"),
    ("adapter", "not lora", "peft_type 'IA3'.*LoRA"),
    ("adapter", "no peft type", "no peft_type.*LoRA"),
])
def test_damaged_folders_are_refused_at_registration_and_at_load(home, folders, tmp_path, kind, damage, match):
    """A folder whose files do not parse, or whose config and weights disagree, is refused with what
    is wrong and in which file, when it is registered (as either side) and when it is loaded (damage
    done after registration): never a traceback, never a model with weights initialised at random."""
    from shared.model.loading import load_model

    bad = _damaged(folders, tmp_path, kind, damage)
    sides = ([dict(producer=bad, consumer=folders["consumer"]), dict(producer=folders["producer"], consumer=bad)]
             if kind == "model" else [dict(producer=folders["producer"], adapter=bad)])
    for side in sides:
        with pytest.raises(SCDError, match=match):
            registry.add("bad", side["producer"], side.get("consumer"), side.get("adapter"))
    assert registry.names() == []
    with pytest.raises(SCDError, match=match):
        load_model(bad, adapter=None) if kind == "model" else load_model(folders["producer"], adapter=bad)


def test_an_adapter_without_lora_tensors_is_refused(home, folders, tmp_path):
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / "empty_adapter"
    shutil.copytree(folders["adapter"], bad)
    save_file({"something.weight": torch.zeros(2)}, str(bad / "adapter_model.safetensors"))
    with pytest.raises(SCDError, match="holds no LoRA tensors"):
        registry.add("bad", folders["producer"], adapter=bad)


def test_a_consumer_whose_weights_differ_in_shape_is_refused(home, folders, tmp_path):
    """Configs that agree on the layout fields, over weights that do not (a narrower MLP)."""
    narrow = tiny_config("llama", n_layers=2)
    narrow.intermediate_size = 40
    from transformers import AutoModelForCausalLM

    other = save_pretrained(AutoModelForCausalLM.from_config(narrow), tmp_path / "narrow", tiny_tokenizer())
    with pytest.raises(SCDError, match="consumer tensor .*mlp.* has shape"):
        registry.add("bad", folders["producer"], other)


def test_names_and_duplicates(home, folders):
    with pytest.raises(SCDError, match="pair name 'Bad Name'"):
        registry.add("Bad Name", folders["producer"], folders["consumer"])
    registry.add("one", folders["producer"], folders["consumer"])
    with pytest.raises(SCDError, match="already registered .*--replace"):
        registry.add("one", folders["producer"], adapter=folders["adapter"])
    assert registry.add("one", folders["producer"], adapter=folders["adapter"], replace=True).consumer is None


def test_cli_pair_commands(home, folders):
    r = CliRunner()
    res = r.invoke(app, ["pair", "add", "cli", "--producer", folders["producer"], "--consumer", folders["consumer"]])
    assert res.exit_code == 0, res.output
    assert "registered pair 'cli'" in res.output and "scd calibrate --pair cli" in res.output
    assert "no drift to correct" not in res.output
    res = r.invoke(app, ["pair", "add", "twin", "--producer", folders["producer"], "--consumer", folders["producer"]])
    assert res.exit_code == 0 and "note: the consumer's weights are the producer's" in res.output, res.output
    res = r.invoke(app, ["pair", "list"])
    assert res.exit_code == 0 and "cli" in res.output and "llama" in res.output
    res = r.invoke(app, ["pair", "show", "cli"])
    assert res.exit_code == 0 and "producer_fingerprint" in res.output and "none in" in res.output
    res = r.invoke(app, ["pair", "add", "x", "--producer", folders["producer"], "--consumer", folders["qwen"]])
    assert res.exit_code == 2 and "architecture family differs" in res.output
    res = r.invoke(app, ["pair", "remove", "nope"])
    assert res.exit_code == 2 and "unknown pair 'nope'" in res.output
    res = r.invoke(app, ["calibrate", "--pair", "nope"])
    assert res.exit_code == 2 and "scd pair add" in res.output


def test_pair_show_and_list_name_an_unreadable_artifact_instead_of_failing(home, folders):
    e = registry.add("shown", folders["producer"], folders["consumer"])
    store_dir = e.store_dir()
    (store_dir / "shown").mkdir(parents=True)
    (store_dir / "shown" / "meta.json").write_text("{ cut short")
    (store_dir / "shown.ridge.json").write_text("[1, 2]")
    (store_dir / "shown.spectrum.json").write_text(json.dumps({"producer_fingerprint": e.producer_fingerprint,
                                                               "consumer_fingerprint": e.consumer_fingerprint}))
    r = CliRunner()
    res = r.invoke(app, ["pair", "show", "shown"])
    assert res.exit_code == 0, res.output
    lines = {ln.split()[0]: ln for ln in res.output.splitlines() if ln.startswith("  ")}
    assert "UNREADABLE" in lines["scd"] and "UNREADABLE" in lines["ridge"] and "pinned" in lines["spectrum"]
    res = r.invoke(app, ["pair", "list"])
    assert res.exit_code == 0 and "shown" in res.output


def test_builtin_pairs_use_the_running_checkouts_store(home, folders, monkeypatch):
    """A registry shared by two clones must not send one clone to the other's committed store."""
    from shared.paths import STORE_DIR

    monkeypatch.delenv("SCD_STORE", raising=False)
    e = registry.add("builtin-like", folders["producer"], folders["consumer"], builtin=True)
    assert e.store is None and e.store_dir() == STORE_DIR
    body = json.loads((home / "home" / "pairs.json").read_text())
    assert body["pairs"]["builtin-like"]["store"] is None


def test_devices_are_checked_before_any_weight_is_read(home, folders):
    from shared.errors import ConfigError
    from shared.model.loading import check_device, load_model

    assert check_device("cpu") == torch.device("cpu")
    for bad, match in (("gpu", "is not a device; use cpu, cuda or cuda:N"), ("cuda:x", "is not a device"),
                       ("mps", "only cpu and cuda")):
        with pytest.raises(ConfigError, match=match):
            check_device(bad)
    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA device"):
            check_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ConfigError, match="use device cpu"):
            check_device("cuda")
    with pytest.raises(ConfigError, match="'gpu' is not a device"):
        load_model(folders["producer"], "gpu")
    r = CliRunner()
    assert r.invoke(app, ["pair", "add", "dev", "--producer", folders["producer"], "--consumer",
                          folders["consumer"]]).exit_code == 0
    res = r.invoke(app, ["eval", "--pair", "dev", "--device", "gpu", "--n", "1", "--methods", "oracle,raw"])
    assert res.exit_code == 2 and "'gpu' is not a device" in res.output and "--device" in res.output, res.output
    # every command that loads models reads --device and --dtype when it starts, not after minutes of work
    for cmd in (["bench", "--quick"], ["calibrate", "--pair", "dev"], ["eval", "--pair", "dev"]):
        for flag, bad, match in (("--device", "tpu", "use cpu, cuda or cuda:N"),
                                 ("--device", "cuda:", "use cpu, cuda or cuda:N"),
                                 ("--dtype", "float64", "expected one of float32")):
            res = r.invoke(app, [*cmd, flag, bad])
            said = " ".join(res.output.replace("│", " ").split())  # typer's error box wraps lines
            assert res.exit_code == 2 and match in said and f"'{flag}': '{bad}'" in said, (cmd, flag, said)


@pytest.mark.parametrize("args, match", [
    (["--methods", ""], "--methods needs at least one name"),
    (["--methods", " , "], "--methods needs at least one name"),
    (["--methods", "oracle,raw", "--param", "nodot"], "--param takes METHOD.KEY=VALUE"),
    (["--methods", "oracle,raw", "--param", "raw.bits"], "--param takes METHOD.KEY=VALUE"),
    (["--methods", "oracle,raw", "--param", ".bits=8"], "--param takes METHOD.KEY=VALUE"),
    (["--methods", "oracle,raw", "--param", "quant.bits=8"], "method 'quant' is not in --methods"),
    # settings no request would take: refused before the pair's models load (here: no pair at all)
    (["--methods", "oracle,scd:block_tokens=7"], "scd:block_tokens=7: invalid settings for method 'scd': block_tokens"),
    (["--methods", "oracle,quant", "--param", "quant.bits=99"], "quant: invalid settings for method 'quant': bits"),
    (["--methods", "auto:time_tolerance=2"], "auto:time_tolerance=2: invalid settings for method 'auto'"),
    # a setting given twice with (possibly) two values: the last (or the label) won without a word
    (["--methods", "quant", "--param", "quant.bits=4", "--param", "quant.bits=8"],
     "--param quant.bits is given twice"),
    (["--methods", "quant:bits=4", "--param", "quant.bits=8"],
     "--param quant.bits=8 contradicts --methods quant:bits=4"),
    (["--methods", "scd:block_tokens=0.3;block_tokens=0.2"], "sets block_tokens twice"),
    # built-in data beside your own: --kind was ignored (and recorded as the data's kind)
    (["--methods", "raw", "--kind", "lm", "--data", __file__], "--kind picks built-in test data; with --data"),
    (["--methods", "raw", "--kind", "nope"], "--kind must be one of qa, lm, heldout"),
])
def test_eval_refuses_empty_or_malformed_method_options(home, args, match):
    res = CliRunner().invoke(app, ["eval", "--pair", "nope", *args])
    assert res.exit_code == 2 and match in said(res), res.output


@pytest.mark.parametrize("item, match", [("=1", "--set '=1' must look like key=value"),
                                         (" =1", "must look like key=value"),
                                         ("n_val=[", "--set n_val takes a whole number >= 1")])
def test_calibrate_refuses_a_set_without_key_or_with_a_broken_value(home, item, match):
    """``--set =1`` said "--set '': not a known setting"; ``--set n_val=[`` was a YAML traceback."""
    res = CliRunner().invoke(app, ["calibrate", "--pair", "nope", "--method", "droidspeak", "--set", item])
    assert res.exit_code == 2 and match in said(res), res.output


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "true"])
def test_calibrate_refuses_a_count_that_is_not_a_whole_number(home, value):
    res = CliRunner().invoke(app, ["calibrate", "--pair", "nope", "--method", "droidspeak", "--set", f"n_val={value}"])
    assert res.exit_code == 2 and "--set n_val takes a whole number >= 1" in said(res), res.output


@pytest.mark.parametrize("args, match", [
    (["--param", "nodot"], "--param takes KEY=VALUE"),
    (["--param", "=1"], "--param takes KEY=VALUE"),
    (["--method", "scd:block_tokens"], "settings are KEY=VALUE"),
    (["--method", "scd:block_tokens=0.35", "--param", "block_tokens=0.2"],
     "contradicts --method scd:block_tokens=0.35"),
    (["--param", "block_tokens=0.3", "--param", "block_tokens=0.4"], "--param block_tokens is given twice"),
    (["--method", "scd:block_tokens=0.3;block_tokens=0.4"], "sets block_tokens twice"),
    (["--max-new-tokens", "0"], "greater than or equal to 1"),
    (["--seed", "-5"], "greater than or equal to 0"),
    (["--timeout", "0"], "greater than or equal to 0.001"),
    (["--top-p", "0"], "--top-p must be above 0"),
    (["--top-p", "1.5"], "less than or equal to 1"),
    (["--temperature", "-1"], "greater than or equal to 0"),
    (["--timeout", "inf"], "takes a finite number"),  # a deadline already passed: DEADLINE_EXCEEDED at once
    (["--temperature", "inf"], "takes a finite number"),
    (["--temperature", "nan"], "takes a finite number, got nan"),  # said "greater than or equal to 0"
    (["--top-p", "nan"], "takes a finite number, got nan"),
    (["--timeout", "nan"], "takes a finite number, got nan"),
    (["--pair", "strong,"], "each once"),
    (["--pair", ",strong"], "each once"),
    (["--pair", "a, a"], "each once"),
    (["--pair", " "], "each once"),
    (["--timeout", "1e10"], "less than or equal to 1e+06"),  # overflowed the deadline: DEADLINE_EXCEEDED at once
    (["--token", "a b"], "printable ASCII without spaces"),  # was gRPC's INTERNAL: Invalid metadata
    (["--token", "jeton-é"], "printable ASCII without spaces"),
])
def test_generate_refuses_bad_options_before_it_connects(args, match):
    res = CliRunner().invoke(app, ["generate", "--producer", "127.0.0.1:1", "hi", *args])
    assert res.exit_code == 2 and match in said(res), res.output


@pytest.mark.parametrize("producer", ["127.0.0.1:99999", "127.0.0.1:0", "producer-host", "", ":50051", "a b:1"])
def test_generate_refuses_a_producer_address_grpc_would_misread(producer):
    """gRPC would dial port 99999 as 34463 and a bare host on 443: refused before it connects."""
    res = CliRunner().invoke(app, ["generate", "--producer", producer, "hi"])
    assert res.exit_code == 2 and "must be HOST:PORT (port 1-65535)" in said(res), res.output


@pytest.mark.parametrize("args, match", [
    (["consumer", "--adapter", "/some/adapter"], "--adapter is merged into --model"),
    (["consumer", "--model", "/m", "--name", ""], "name: String should have at least 1 character"),
    (["consumer", "--model", "/m", "--name", "a,b"], "consumer name(s) 'a,b' must be 1-63 characters"),
    # the TLS files before the model (/m does not exist: its error would come first otherwise)
    (["consumer", "--model", "/m", "--set", f"security.tls_cert={__file__}", "--set", f"security.tls_key={__file__}"],
     "security.tls_cert: " + __file__ + " holds no PEM certificate"),
    # /m does not exist: the ports are checked first (it was found after the model loaded, with a traceback)
    (["producer", "--model", "/m", "--port", "58377", "--set", "http.port=58377"],
     "server.port and http.port are both 58377"),
])
def test_serve_refuses_options_it_would_drop_or_misroute_before_loading(home, args, match):
    """An adapter given beside a pair was dropped silently, and a consumer name no request can
    address was taken."""
    res = CliRunner().invoke(app, ["serve", *args])
    assert res.exit_code != 0 and match in said(res), res.output


@pytest.mark.parametrize("args, env", [
    (["serve", "consumer", "--model", "/m", "--store", "{file}"], False),
    (["serve", "consumer", "--model", "/m"], True),
    (["serve", "producer", "--model", "/m", "--consumer", "x=127.0.0.1:5"], True),
    (["serve", "producer", "--model", "/m", "--consumer", "x=127.0.0.1:5", "--store", "{file}"], False),
    (["pair", "show", "mine", "--store", "{file}"], False),  # "none in FILE"
    (["pair", "add", "other", "--producer", "{producer}", "--consumer", "{consumer}", "--store", "{file}"], False),
    (["pair", "add", "other", "--producer", "{producer}", "--consumer", "{consumer}"], True),  # registered it
])
def test_an_artifact_store_that_is_a_file_is_refused(home, folders, monkeypatch, tmp_path, args, env):
    """SCD_STORE or --store naming a file: the consumer served without SCD ("note: no SCD artifacts ...
    in FILE") and the producer without a word."""
    file = tmp_path / "store.txt"
    file.write_text("not a folder")
    registry.add("mine", folders["producer"], folders["consumer"])
    if env:
        monkeypatch.setenv("SCD_STORE", str(file))
    res = CliRunner().invoke(app, [a.format(file=file, **folders) for a in args])
    assert res.exit_code == 2 and f"the artifact store {file} is a file; it names a folder" in said(res), res.output


def test_an_unwritable_home_is_named_with_what_to_set(home, folders, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SCD_PAIRS", str(blocker / "pairs.json"))
    with pytest.raises(SCDError, match="cannot write the pair registry .*set SCD_HOME"):
        registry.add("mine", folders["producer"], folders["consumer"])
    monkeypatch.setenv("SCD_HOME", str(blocker))
    res = CliRunner().invoke(app, ["assets"])
    assert res.exit_code == 2 and "set SCD_HOME to a writable folder" in said(res), res.output


@pytest.mark.parametrize("content, match", [
    (None, "is a folder; SCD_PAIRS names the registry's file"),  # was an IsADirectoryError traceback
    ("{bad", "cannot be read (Invalid JSON: key must be a string at line 1 column 2)"),  # was "(1 validation
    ('{"format_version": 1, "pairs": {"x": {"producer": 3}}}', "(pairs.x.name: Field required; "),  # error for
    (b"\xff\xfe", "cannot be read: 'utf-8' codec can't decode"),  # Registry)", which said nothing of where
])
def test_a_registry_file_that_cannot_be_used_says_why(home, monkeypatch, tmp_path, content, match):
    path = tmp_path / "pairs.json"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    monkeypatch.setenv("SCD_PAIRS", str(path))
    res = CliRunner().invoke(app, ["pair", "list"])
    assert res.exit_code == 2 and match in said(res), res.output


@pytest.mark.parametrize("command", [["eval", "--pair", "nope", "--json"], ["bench", "--quick", "--json"],
                                     ["bench", "--quick", "--png"], ["drift", "--pair", "nope", "--json"],
                                     ["calibrate", "--pair", "nope", "--out"]])
def test_outputs_are_checked_before_the_work_that_fills_them(home, tmp_path, command):
    """An evaluation or benchmark can run for an hour: an output it cannot write is refused first, naming
    the file in the way (it said the OS's "File exists")."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    res = CliRunner().invoke(app, [*command, str(blocker / "out")])
    assert res.exit_code == 2 and f"cannot be written: {blocker} is a file, not a folder" in said(res), res.output
    if command[-1] == "--out":
        res = CliRunner().invoke(app, [*command, str(blocker)])
        assert res.exit_code == 2 and f"{blocker} is a file; give a folder" in said(res), res.output
    else:
        res = CliRunner().invoke(app, [*command, str(tmp_path)])
        assert res.exit_code == 2 and "is a folder; give a file name" in said(res), res.output


@pytest.mark.parametrize("setting, said_", [("bogus=1", "--set bogus: not a known setting (the settings: "),
                                            ("n_vall=8", "--set n_vall: not a known setting; did you mean 'n_val'?"),
                                            ("r_kv=-1", "--set r_kv: Input should be greater than or equal to 1"),
                                            ("tolerance=abc", "--set tolerance: Input should be a valid number"),
                                            ("r_kv=true", "--set r_kv: Input should be a valid integer"),  # not 1
                                            ("bytes_target=yes", "--set bytes_target: Input should be a valid number")])
def test_calibration_settings_are_refused_one_line_each_before_any_model_loads(home, setting, said_):
    res = CliRunner().invoke(app, ["calibrate", "--pair", "nope", "--set", setting])
    assert res.exit_code == 2 and "invalid calibration settings:" in res.output and said_ in res.output, res.output
    assert "errors.pydantic.dev" not in res.output


def test_generate_reads_a_token_as_the_services_read_their_token_file():
    from tools.cli.common import bearer_token

    assert bearer_token("s3cret\n") == "s3cret" and bearer_token(None) is None  # a secret file's newline

