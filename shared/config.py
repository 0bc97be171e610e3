"""Settings shared by both services: YAML file, then environment, then ``--set a.b=v`` flags."""

from __future__ import annotations

import copy
import re
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from shared.errors import ConfigError, clip

_HOST_PORT = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")
GRPC_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "unix-abstract:")
_CONSUMER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def field_errors(e: ValidationError | list, skip: int = 0, model: type[BaseModel] | None = None) -> list[str]:
    """pydantic's complaints (a ValidationError or its ``errors()``), one ``field.path: message`` each,
    the first ``skip`` parts of each path left out (FastAPI's "body"). Its own report adds types, the
    input and a URL; here a validator's own message loses pydantic's "Value error, " prefix, a field
    the model does not have is "not a known setting", and a complaint about the whole value has no
    field path. Given the ``model`` validated, a setting it does not have also gets the closest one
    it has ("did you mean 'frame_timeout_s'?"), or else the list of those at that level."""
    out = []
    for err in e.errors() if isinstance(e, ValidationError) else e:
        loc = err["loc"][skip:]
        if err["type"] == "extra_forbidden":
            msg = "not a known setting" + (_known_settings(model, loc) if model is not None and loc else "")
        else:
            msg = _plain_message(err["msg"]) + _given(err)
        out.append(f"{'.'.join(str(p) if p != '' else repr(p) for p in loc)}: {msg}" if loc else msg)
    return out


def _known_settings(model: type[BaseModel], loc: tuple) -> str:
    """What a setting at ``loc`` that ``model`` does not have could have been: the closest name at its
    level, or that level's names (empty when the level is not a model's: a mapping's keys)."""
    cls = _model_at(model, loc[:-1])
    if cls is None:
        return ""
    names = list(cls.model_fields)
    close = closest(str(loc[-1]), names)
    where = f" of {'.'.join(str(p) for p in loc[:-1])}" if len(loc) > 1 else ""
    return f"; did you mean {close!r}?" if close else f" (the settings{where}: {', '.join(sorted(names))})"


def _model_at(model: type[BaseModel], parents) -> type[BaseModel] | None:
    """The model whose settings sit under the path ``parents`` (``consumers.a``: a consumer's entry,
    a mapping's key being no setting); None where that level is not a model's (a mapping's keys, a
    plain value, a name the model does not have)."""
    cls: Any = model
    parts = list(parents)
    while parts:
        field = cls.model_fields.get(str(parts.pop(0))) if isinstance(cls, type) and \
            issubclass(cls, BaseModel) else None
        if field is None:
            return None
        cls, keyed = _inner_model(field.annotation)
        if keyed:  # a mapping of models (consumers.NAME.address): its key is not a setting
            if not parts:
                return None
            parts.pop(0)
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def closest(name: str, names: list[str]) -> str | None:
    """The one of ``names`` that ``name`` is most likely a typo of, if any is close."""
    import difflib

    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return close[0] if close else None


def _env_hint(model: type[BaseModel], variable: str, prefix_len: int) -> str:
    """What an environment variable whose first part names no setting could have been: the variable
    with the closest setting in its place, or the settings there are."""
    parts = variable[prefix_len:].split("__")
    close = closest(parts[0].lower(), list(model.model_fields))
    if close is None:
        return f"an environment variable; the settings: {', '.join(sorted(model.model_fields))}"
    return f"an environment variable; did you mean {variable[:prefix_len]}{'__'.join([close.upper(), *parts[1:]])}?"


