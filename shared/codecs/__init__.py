"""The registry of transfer methods. A new method is one module, one line here, one union member."""

from __future__ import annotations

from typing import Annotated, Union

from pydantic import Field, TypeAdapter, ValidationError

from shared.codecs.base import CodecContext, DecodeJob, DecodeSession, MethodConfig, TransferMethod
from shared.codecs.oracle import Oracle
from shared.codecs.quantized import QuantKV
from shared.codecs.raw import RawKV
from shared.codecs.ridge import RidgeMap
from shared.codecs.scd import SCD
from shared.codecs.scd_reuse import SCDReuse
from shared.codecs.selective_recompute import DroidSpeak
from shared.codecs.spectrum import SpectrumKV
from shared.config import field_errors, first_field
from shared.errors import InvalidRequest, UnknownMethod, clip


def _registry(*classes: type[TransferMethod]) -> dict[str, type[TransferMethod]]:
    out: dict[str, type[TransferMethod]] = {}
    for cls in classes:
        if cls.kind in out:
            raise ValueError(f"duplicate transfer method kind {cls.kind!r}")
        out[cls.kind] = cls
    return out


CODECS = _registry(Oracle, RawKV, QuantKV, SpectrumKV, DroidSpeak, RidgeMap, SCDReuse, SCD)
CodecConfig = Annotated[
    Union[Oracle.Config, RawKV.Config, QuantKV.Config, SpectrumKV.Config, DroidSpeak.Config, RidgeMap.Config,
          SCDReuse.Config, SCD.Config], Field(discriminator="kind")
]
_ADAPTER = TypeAdapter(CodecConfig)


def method_config(kind: str, params: dict[str, str] | None = None) -> MethodConfig:
    """Validate a method's settings from string parameters (as they arrive on the wire)."""
    if kind not in CODECS:
        raise UnknownMethod(f"unknown transfer method {kind!r}; expected one of {sorted(CODECS)}")
    cls = CODECS[kind].Config
    params = params or {}
    try:  # as strings first (string fields such as patch_layers="3" or int4="on"), then the fields
        return cls.model_validate({"kind": kind, **params})  # that failed as strings read back as numbers
    except ValidationError as first:
        failed = {err["loc"][0] for err in first.errors() if err["loc"]}
        try:
            read = {k: _scalar(v) if k in failed else v for k, v in params.items()}
            return cls.model_validate({"kind": kind, **read})
        except ValidationError as e:
            settings = sorted(f for f in cls.model_fields if f != "kind")
            raise InvalidRequest(f"invalid settings for method {kind!r}: {'; '.join(field_errors(e))} (its settings: "
                                 f"{', '.join(settings) or 'none'})", param=first_field(e)) from None


def check_enabled(methods, allow=()) -> None:
    """Fail fast at start-up on a settings list naming an unregistered method (``allow``: names that
    are not codecs but may be listed, e.g. the producer's ``auto``)."""
    for m in methods:
        if m not in CODECS and m not in allow:
            raise UnknownMethod(f"settings.methods names {m!r}; registered methods are {sorted([*CODECS, *allow])}")


def _scalar(v):
    """Wire parameters are strings: read numbers and booleans back ("4" -> 4, "true" -> True)."""
    if not isinstance(v, str):
        return v
    import yaml

    try:
        parsed = yaml.safe_load(v)
    except yaml.YAMLError:
        return v
    return parsed if isinstance(parsed, (int, float, bool)) else v


def same_setting(a, b) -> bool:
    """Whether two spellings of a setting say the same: equal text, or equal numbers or booleans
    (``0.35`` and ``0.350``; ``1`` and ``1.0``; never ``1`` and ``true``)."""
    if a == b:
        return True
    x, y = _scalar(a), _scalar(b)
    if isinstance(x, str) or isinstance(y, str) or isinstance(x, bool) != isinstance(y, bool):
        return False
    return x == y


def parse_variant(label: str) -> tuple[str, dict[str, str]]:
    """A method variant's label: a kind (``scd``) or a kind with settings (``scd:block_tokens=0.5``,
    several joined by ``;``, so that labels can be listed with commas) -> (kind, settings)."""
    kind, _, rest = label.partition(":")
    params = {}
    for part in (p for p in rest.split(";") if p):
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise ValueError(f"method variant {label!r}: settings are KEY=VALUE, e.g. scd:block_tokens=0.5")
        if key in params:
            raise ValueError(f"method variant {label!r} sets {key} twice; give each setting once")
        params[key] = value
    return kind, params


def resolve_variant(label: str, params: dict[str, str], strict: bool = True) -> tuple[str, dict[str, str]]:
    """A method label that may carry settings (``scd:block_tokens=0.35``) and the settings given beside
    it (a request's ``method_params``) -> (kind, settings). A setting given both ways with two values
    is an InvalidRequest when ``strict``; else (the label is a default, e.g. the producer's
    ``default_method``) ``params`` win."""
    try:
        kind, given = parse_variant(label)
    except ValueError as e:
        raise InvalidRequest(str(e), param="method") from None
    out = dict(params)
    for key, value in given.items():
        if strict and not same_setting(out.get(key, value), value):
            raise InvalidRequest(f"method {clip(label)} sets {key}={value} and method_params sets {key}="
                                 f"{clip(out[key])}; give each setting once", param="method_params")
        out.setdefault(key, value)
    return kind, out


def requires(kind: str) -> frozenset[str]:
    """What a method needs of the pair's store: ``artifacts`` (SCD's) and/or ``profile`` (its own
    ``<pair>.<kind>.json``); ``auto`` (no codec) needs its operating table, a profile."""
    return frozenset({"profile"}) if kind == "auto" else CODECS[kind].requires


def check_settings(kind: str, params: dict[str, str] | None = None) -> None:
    """A method's settings checked before any work starts (a benchmark or an evaluation would otherwise
    find them wrong at its first request): UnknownMethod for a kind that is none, InvalidRequest saying
    which setting is wrong. ``auto`` takes its own settings (``shared.auto.AutoSettings``)."""
    if kind == "auto":
        from shared.auto import AutoSettings

        AutoSettings.parse(params)
    else:
        method_config(kind, params)


def make_method(kind: str, ctx: CodecContext, params: dict[str, str] | None = None) -> TransferMethod:
    """The method ``kind`` with its settings, for this model and pair. A setting that validates but that
    this model or pair cannot take (a ``group_size`` that does not divide the K/V width, layers
    outside the model or not calibrated) is an InvalidRequest worded as the validation's are."""
    cfg = method_config(kind, params)
    try:
        return CODECS[kind](cfg, ctx)
    except InvalidRequest as e:
        if e.param is None:
            raise
        raise InvalidRequest(f"invalid settings for method {kind!r}: {e}", param=e.param) from None


__all__ = ["CODECS", "CodecConfig", "CodecContext", "DecodeJob", "DecodeSession", "MethodConfig",
           "TransferMethod", "check_enabled", "check_settings", "make_method", "method_config", "parse_variant"]
