"""Every deploy file parses; settings files validate; errors say what to fix."""

import re
from pathlib import Path

import pytest
import yaml

from consumer_service.settings import ConsumerSettings
from producer_service.settings import ProducerSettings
from shared.errors import ConfigError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.yaml")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)


def test_settings_files_validate():
    p = ProducerSettings.load(DEPLOY / "producer.yaml")
    c = ConsumerSettings.load(DEPLOY / "consumer.yaml")
    assert p.consumers["strong"].address.endswith(":50052") and c.name == "strong"
    assert c.cache_budget_bytes == 4 << 30  # written 4GiB
    p = ProducerSettings.load(DEPLOY / "byo" / "producer.yaml")  # an operator's own pair, consumer as an adapter
    c = ConsumerSettings.load(DEPLOY / "byo" / "consumer.yaml")
    assert c.model.adapter and p.consumers[c.name].tokenizer


def test_k8s_manifests_have_probes_and_gpus():
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "scd-serve.yaml").read_text()))
    kinds = [d["kind"] for d in docs]
    assert {"Deployment", "Service", "PersistentVolume", "PersistentVolumeClaim", "ConfigMap"} <= set(kinds)
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    ProducerSettings.load(overrides=(), **yaml.safe_load(cm["data"]["producer.yaml"]))
    ConsumerSettings.load(overrides=(), **yaml.safe_load(cm["data"]["consumer.yaml"]))
    for d in docs:
        if d["kind"] == "Deployment":
            c = d["spec"]["template"]["spec"]["containers"][0]
            assert "grpc" in c["readinessProbe"] and "grpc" in c["livenessProbe"]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_compose_wires_the_two_containers():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert {"producer", "consumer-strong"} <= set(compose["services"])
    assert "store" in compose["volumes"]


def test_the_orchestrators_wait_out_the_services_grace():
    """SIGTERM gives requests in flight server.grace_s, then GRACE_MARGIN_S to send their last answer:
    the container runtime must not kill the process before (Docker's default stop timeout is 10 s)."""
    from shared.rpc.server import GRACE_MARGIN_S

    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for name, cls, file in (("producer", ProducerSettings, "producer.yaml"),
                            ("consumer-strong", ConsumerSettings, "consumer.yaml")):
        grace = cls.load(DEPLOY / file).server.grace_s
        assert float(compose["services"][name]["stop_grace_period"].rstrip("s")) > grace + GRACE_MARGIN_S, name
    for manifest in ("scd-serve.yaml", "scd-serve-cpu.yaml"):
        docs = list(yaml.safe_load_all((DEPLOY / "k8s" / manifest).read_text()))
        cm = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
        graces = [yaml.safe_load(cm[f])["server"]["grace_s"] for f in ("producer.yaml", "consumer.yaml")]
        for d in (d for d in docs if d["kind"] == "Deployment"):
            assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > max(graces) + GRACE_MARGIN_S


def test_env_beats_file_and_flags_beat_env(monkeypatch):
    monkeypatch.setenv("CONSUMER__MAX_NEW_TOKENS", "77")
    assert ConsumerSettings.load(DEPLOY / "consumer.yaml").max_new_tokens == 77
    assert ConsumerSettings.load(DEPLOY / "consumer.yaml", ["max_new_tokens=9"]).max_new_tokens == 9


def _refused_with_env(monkeypatch, cls, **variables) -> str:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        cls.load(overrides=["model.path=/x"])
    return str(e.value)


def test_an_environment_variable_naming_no_setting_is_refused(monkeypatch):
    """pydantic-settings ignored CONSUMER__MAX_CONCURENT (a typo): the default was served with no
    word. A bad value from the environment names its variable."""
    said = _refused_with_env(monkeypatch, ConsumerSettings, CONSUMER__MAX_CONCURENT="4", CONSUMER__SERVER__PORT="high")
    assert "CONSUMER__MAX_CONCURENT: not a known setting (an environment variable; did you mean " \
        "CONSUMER__MAX_CONCURRENT?)" in said, said
    assert "server.port: Input should be a valid integer" in said, said
    assert "(from CONSUMER__SERVER__PORT)" in said, said