def _inner_model(annotation) -> tuple[Any, bool]:
    """The model class an annotation holds (itself, in an Optional, or as a mapping's value) and
    whether it is a mapping's value; (None, False) when it holds none."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is dict and len(args) == 2:
        inner, _ = _inner_model(args[1])
        return inner, inner is not None
    for arg in args:
        inner, keyed = _inner_model(arg)
        if inner is not None:
            return inner, keyed
    return None, False


def first_field(e: ValidationError) -> str | None:
    """The field the first complaint is about (``block_tokens``), for an error's ``param``; None
    for a complaint about the whole value."""
    errors = e.errors()
    return ".".join(str(p) for p in errors[0]["loc"]) or None if errors else None


_SECRET = re.compile(r"(^|[._-])(token|secret|password|credentials?|api_?key)$", re.I)


def _given(err: Any) -> str:
    """What was given, for a value of the wrong type (``true`` where a number goes): the message alone
    does not say which of a request's values it was. Not for a validator's own words, which name it."""
    value, kind = err.get("input"), err["type"]
    if not (kind.endswith(("_parsing", "_type")) or kind == "finite_number") or any(
            _SECRET.search(str(p)) for p in err["loc"]):  # a token given as a number is not echoed to a log
        return ""
    if isinstance(value, (bool, int, float)):
        return f" (got {value!r})"
    if isinstance(value, str):
        return f" (got {clip(value, 40)})" if value else " (got an empty value)"
    return ""


def _plain_message(msg: str) -> str:
    """A pydantic error message without the prefix it puts before a validator's own words."""
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def one_of(what: str) -> WrapValidator:
    """For a field typed as a union: one complaint saying what it takes (``what``, e.g. "a string or a
    list of strings"), and what was wrong in the branch that came closest, instead of pydantic's
    complaint from every branch under type names the user never wrote ("stop.str: ...;
    stop.list[str].0: ...")."""

    def wrap(value, handler):
        try:
            return handler(value)
        except ValidationError as e:
            raise PydanticCustomError("one_of", "{message}",
                                      {"message": f"send {what}{_closest(e.errors())}"}) from None

    return WrapValidator(wrap)


def _closest(errors: list) -> str:
    """The complaint of the union branch with the fewest, then the deepest, errors (``" (item 1: ...)"``),
    or "" when that branch refused the value as a whole (its type)."""
    branches: dict[Any, list] = {}
    for err in errors:
        branches.setdefault(err["loc"][0] if err["loc"] else None, []).append(err)
    best = min(branches.values(), key=lambda errs: (len(errs), -max(len(x["loc"]) for x in errs)))
    err = max(best, key=lambda x: len(x["loc"]))
    if len(err["loc"]) <= 1:
        return ""
    where = " ".join(f"item {p}" if isinstance(p, int) else str(p) for p in err["loc"][1:])
    return f" ({where}: {_plain_message(err['msg'])})"


