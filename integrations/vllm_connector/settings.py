"""``kv_connector_extra_config`` of each role, typed and checked when the engine starts: a key the
role does not have (a typo) or a value of the wrong type is named with what to write, instead of
being ignored or failing later. Imports no vLLM (tested in the project's own environment)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, ValidationError, field_validator, model_validator

from integrations.vllm_connector.transfers import SUPPORTED, check_method
from shared.codecs import parse_variant, resolve_variant
from shared.config import Bytes, Checked, check_consumer_names, check_grpc_target, field_errors, one_of
from shared.errors import InvalidRequest, UnknownMethod

DEFAULT_ADDRESS = "127.0.0.1:50061"


class _Extra(Checked):
    artifacts: str | None = None
    """The pair's folder in the artifact store (``scd-reuse``)."""
    timeout_s: float = Field(60.0, gt=0)
    """How long a layer load or a send may wait."""
    stats_file: str | None = None
    """The counters (JSON) go to ``<stats_file>.scheduler`` and ``<stats_file>.worker``."""


class ProducerExtra(_Extra):
    consumer: str = DEFAULT_ADDRESS
    """``host:port`` of the consumer engine's receiver: where a request that names none goes."""
    consumers: dict[str, str] = {}
    """``{name: host:port}``: a request picks one with ``kv_transfer_params: {"scd_consumer": name}``."""
    method: str = "raw"
    method_params: dict[str, Annotated[str | int | float | bool, one_of("a string, number or boolean")]] = {}
    """The default method's settings; numbers and booleans are sent as their text, as in the services."""

    @field_validator("consumer")
    @classmethod
    def _address(cls, v: str) -> str:
        return check_grpc_target(v, DEFAULT_ADDRESS)

    @field_validator("consumers")
    @classmethod
    def _addresses(cls, v: dict[str, str]) -> dict[str, str]:
        check_consumer_names(*v)
        for address in v.values():
            check_grpc_target(address, DEFAULT_ADDRESS)
        return v

    @field_validator("method")
    @classmethod
    def _method(cls, v: str) -> str:
        kind, _ = parse_variant(v)  # a method with settings, as the CLI writes it: raw:dtype=float32
        _runnable(kind)
        return v

    @model_validator(mode="after")
    def _settings_once(self):
        try:
            resolve_variant(self.method, self.params())
        except InvalidRequest as e:
            raise ValueError(str(e)) from None
        return self

    def params(self) -> dict[str, str]:
        return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in self.method_params.items()}

    def default(self) -> tuple[str, dict[str, str]]:
        """The default method's kind and settings (those in ``method`` and ``method_params`` together)."""
        return resolve_variant(self.method, self.params())


class ConsumerExtra(_Extra):
    listen: str = DEFAULT_ADDRESS
    """The receiver's ``host:port``."""
    methods: tuple[str, ...] = SUPPORTED
    producer_fingerprint: str | None = None
    """The producer weights it accepts (default: the artifacts')."""
    max_held_bytes: Bytes = Field(2 << 30, ge=1 << 20)
    """The receiver's budget of decoded transfers (a number of bytes, or 2GiB...)."""
    ttl_s: float = Field(120.0, gt=0)
    """How long a decoded transfer nobody loads is kept."""
    frame_timeout_s: float = Field(30.0, gt=0)
    """A stream that sends no frame for this long is cut and its transfer fails."""

    @field_validator("listen")
    @classmethod
    def _address(cls, v: str) -> str:
        return check_grpc_target(v, "0.0.0.0:50061")

    @field_validator("methods")
    @classmethod
    def _methods(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError(f"name at least one method; the connector runs {list(SUPPORTED)}")
        return _runnable(*v)


def _runnable(*methods: str) -> tuple[str, ...]:
    """``methods`` if the connector can run each, else ValueError with the reason (``check_method``)."""
    for m in methods:
        try:
            check_method(m)
        except UnknownMethod as e:
            raise ValueError(str(e)) from None
    return methods


def parse_extra(role: str, extra: dict | None) -> ProducerExtra | ConsumerExtra:
    """The role's settings from ``kv_connector_extra_config``; ValueError naming each problem and the
    role's settings."""
    cls = ProducerExtra if role == "kv_producer" else ConsumerExtra
    try:
        return cls.model_validate(dict(extra or {}))
    except ValidationError as e:
        raise ValueError(f"SCDConnector ({role}): kv_connector_extra_config: {'; '.join(field_errors(e))} "
                         f"(its settings: {', '.join(cls.model_fields)})") from None