@pytest.mark.parametrize("value", ['["raw", "scd"]', "[raw, scd]", "[raw,scd]"])
def test_a_list_setting_takes_json_or_yaml_from_the_environment(monkeypatch, value):
    monkeypatch.setenv("PRODUCER__METHODS", value)
    monkeypatch.setenv("PRODUCER__HTTP__CORS_ORIGINS", value.replace("raw", "http://a.example").replace("scd", "http://b:1"))
    s = ProducerSettings.load(overrides=["model.path=/x"])
    assert s.methods == ("raw", "scd") and s.http.cors_origins == ("http://a.example", "http://b:1")


def test_a_mapping_setting_given_other_text_in_the_environment_is_told_its_shape(monkeypatch):
    """pydantic-settings read such a variable as JSON only and raised its own SettingsError (a
    traceback from `scd serve`) on anything else, naming neither the variable nor the form. (A list
    of words takes `a,b` too: tests/unit/test_settings_lists.py.)"""
    said = _refused_with_env(monkeypatch, ProducerSettings, PRODUCER__CONSUMERS="strong=h:1")
    assert "consumers: Input should be a valid dictionary (got 'strong=h:1'); write a mapping, e.g. {name: value} " \
        "(from PRODUCER__CONSUMERS)" in said, said
    monkeypatch.delenv("PRODUCER__CONSUMERS")
    with pytest.raises(ConfigError, match=r"consumers: Input should be a valid dictionary \(got 'strong'\); write a "):
        ProducerSettings.load(overrides=["model.path=/x", "consumers=strong"])  # a flag is told the same


@pytest.mark.parametrize("cls, given, said", [
    (ConsumerSettings, ["frame_timeout=3"], "frame_timeout: not a known setting; did you mean 'frame_timeout_s'?"),
    (ConsumerSettings, ["http.prot=3"], "http.prot: not a known setting; did you mean 'port'?"),
    (ProducerSettings, ["consumers.a.address=h:1", "consumers.a.adress=h:1"],
     "consumers.a.adress: not a known setting; did you mean 'address'?"),  # under a consumer's name
    (ProducerSettings, ["security.tokn=x"], "security.tokn: not a known setting; did you mean 'token'?"),
    (ProducerSettings, ["bench.zzz=1"], "bench.zzz: not a known setting (the settings of bench: hold_layers)"),
    (ConsumerSettings, ["qqq=1"], "qqq: not a known setting (the settings: access_log, artifact_store, bench,"),
])
def test_a_setting_that_does_not_exist_is_told_the_closest_that_does(cls, given, said):
    """A typo in --set, a settings file or a variable said "not a known setting" and no more: the user
    had to look the name up. Now the closest name at that level, or the names there are."""
    with pytest.raises(ConfigError) as e:
        cls.load(overrides=["model.path=/x", *given])
    assert said in str(e.value), str(e.value)


def test_an_environment_variable_with_a_typo_is_told_the_variable_it_could_be(monkeypatch):
    said = _refused_with_env(monkeypatch, ProducerSettings,
                             PRODUCER__SERVR__PORT="1",  # the first part names no setting: the whole variable
                             PRODUCER__HTTP__PROT="1",  # a part below it: the setting, from the variable
                             PRODUCER__QQQ="1")
    assert "PRODUCER__SERVR__PORT: not a known setting (an environment variable; did you mean " \
        "PRODUCER__SERVER__PORT?)" in said, said
    assert "http.prot: not a known setting; did you mean 'port'? (from PRODUCER__HTTP__PROT)" in said, said
    assert "PRODUCER__QQQ: not a known setting (an environment variable; the settings: access_log, bench" in said, said


def test_the_deploy_files_environment_names_known_settings():
    """Every CONSUMER__/PRODUCER__ variable the image and compose set is one the services read."""
    text = (DEPLOY / "compose.yaml").read_text() + (DEPLOY / "Dockerfile").read_text()
    names = set(re.findall(r"\b((?:CONSUMER|PRODUCER)__[A-Z0-9_]+)", text))
    assert len(names) >= 8, names
    for name in names:
        cls = ConsumerSettings if name.startswith("CONSUMER") else ProducerSettings
        assert name.split("__")[1].lower() in cls.model_fields, name