def consumer_list(text: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``: the consumers a request names (several fan it out). ValueError when
    a name is empty (a stray comma) or repeated."""
    names = [n.strip() for n in text.split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise ValueError("name each consumer once, separated by commas")
    return names


def _comma_list(value: Any) -> Any:
    """A list setting given as one text (an environment variable, ``--set key=value``): its
    comma-separated items (``raw,scd``; ``*``); a list, as YAML or JSON writes one, stays as it is."""
    if isinstance(value, str):
        return tuple(item.strip() for item in value.split(",") if item.strip())
    return value


TextList = Annotated[tuple[str, ...], BeforeValidator(_comma_list)]
"""A list of words that may also be written ``a,b`` (``PRODUCER__METHODS=raw,scd`` was refused as "not
a valid tuple": only ``[raw, scd]`` was read)."""


def check_consumer_names(*names: str) -> None:
    """ValueError naming every consumer name a request could not address (the producer's
    ``consumers`` keys and a consumer's own ``name`` follow one rule)."""
    bad = [n for n in names if not _CONSUMER_NAME.match(n)]
    if bad:
        raise ValueError(f"consumer name(s) {', '.join(map(repr, bad))} must be 1-63 characters of letters, digits, "
                         "'.', '_' and '-', starting with a letter or digit (requests name them; a comma fans out)")


def check_method_names(methods, allow: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A settings ``methods`` list whose every name is a registered transfer method (or in ``allow``,
    e.g. the producer's ``auto``), else ValueError naming the ones that are not."""
    from shared.codecs import CODECS

    known = [*CODECS, *allow]
    bad = [m for m in methods if m not in known]
    if bad:
        what = "is not a transfer method" if len(bad) == 1 else "are not transfer methods"
        hint = " (auto is the producer's choice: list the methods it may pick)" if "auto" in bad else ""
        raise ValueError(f"{', '.join(map(repr, bad))} {what}{hint}; registered methods are {sorted(known)}")
    if not methods:
        raise ValueError(f"name at least one method, e.g. [raw, scd]; registered methods are {sorted(known)}")
    return tuple(methods)


def check_grpc_target(address: str, example: str = "consumer-strong:50052") -> str:
    """``address`` if gRPC can dial it as meant: HOST:PORT with a port 1-65535, or a target with its
    scheme (``dns:``, ``unix:``, ...); ValueError saying so otherwise (gRPC itself would take a
    port past 65535 modulo 2**16, and a bare host as port 443)."""
    if address.startswith(GRPC_SCHEMES):
        return address
    m = _HOST_PORT.match(address)
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        raise ValueError(f"address {address!r} must be HOST:PORT (port 1-65535), e.g. {example}")
    return address


_BYTE_SIZE = TypeAdapter(ByteSize)
_UNIT = re.compile(r"^\s*([0-9.]+)\s*([A-Za-z]+)\s*$")


def _byte_size(value: Any) -> Any:
    """``"2GiB"``, ``"512 MB"`` or ``1073741824`` -> bytes (an int); other input is left to the field's own
    int check. Binary units (KiB, MiB, GiB) are powers of 1024, decimal ones (KB, MB, GB) of 1000."""
    if not isinstance(value, str):  # a YAML boolean arrives here as text (booleans_are_not_numbers)
        return value
    unit = _UNIT.match(value)
    if unit and unit.group(2).lower() in ("k", "m", "g", "t", "p", "e"):  # Docker's 2g is GiB, pydantic's GB
        n, u = unit.group(1), unit.group(2).upper()
        raise ValueError(f"{value!r} is ambiguous: write {n}{u}iB (powers of 1024) or {n}{u}B (powers of 1000)")
    try:
        return int(_BYTE_SIZE.validate_python(value.strip()))
    except ValidationError:
        raise ValueError(f"{value!r} is not a size in bytes; write e.g. 1073741824, 512MiB or 2GiB") from None


Bytes = Annotated[int, BeforeValidator(_byte_size)]
"""A size setting: a number of bytes, or one with a unit (``2GiB``, ``512MB``)."""


def _number_only(annotation) -> bool:
    """A field that takes a number and neither a boolean, a string nor anything else (None aside)."""
    args = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    args = tuple(a for a in args if a is not type(None))
    return bool(args) and all(a in (int, float) for a in args)


def booleans_are_not_numbers(cls: type[BaseModel], data: Any) -> Any:
    """For a ``mode="before"`` model validator: pydantic reads ``true`` as 1 for an int or float field,
    so ``max_concurrent: yes`` (YAML's boolean) would serve one request at a time. Such a value is
    handed to the field as the text it was written as, which its own check refuses with the others."""
    if isinstance(data, dict):
        fields = cls.model_fields
        return {k: str(v).lower() if isinstance(v, bool) and k in fields and _number_only(fields[k].annotation)
                else v for k, v in data.items()}
    return data


class Checked(BaseModel):
    """Base of the settings models: unknown keys refused, frozen, no boolean taken for a number, and
    no NaN or infinity ("nan" passed every unbounded number and failed a bounded one as "should be
    less than or equal to 1")."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans(cls, data: Any) -> Any:
        return booleans_are_not_numbers(cls, data)


class ModelSettings(Checked):
    path: str
    """A Hugging Face model folder with safetensors weights, e.g. $SCD_HOME/models/smollm2-135m-instruct."""
    adapter: str | None = None
    """A LoRA adapter folder (peft, safetensors) merged into ``path`` at load: a consumer given as base +
    adapter."""
    device: str = "cpu"
    """``cpu``, ``cuda`` or ``cuda:N``."""
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    """Use float32 on CPU; float16/bfloat16 on GPUs."""
    fingerprint: str | None = None
    """The weights fingerprint the folder must hold (``scd serve --pair`` gives the registered pair's):
    weights changed since registration are refused at start-up."""

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


class ServerSettings(Checked):
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    """0 picks a free port (printed at start-up)."""
    grace_s: float = Field(5.0, ge=0)
    """Seconds in-flight requests get to finish on SIGTERM."""


class HTTPSettings(Checked):
    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=0, le=65535)
    """None disables the HTTP server; 0 picks a free port. Producer: the OpenAI-compatible front,
    /health and /metrics. Consumer: /health and /metrics."""
    read_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    """A request must arrive whole within this many seconds: its headers from the connection's
    first byte (or the end of the previous answer), its body from its headers. A connection that
    sends nothing, or stops mid-request, is closed (mid-body: a 408 first)."""


class BenchSettings(Checked):
    hold_layers: bool = False
    """Benchmarks only: honour a request's ``scd-bench-hold: 1`` gRPC metadata, which makes the producer
    encode every layer before it sends any and the consumer reconstruct only after the trailer (to time
    what pipelining saves). Off in production: the protocol itself always streams per layer."""


BENCH_HOLD_METADATA = "scd-bench-hold"


_SHAPES = {"tuple_type": "; write a list, e.g. [a, b]", "list_type": "; write a list, e.g. [a, b]",
           "dict_type": "; write a mapping, e.g. {name: value}",
           "string_type": "; quote it in YAML (unquoted, YAML reads 12345 as a number and no as false)"}
"""What a setting of that shape looks like, in a file, a ``--set`` value or an environment variable."""


class _Environment(EnvSettingsSource):
    """pydantic-settings' environment source, its list and mapping values read as ``--set`` reads
    them: JSON (``["raw", "scd"]``) or YAML (``[raw, scd]``); other text is passed on as text, for the
    setting to refuse by name (pydantic-settings took JSON only, and raised on anything else)."""

    def decode_complex_value(self, field_name, field, value):
        try:
            return super().decode_complex_value(field_name, field, value)
        except ValueError:
            return override_value(value)


class ServiceSettings(BaseSettings, Checked):
    """Base of ProducerSettings/ConsumerSettings: file < environment < flags."""

    model_config = SettingsConfigDict(extra="forbid", env_nested_delimiter="__", frozen=True)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, _Environment(settings_cls))

    @classmethod
    def load(cls, file: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
             defaults: dict[str, Any] | None = None, whole: dict[str, tuple[str, ...]] | None = None, **kw: Any):
        """Settings from ``defaults`` (computed by the caller: what a store or a registered pair holds),
        then an optional YAML file, the environment (``PREFIX__A__B=v``), overrides ``a.b=v``, and
        ``kw`` (explicit flags, highest priority). ``whole`` maps a setting to the defaults that go
        with it (``{"model.path": ("model", "tokenizer")}``: a pair's model is its folder, the adapter
        trained on it and its tokenizer): a file, variable, override or flag that sets it drops those
        defaults, while the section's other settings (``model.dtype``) refine them. Raises ConfigError
        with every problem listed."""
        import os

        loaded: dict[str, Any] = {}
        if file:
            try:
                loaded = yaml.safe_load(Path(file).read_text()) or {}
            except (OSError, yaml.YAMLError) as e:
                raise ConfigError(f"cannot read settings file {file}: {e}") from None
            except UnicodeDecodeError as e:
                raise ConfigError(f"settings file {file} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                                  f"{e.start}); save it as UTF-8 YAML") from None
            if not isinstance(loaded, dict):
                raise ConfigError(f"settings file {file} must hold a mapping at the top level")
        prefix = (cls.model_config.get("env_prefix") or "").lower()
        # each variable's setting path: CONSUMER__SERVER__PORT -> (server, port)
        env = {k: tuple(k[len(prefix):].lower().split("__")) for k in os.environ
               if prefix and k.lower().startswith(prefix)}
        defaults = copy.deepcopy(defaults or {})
        for unit, goes_with in (whole or {}).items():
            section, _, key = unit.partition(".")
            if any(_sets(source, section, key) for source in (loaded, kw)) or any(
                    path in ((section,), (section, key)) for path in env.values()) or any(
                    o.partition("=")[0].strip() in (section, unit) for o in overrides):  # --set model=...: replaced
                for name in goes_with:
                    defaults.pop(name, None)
        # a sub-model's default with fields of its own (server: ServerSettings(port=50052)) is the base
        # that a file, the environment or a flag setting only some of its keys (server.host) refines
        data: dict[str, Any] = {name: f.default.model_dump(exclude_unset=True) for name, f in cls.model_fields.items()
                                if isinstance(f.default, BaseModel) and f.default.model_fields_set}
        _deep_update(data, defaults)
        _deep_update(data, loaded)
        # pydantic-settings ignores a variable that names no setting (CONSUMER__MAX_CONCURENT, a typo);
        # one under a setting (CONSUMER__SERVER__PORTT) reaches the model, which refuses it
        problems = [f"{key}: not a known setting ({_env_hint(cls, key, len(prefix))})" for key in sorted(env)
                    if env[key][0] not in cls.model_fields]
        for path in env.values():  # environment beats the file: drop file keys the environment sets
            _pop(data, list(path))
        for item in overrides:
            key, eq, value = item.partition("=")
            if not eq or not all(part.strip() for part in key.split(".")):
                raise ConfigError(f"override {item!r} must look like a.b=value")
            keys, parsed = key.split("."), override_value(value)
            _set(data, keys, value if parsed is not None and _takes_text(cls, keys) else parsed)
        _deep_update(data, kw)
        try:
            settings = cls(**data)
        except ValidationError as e:
            # a value from the environment is named with its variable (the file and flags name the key)
            problems += [line + _SHAPES.get(err["type"], "") + next((f" (from {var})" for var, path in env.items()
                                      if tuple(str(p) for p in err["loc"][:len(path)]) == path), "")
                         for err, line in zip(e.errors(), field_errors(e, model=cls))]
        if problems:
            lines = "\n".join(f"  {line}" for line in problems)
            raise ConfigError(f"invalid {cls.__name__}:\n{lines}") from None
        return settings


def _sets(source: dict, section: str, key: str) -> bool:
    """Whether a mapping of settings sets ``section.key`` (or the whole ``section`` as something else)."""
    value = source.get(section)
    return value is not None and (not isinstance(value, dict) or key in value)


def _takes_text(model: type[BaseModel], path: list[str]) -> bool:
    """Whether the setting at ``path`` takes text only (a string, a path, a choice of words), so that
    a ``--set`` value is the text as given: YAML reads ``::`` (listen on every IPv6 address) as a
    mapping, a token ``12345`` as a number and ``no`` as false."""
    parent = _model_at(model, path[:-1])
    field = parent.model_fields.get(path[-1]) if parent is not None else None
    return field is not None and _textual(field.annotation)


def _textual(annotation) -> bool:
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation in (str, Path, SecretStr):
        return True
    if origin is Annotated:
        return _textual(args[0])
    if origin is Literal:
        return all(isinstance(a, str) for a in args)
    if origin in (Union, types.UnionType):
        given = [a for a in args if a is not type(None)]
        return bool(given) and all(_textual(a) for a in given)
    return False


def override_value(text: str):
    """A ``--set key=value``'s value: a YAML scalar, list or mapping (``8``, ``true``, ``[a, b]``);
    text that is not valid YAML (``[``, ``a: b: c``) is that text, for the setting to check."""
    if not text:
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _pop(d: dict, path: list[str]) -> None:
    for p in path[:-1]:
        d = d.get(p, {}) if isinstance(d.get(p), dict) else {}
    d.pop(path[-1], None)


def _set(d: dict, path: list[str], value: Any) -> None:
    """``--set a.b.c=value``; ConfigError when a part of the path holds a value, not a section."""
    for i, p in enumerate(path[:-1]):
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"--set {'.'.join(path)}: {'.'.join(path[:i + 1])} is a setting of its own, not a "
                              f"section with settings under it; set {'.'.join(path[:i + 1])}=VALUE")
    d[path[-1]] = value


def _deep_update(d: dict, u: dict) -> None:
    for k, v in u.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            _deep_update(d[k], v)
        else:
            d[k] = v
