"""Producer settings: file + environment (``PRODUCER__...``) + ``--set`` flags."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from shared.auto import LINK_MBPS
from shared.config import (
    BenchSettings,
    Bytes,
    Checked,
    HTTPSettings,
    ModelSettings,
    ServerSettings,
    ServiceSettings,
    TextList,
    check_consumer_names,
    check_grpc_target,
    check_method_names,
)
from shared.errors import SCDError
from shared.rpc.security import SecuritySettings


class ConsumerEndpoint(Checked):
    address: str = Field(..., min_length=3)
    """host:port of the consumer's gRPC server (or a gRPC target with its scheme: dns:, unix:, ...)."""
    artifacts: str | None = None
    """This pair's calibration artifacts folder (e.g. artifacts/store/strong); needed for scd."""
    tokenizer: str | None = None
    """A folder whose tokenizer and chat template format text prompts for this consumer (its pair's:
    the model that answers); default: the producer's own. Must share the producer's vocabulary."""
    link_mbps: float | None = Field(None, ge=LINK_MBPS[0], le=LINK_MBPS[1])
    """The link rate to this consumer that ``auto`` plans for, Mbit/s; default: measured from recent
    transfers (1,000 until one has been seen)."""

    @field_validator("address")
    @classmethod
    def _host_port(cls, v: str) -> str:
        return check_grpc_target(v)


_ORIGIN = re.compile(r"^https?://[^/\s?#]+$")


class ProducerHTTPSettings(HTTPSettings):
    cors_origins: TextList = ()
    """Browser origins allowed to call the OpenAI API (CORS), as a browser sends its ``Origin``
    header (``https://chat.example.com``, ``http://localhost:3000``), or ``"*"`` for any. Empty (the
    default): no CORS headers, and a browser's preflight (``OPTIONS``) is refused."""

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [o for o in v if o != "*" and not _ORIGIN.match(o)]
        if bad:
            raise ValueError(f"origin(s) {', '.join(map(repr, bad))}: write each as a browser sends it, "
                             "scheme://host[:port] with no path or trailing slash (https://chat.example.com), "
                             "or '*' for any")
        return v


class ProducerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="PRODUCER__", env_nested_delimiter="__", extra="forbid", frozen=True)

    model: ModelSettings
    server: ServerSettings = ServerSettings(port=50051)
    consumers: dict[str, ConsumerEndpoint] = {}
    """Consumers this producer can serve, by name."""
    default_method: str = "scd"
    methods: TextList = ("oracle", "raw", "quant", "scd-reuse", "scd", "auto")
    """Transfer methods this producer offers (a method whose pair lacks its artifacts or profile is
    refused per request with the command that makes them). ``auto`` picks one of the others listed
    here, per request, from the pair's operating table (the consumer must accept what it picks)."""
    max_prompt_tokens: int | None = Field(None, ge=2)
    """Longest prompt a request may have, in tokens; default (unset): the model's context window
    (``max_position_embeddings``), else 4,096 where the model does not say. Never past the window."""
    max_prompt_chars: int = Field(64_000, ge=1)
    default_deadline_s: float = Field(120.0, gt=0)
    """Deadline of a request whose client set none."""
    prefill_cache_entries: int = Field(0, ge=0, le=1024)
    """Most recent prefill states kept, keyed by the prompt's token ids (0 = off): a prompt already
    prefilled is streamed again without a prefill (one base prefill serving many consumers)."""
    prefill_cache_bytes: Bytes = Field(1 << 30, ge=0)
    """Memory the kept prefill states may hold together (the least recently used go first; a state
    larger than this is not kept). A state holds the K/V of every layer and the states every method
    offered reads (each prefill captures them all, so that one prefill serves every method): for
    SmolLM2-135M in fp32 ~55 kB per prompt token with `scd`, up to ~185 kB where an offered method
    (spectrum, ridge's tiers) reads every layer's states; the default keeps ~18 states of 1,000 tokens."""
    max_deadline_s: float = Field(600.0, gt=0)
    """Longest deadline a client may ask for; longer ones are cut to this."""
    http: ProducerHTTPSettings = ProducerHTTPSettings()
    """The OpenAI-compatible HTTP front (/v1/completions, /v1/chat/completions, /v1/models), /health
    and /metrics; off unless http.port is set."""
    health_probe_s: float = Field(5.0, ge=0)
    """Every this many seconds the producer checks each consumer's gRPC health: its own health is
    reported per consumer (service ``scd.v1.Producer/<consumer>``; HTTP /health lists them) and it
    is SERVING only while at least one consumer is (NOT_SERVING until the first probe answers). 0: no
    probes, always SERVING (each consumer's status UNKNOWN)."""
    compression: Literal["zstd", "lz4", "none"] = "zstd"
    """How the stream's tensor chunks are compressed. zstd (default) entropy-codes SCD's int8 codes
    (~25% fewer bytes than lz4 for a few ms per MB); lz4 is what producers before it sent; every
    consumer reads all three."""
    max_http_body_bytes: Bytes = Field(1 << 20, ge=1024)
    """HTTP request bodies larger than this are refused (413) before they are parsed."""
    access_log: bool = True
    """One INFO line per finished request on the ``scd.access`` logger (its id, consumer, method,
    outcome, tokens, time to first token, bytes): ``request=ID key=value ...``."""
    security: SecuritySettings = SecuritySettings()
    bench: BenchSettings = BenchSettings()

    @field_validator("consumers")
    @classmethod
    def _consumer_names(cls, v: dict) -> dict:
        check_consumer_names(*v)
        return v

    @field_validator("methods")
    @classmethod
    def _method_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return check_method_names(v, allow=("auto",))

    @model_validator(mode="after")
    def _deadlines(self):
        if self.default_deadline_s > self.max_deadline_s:  # every request without one would be cut, silently
            raise ValueError(f"default_deadline_s ({self.default_deadline_s:g}) is over max_deadline_s "
                             f"({self.max_deadline_s:g}), which cuts it: raise max_deadline_s or lower the default")
        return self

    @model_validator(mode="after")
    def _default_enabled(self):
        kind = self.default_method.partition(":")[0]  # a method with settings: scd:block_tokens=0.35
        if kind not in self.methods:
            raise ValueError(f"default_method {self.default_method!r} must be one of methods {list(self.methods)}"
                             + (f" (its kind {kind!r} is not)" if kind != self.default_method else ""))
        if kind != self.default_method:
            from shared.codecs import check_settings, parse_variant  # torch: only for a method with settings

            try:
                check_settings(*parse_variant(self.default_method))
            except (SCDError, ValueError) as e:
                raise ValueError(f"default_method: {e}") from None
        return self