def test_a_partial_sub_setting_keeps_the_sub_models_defaults(monkeypatch, tmp_path):
    # the consumer's server default is port 50052; setting only its host (a container's 0.0.0.0, from
    # the environment, a file or a flag) must not fall back to ServerSettings' own port 0 (a random port)
    monkeypatch.setenv("CONSUMER__SERVER__HOST", "0.0.0.0")
    s = ConsumerSettings.load(overrides=["model.path=/x"])
    assert (s.server.host, s.server.port) == ("0.0.0.0", 50052)
    monkeypatch.delenv("CONSUMER__SERVER__HOST")
    f = tmp_path / "c.yaml"
    f.write_text("model: {path: /x}\nserver: {grace_s: 3}\n")
    s = ConsumerSettings.load(f, ["server.host=10.0.0.1"])
    assert (s.server.host, s.server.port, s.server.grace_s) == ("10.0.0.1", 50052, 3.0)
    assert ProducerSettings.load(overrides=["model.path=/x", "server.host=0.0.0.0"]).server.port == 50051


def test_bad_settings_say_what_to_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"model.dtype"):
        ConsumerSettings.load(overrides=["model.path=/x", "model.dtype=float8"])
    with pytest.raises(ConfigError, match=r"default_method"):
        ProducerSettings.load(overrides=["model.path=/x", "default_method=magic"])
    with pytest.raises(ConfigError, match=r"a.b=value"):
        ProducerSettings.load(overrides=["nonsense"])
    for override in ("=3", "a..b=1", ".x=1", " =1"):
        with pytest.raises(ConfigError, match=r"a.b=value"):
            ProducerSettings.load(overrides=[override])
    bad = tmp_path / "s.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        ConsumerSettings.load(bad)
    bad.write_bytes(b"max_queue: 3\n\xff\xfe\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xff at offset 13\)"):
        ConsumerSettings.load(bad)
    with pytest.raises(ConfigError, match="cannot read settings file"):
        ConsumerSettings.load(tmp_path)


@pytest.mark.parametrize("address", ["consumer-strong:50052", "127.0.0.1:1", "[::1]:50052", "dns:///svc:50052",
                                     "unix:/run/scd.sock", "scd-consumer-strong.default.svc.cluster.local:65535"])
def test_consumer_addresses_that_grpc_can_dial_are_taken(address):
    s = ProducerSettings(model={"path": "/x"}, consumers={"strong": {"address": address}})
    assert s.consumers["strong"].address == address


@pytest.mark.parametrize("consumers, match", [
    ({"strong": {"address": "nohost"}}, "must be HOST:PORT"),
    ({"strong": {"address": "127.0.0.1:0"}}, "must be HOST:PORT"),
    ({"strong": {"address": "127.0.0.1:70000"}}, "must be HOST:PORT"),
    ({"strong": {"address": "127.0.0.1:5,mild=127.0.0.1:6"}}, "must be HOST:PORT"),
    ({"": {"address": "127.0.0.1:5"}}, "consumer name"),
    ({"a,b": {"address": "127.0.0.1:5"}}, "a comma fans out"),
    ({"has space": {"address": "127.0.0.1:5"}}, "consumer name"),
])
def test_bad_consumer_endpoints_are_refused_at_start_up(consumers, match):
    with pytest.raises(ValueError, match=match):
        ProducerSettings(model={"path": "/x"}, consumers=consumers)


def test_computed_defaults_are_the_lowest_priority(monkeypatch, tmp_path):
    """What a store holds (``defaults``) yields to a settings file, the environment and --set; explicit
    flags (``kw``) beat them all."""
    d = {"methods": ["oracle", "scd", "droidspeak"]}
    assert ProducerSettings.load(overrides=["model.path=/x"], defaults=d).methods == ("oracle", "scd", "droidspeak")
    f = tmp_path / "p.yaml"
    f.write_text("model: {path: /x}\nmethods: [oracle, raw]\ndefault_method: raw\n")
    assert ProducerSettings.load(f, defaults=d).methods == ("oracle", "raw")
    assert ProducerSettings.load(overrides=["model.path=/x", "methods=[raw, scd]"], defaults=d).methods == ("raw",
                                                                                                          "scd")
    monkeypatch.setenv("PRODUCER__METHODS", '["quant", "scd"]')
    assert ProducerSettings.load(overrides=["model.path=/x"], defaults=d).methods == ("quant", "scd")
    monkeypatch.delenv("PRODUCER__METHODS")
    assert ProducerSettings.load(overrides=["model.path=/x"], defaults=d, methods=("scd",)).methods == ("scd",)
    assert d == {"methods": ["oracle", "scd", "droidspeak"]}  # not modified


@pytest.mark.parametrize("sets", [[], ["--set", "http.port=0"]])
def test_serve_offers_the_profiled_baselines_whatever_else_is_set(monkeypatch, tmp_path, sets):
    """A baseline whose profile the store holds is served by both sides with or without other
    settings (a --set http.port used to drop it to the settings' default list)."""
    from typer.testing import CliRunner

    from tools.cli import app
    from tools.cli import serve as serve_cli

    (tmp_path / "x.droidspeak.json").write_text("{}")
    seen = []
    monkeypatch.setattr(serve_cli, "_serve", lambda load, build, s: seen.append(s))
    monkeypatch.setenv("SCD_PAIRS", str(tmp_path / "pairs.json"))
    for role, args in (("producer", ["--consumer", "x=127.0.0.1:1", *sets]),
                       ("consumer", ["--name", "x", "--model", str(tmp_path), *sets[:1], *(
                           ["server.grace_s=1"] if sets else [])])):
        r = CliRunner().invoke(app, ["serve", role, "--store", str(tmp_path), *args])
        assert r.exit_code == 0, r.output
    assert "droidspeak" in seen[0].methods and "droidspeak" in seen[1].methods, [s.methods for s in seen]
    assert "scd" not in seen[1].methods  # no SCD artifacts in this store


@pytest.mark.parametrize("value, expected", [
    ("4GiB", 4 << 30), ("512 MiB", 512 << 20), ("1.5GiB", 3 << 29), ("2GB", 2 * 10**9), ("64KB", 64_000),
    (4096, 4096), ("4096", 4096), ("0", 0),
])
def test_sizes_take_units(monkeypatch, value, expected):
    monkeypatch.delenv("CONSUMER__CACHE_BUDGET_BYTES", raising=False)
    c = ConsumerSettings.load(overrides=[f"cache_budget_bytes={value}"], model={"path": "m"})
    assert c.cache_budget_bytes == expected and type(c.cache_budget_bytes) is int
    monkeypatch.setenv("CONSUMER__CACHE_BUDGET_BYTES", str(value))  # the environment takes the same text
    assert ConsumerSettings.load(model={"path": "m"}).cache_budget_bytes == expected


@pytest.mark.parametrize("value, match", [
    ("2g", r"'2g' is ambiguous: write 2GiB \(powers of 1024\) or 2GB"),
    ("512 m", "write 512MiB"),
    ("lots", "'lots' is not a size in bytes; write e.g. 1073741824, 512MiB or 2GiB"),
    ("2Gi", "not a size in bytes"),
    ("-1GiB", "not a size in bytes"),
    ("true", "'true' is not a size in bytes"),
    ("-1", "greater than or equal to 0"),
])
def test_sizes_that_are_not_say_how_to_write_one(value, match):
    with pytest.raises(ConfigError, match=match):
        ConsumerSettings.load(overrides=[f"cache_budget_bytes={value}"], model={"path": "m"})


def test_every_size_setting_takes_units():
    p = ProducerSettings.load(overrides=["prefill_cache_bytes=2GiB", "max_http_body_bytes=64KiB"], model={"path": "m"})
    c = ConsumerSettings.load(overrides=["max_stream_bytes=1GiB"], model={"path": "m"})
    assert (p.prefill_cache_bytes, p.max_http_body_bytes, c.max_stream_bytes) == (2 << 30, 64 << 10, 1 << 30)
    with pytest.raises(ConfigError, match="max_stream_bytes: Input should be greater than or equal to 1048576"):
        ConsumerSettings.load(overrides=["max_stream_bytes=1KiB"], model={"path": "m"})


@pytest.mark.parametrize("cls, value, match", [
    (ProducerSettings, "[raw, bogus]", r"methods: 'bogus' is not a transfer method; registered methods are \['auto',"),
    (ProducerSettings, "[]", "methods: name at least one method"),
    (ConsumerSettings, "[raw, auto]", r"'auto' is not a transfer method \(auto is the producer's choice"),
    (ConsumerSettings, "[raw, scd2, rwa]", "'scd2', 'rwa' are not transfer methods"),
])
def test_a_methods_list_naming_no_method_is_refused_with_the_settings(cls, value, match):
    """With the other settings' problems, at load: not later, when the engine starts after loading its model."""
    with pytest.raises(ConfigError, match=match):
        cls.load(overrides=[f"methods={value}", "default_method=raw"] if cls is ProducerSettings else
                 [f"methods={value}"], model={"path": "m"})


def test_a_yaml_boolean_is_no_number(tmp_path):
    """pydantic reads true as 1: `max_concurrent: yes` would have served one request at a time. Every
    such setting is named at once, nested ones included; booleans still set boolean settings."""
    f = tmp_path / "c.yaml"
    f.write_text("model: {path: m}\nmax_concurrent: yes\nframe_timeout_s: true\nserver: {port: on}\nmax_queue: 3\n"
                 "cache_budget_bytes: true\nbench: {hold_layers: true}\n")
    with pytest.raises(ConfigError) as e:
        ConsumerSettings.load(f)
    said = str(e.value)
    for field in ("max_concurrent: Input should be a valid integer", "frame_timeout_s: Input should be a valid number",
                  "server.port: Input should be a valid integer", "cache_budget_bytes: 'true' is not a size"):
        assert field in said, said
    assert "max_queue" not in said
    with pytest.raises(ConfigError, match="consumers.a.link_mbps: Input should be a valid number"):
        ProducerSettings.load(overrides=["consumers.a.address=h:1", "consumers.a.link_mbps=true"], model={"path": "m"})
    assert ConsumerSettings.load(overrides=["bench.hold_layers=true"], model={"path": "m"}).bench.hold_layers is True


@pytest.mark.parametrize("kind, params, match", [
    ("scd", {"block_tokens": "true"}, "block_tokens: Input should be a valid number"),
    ("quant", {"residual": "yes", "group_size": True}, "group_size: Input should be a valid integer"),
    ("auto", {"time_tolerance": True}, "time_tolerance: Input should be a valid number"),
    ("raw", {"": "x"}, "'': not a known setting"),  # an empty key is shown as one (was ": not a known setting")
    ("scd", {"block_tokens": ""}, r"block_tokens: Input should be a valid number, .* \(got an empty value\)"),
])
def test_a_method_setting_that_takes_a_number_takes_no_boolean(kind, params, match):
    from shared.codecs import check_settings
    from shared.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=match):
        check_settings(kind, params)


def test_no_setting_takes_nan_or_infinity(tmp_path):
    """"nan" passed every number without a bound (and `grace_s: .inf` passed ge=0: a stop that never
    ends), and failed a bounded one with "should be less than or equal to 1". Every settings model
    refuses both as what they are."""
    from integrations.vllm_connector.settings import parse_extra
    from shared.codecs import check_settings
    from shared.errors import InvalidRequest

    f = tmp_path / "c.yaml"
    f.write_text("model: {path: m}\nserver: {grace_s: .inf}\nframe_timeout_s: .nan\n")
    with pytest.raises(ConfigError) as e:
        ConsumerSettings.load(f)
    for field in ("server.grace_s: Input should be a finite number",
                  "frame_timeout_s: Input should be a finite number"):
        assert field in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="consumers.a.link_mbps: Input should be a finite number"):
        ProducerSettings.load(overrides=["consumers.a.address=h:1", "consumers.a.link_mbps=inf"], model={"path": "m"})
    with pytest.raises(ConfigError, match="consumers.a.link_mbps: Input should be greater than or equal to 0.001"):
        ProducerSettings.load(overrides=["consumers.a.address=h:1", "consumers.a.link_mbps=0"], model={"path": "m"})
    for kind, params in (("scd", {"block_tokens": "nan"}), ("auto", {"time_tolerance": "inf"})):
        with pytest.raises(InvalidRequest, match=f"{next(iter(params))}: Input should be a finite number"):
            check_settings(kind, params)
    with pytest.raises(ValueError, match="timeout_s: Input should be a finite number"):
        parse_extra("kv_consumer", {"timeout_s": float("inf")})


@pytest.mark.parametrize("value, said", [("[", "http.port: Input should be a valid integer"),
                                         ("a: b: c", "http.port: Input should be a valid integer"),
                                         ("{x", "http.port: Input should be a valid integer")])
def test_a_set_value_that_is_not_yaml_is_checked_as_text(value, said):
    """`scd serve --set http.port=[` was a YAML parser's traceback; the value is now the text itself,
    which the setting refuses by name (a string setting takes it)."""
    with pytest.raises(ConfigError, match=said.replace("[", r"\[")):
        ConsumerSettings.load(overrides=["model.path=/x", f"http.port={value}"])
    assert ConsumerSettings.load(overrides=["model.path=/x", f"model.adapter={value}"]).model.adapter == value


@pytest.mark.parametrize("origin", ["https://chat.example.com/", "https://chat.example.com/app", "chat.example.com",
                                    "http://", "*.example.com"])
def test_a_cors_origin_not_written_as_a_browser_sends_it_is_refused(origin):
    """A trailing slash or a path never equals a browser's Origin header: the page would be refused
    with nothing in the settings to say why."""
    with pytest.raises(ConfigError, match=r"http.cors_origins.*scheme://host\[:port\] with no path"):
        ProducerSettings.load(overrides=["model.path=/x", f'http.cors_origins=["{origin}"]'])
    s = ProducerSettings.load(overrides=["model.path=/x", 'http.cors_origins=["http://localhost:3000", "*"]'])
    assert s.http.cors_origins == ("http://localhost:3000", "*")


@pytest.mark.parametrize("given, setting, value", [
    ("http.host=::", "http.host", "::"),  # every IPv6 address: YAML reads a mapping
    ("server.host=::", "server.host", "::"),
    ("security.token=12345", "security.token", "12345"),  # YAML reads a number
    ("security.token=no", "security.token", "no"),  # and a boolean
    ("model.dtype=float16", "model.dtype", "float16"),
])
def test_a_text_setting_takes_a_set_value_as_the_text_given(given, setting, value):
    """`--set http.host=::` was refused ("Input should be a valid string"), as was a numeric token."""
    s = ConsumerSettings.load(overrides=["model.path=/x", given])
    got = s
    for part in setting.split("."):
        got = getattr(got, part)
    assert (got.get_secret_value() if hasattr(got, "get_secret_value") else got) == value
    assert ConsumerSettings.load(overrides=["model.path=/x", "security.token=null"]).security.token is None
    assert ConsumerSettings.load(overrides=["model.path=/x", "server.port=7"]).server.port == 7  # numbers stay numbers
    p = ProducerSettings.load(overrides=["model.path=/x", "consumers.a.address=[::1]:50052"])
    assert p.consumers["a"].address == "[::1]:50052"  # was a YAML parse error passed on as text: the same, by luck


def test_a_text_setting_a_file_gives_unquoted_is_told_to_quote_it(tmp_path):
    f = tmp_path / "s.yaml"
    f.write_text("model:\n  path: /x\nsecurity:\n  token: 12345\n")
    with pytest.raises(ConfigError, match=r"security.token: Input should be a valid string; quote it in YAML"):
        ConsumerSettings.load(f)


@pytest.mark.parametrize("header,says", [
    (None, "missing bearer token"),
    ("  ", "missing bearer token"),
    ("Bearer", "names the scheme but no token"),
    ("Basic dXNlcjpw", "not a bearer token (scheme 'Basic')"),
    ("s3cret", "not a bearer token (a value with no scheme)"),
    ("Bearer nope", "wrong bearer token"),
    ("bearer  nope ", "wrong bearer token"),
])
def test_a_refused_authorization_says_what_was_wrong(header, says):
    from shared.rpc.security import token_ok, token_problem

    assert not token_ok(header, "s3cret")
    msg = token_problem(header, "'Authorization: Bearer <token>'")
    assert says in msg, msg
    assert ("configured with" if says == "wrong bearer token" else "send 'Authorization: Bearer <token>'") in msg


@pytest.mark.parametrize("method,sets,says", [
    ("droidspeak", ["rank=3"], "--set rank: not a known setting"),  # it was "profile() got an unexpected keyword"
    ("droidspeak", ["block_len=abc"], "--set block_len: Input should be a valid integer"),
    ("droidspeak", ["budget_layers=0"], "--set budget_layers: Input should be greater than or equal to 1"),
    ("spectrum", ["min_top1=2"], "--set min_top1: Input should be less than or equal to 1"),
    ("spectrum", ["progress=false"], "--set progress: not a known setting"),
    ("ridge", ["top_ks=[]"], "--set top_ks: "),
    ("ridge", ["stop_ids=[1]"], "--set stop_ids: not a known setting"),
    ("auto", ["rank=3"], "unknown auto settings ['rank']"),
    ("refine", ["r_kv=3"], "unknown refine settings ['r_kv']"),
    ("fallback", ["foo=1"], "unknown fallback settings ['foo']"),
])
def test_calibrate_checks_each_methods_settings_before_loading_models(monkeypatch, method, sets, says):
    from typer.testing import CliRunner

    from tools.cli import app
    from tools.cli import calibrate as calibrate_cli

    def no_models(*a, **k):
        raise AssertionError("models loaded before the settings were checked")

    monkeypatch.setattr(calibrate_cli, "pair_models", no_models)
    r = CliRunner().invoke(app, ["calibrate", "--pair", "strong", "--method", method,
                                 *[x for s in sets for x in ("--set", s)]])
    assert r.exit_code != 0 and says in r.output, r.output
    assert "unexpected keyword" not in r.output and "AssertionError" not in repr(r.exception)


def test_calibrate_names_every_setting_the_pairs_model_cannot_take_before_loading_it(monkeypatch):
    """A model smaller than the defaults assume failed on one setting per run, each after loading."""
    from typer.testing import CliRunner

    from tools.cli import app
    from tools.cli import calibrate as calibrate_cli

    monkeypatch.setattr(calibrate_cli, "pair_models", lambda *a, **k: pytest.fail("the models loaded"))
    r = CliRunner().invoke(app, ["calibrate", "--pair", "strong", "--set", "block_layers=30", "--set", "r_kv=400",
                                 "--set", "r_h=600"])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "pair 'strong' (30 layers, K/V width 192, hidden size 576)" in said, r.output
    for line in ("block_layers=30 would recompute all 30 layers", "r_kv=400 is larger than the 384 numbers it codes",
                 "r_h=600 is larger than the 576 numbers it codes; choose r_h <= 576"):
        assert line in said, r.output


def test_a_baselines_checked_settings_reach_it_typed():
    from tools.cli.calibrate import _method_settings

    assert _method_settings("ridge", {"top_ks": [2], "alphas": [0.1]}) == {"top_ks": (2,), "alphas": (0.1,)}
    assert _method_settings("droidspeak", {"block_len": 8}) == {"block_len": 8}  # only what was given
    assert _method_settings("scd", {"r_kv": 3}) == {"r_kv": 3}  # checked by CalibrationSettings instead


@pytest.mark.parametrize("given,scored", [([], 8), (["--set", "n_val=16"], 16), (["--set", "n_val=4"], 4)])
def test_ridge_calibration_scores_the_validation_prompts_asked_for(monkeypatch, tmp_path, given, scored):
    """``--method ridge --set n_val=16`` loaded 16 validation prompts, then dropped the setting: the
    grid was scored on the function's default 8."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    import tools.calibration.ridge as ridge
    from tools.cli import app
    from tools.cli import calibrate as calibrate_cli

    pm = SimpleNamespace(producer=None, consumer=None, fmt=SimpleNamespace(stop_ids=[0]), store=lambda out: tmp_path)
    item = SimpleNamespace(prompt_ids=[1, 2], prefix_len=0, continuation_ids=[], kind="qa")
    monkeypatch.setattr(calibrate_cli, "pair_models", lambda *a: pm)
    monkeypatch.setattr(calibrate_cli, "validation_items", lambda pm, data, n: [item] * n)
    monkeypatch.setattr(calibrate_cli, "calibration_prompts", lambda pm, data: [[1, 2]] * 64)
    seen = {}

    def fit(producer, consumer, cal, val, n_val=8, **kw):
        seen.update(n_val=n_val, loaded=len(val))
        raise ValueError("stop here")

    monkeypatch.setattr(ridge, "calibrate", fit)
    r = CliRunner().invoke(app, ["calibrate", "--pair", "strong", "--method", "ridge", *given])
    assert "stop here" in r.output, r.output
    assert seen["n_val"] == scored and seen["loaded"] >= scored, seen

