"""Consumer settings: file + environment (``CONSUMER__...``) + ``--set`` flags."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from shared.config import (
    BenchSettings,
    Bytes,
    HTTPSettings,
    ModelSettings,
    ServerSettings,
    ServiceSettings,
    TextList,
    check_consumer_names,
    check_method_names,
)
from shared.rpc.security import SecuritySettings


class ConsumerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="CONSUMER__", env_nested_delimiter="__", extra="forbid", frozen=True)

    name: str = Field("strong", min_length=1)
    """The consumer's name: what producers and clients address it by."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        check_consumer_names(v)
        return v

    model: ModelSettings
    tokenizer: str | None = None
    """A folder whose tokenizer and chat template this consumer reads its prompts with (its stop tokens,
    the template prefix of ``native_prefix``); default: ``model.path``'s when it has one. A registered
    pair gives its own (the producer's when the consumer's folder has none)."""
    server: ServerSettings = ServerSettings(port=50052)
    artifact_store: str | None = None
    """Artifact store directory (local or a mounted shared volume); the pair's artifacts are read
    from ``<artifact_store>/<name>``. Needed by the cross-model methods (scd, scd-reuse)."""
    producer_fingerprint: str | None = None
    """Weights fingerprint of the producer this consumer accepts streams from; None accepts any
    producer for methods that need no calibration (raw, oracle)."""
    methods: TextList = ("oracle", "raw", "quant", "scd-reuse", "scd")
    """Transfer methods this consumer accepts."""
    max_prompt_tokens: int | None = Field(None, ge=2)
    """Longest prompt a request may have, in tokens; default (unset): the model's context window
    (``max_position_embeddings``), else 4,096 where the model does not say. Never past the window."""
    max_new_tokens: int = Field(512, ge=1)
    default_max_new_tokens: int = Field(64, ge=1)
    read_ahead_layers: int = Field(8, ge=1, le=1024)
    """Layers received ahead of reconstruction (a bounded queue): the transfer keeps flowing while a
    layer is rebuilt, and at most this many decoded layers wait in memory."""
    frame_timeout_s: float = Field(30.0, gt=0)
    """A request that receives no frame for this long is aborted and its memory freed (lease)."""
    prefill_allowance_ms_per_token: float = Field(20.0, ge=0)
    """The producer prefills after it sends the header (or before, for a method that settles its
    settings on the prefill): the wait for a stream's first data frame, and for a header, may last
    ``frame_timeout_s`` plus this much per prompt token (per token of the longest prompt taken, while
    the header is not there yet). The default gives a 1,000-token prompt 20 s more, 8,192 tokens 164 s:
    a long prompt on a busy producer is served, a producer that stalls is still cut."""
    min_progress_bytes_per_s: int = Field(65536, ge=0)
    """A stream must deliver at least this many wire bytes per second of waiting for it (after
    ``progress_grace_s``), or it is aborted and its admission slot freed: a peer that trickles
    frames cannot hold a slot until the deadline. Time the consumer spends reconstructing does not
    count. 0 turns the check off."""
    progress_grace_s: float = Field(5.0, ge=0)
    fallback: Literal["fail", "recompute"] = "fail"
    """A stream whose protocol version, method version, pair fingerprint or depth does not match what
    this consumer loaded: ``fail`` refuses it (FAILED_PRECONDITION, the message says which side to
    update); ``recompute`` ignores its frames and prefills from the prompt's token ids with the
    consumer's own model (final event: timings.fallback_recompute=true)."""
    max_concurrent: int = Field(4, ge=1)
    """Requests reconstructing or decoding at once; more wait in the queue."""
    max_queue: int = Field(16, ge=0)
    """Requests that may wait for admission; past it, RESOURCE_EXHAUSTED."""
    cache_budget_bytes: Bytes = Field(0, ge=0)
    """Memory budget of admitted requests, charged before anything is allocated: each request's
    cache, (prompt + max_new_tokens) x layers x 2 x kv_heads x head_dim x element size, plus the
    payload its method declares for the transfer; 0 = unbounded."""
    max_queue_wait_s: float = Field(30.0, gt=0)
    """A request waits at most this long (and never past its deadline) for admission."""
    max_stream_bytes: Bytes = Field(4 << 30, ge=1 << 20)
    """Uncompressed payload bytes one stream may carry; past it the stream is refused."""
    http: HTTPSettings = HTTPSettings()
    """/metrics and /health over HTTP; off unless http.port is set."""
    access_log: bool = True
    """One INFO line per finished request on the ``scd.access`` logger (its id, consumer, method,
    outcome, tokens, time to first token, bytes): ``request=ID key=value ...``."""
    security: SecuritySettings = SecuritySettings()
    bench: BenchSettings = BenchSettings()

    @field_validator("methods")
    @classmethod
    def _method_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return check_method_names(v)

    @model_validator(mode="before")
    @classmethod
    def _default_follows_limit(cls, data):
        """A max_new_tokens below the default answer length lowers that default with it, unless the
        default is set too."""
        if isinstance(data, dict) and "default_max_new_tokens" not in data and "max_new_tokens" in data:
            try:
                limit = int(data["max_new_tokens"])
            except (TypeError, ValueError):
                return data  # the field's own validation says what is wrong
            default = cls.model_fields["default_max_new_tokens"].default
            if 1 <= limit < default:
                data = {**data, "default_max_new_tokens": limit}
        return data

    @model_validator(mode="after")
    def _default_within_limit(self):
        if self.default_max_new_tokens > self.max_new_tokens:
            raise ValueError(f"default_max_new_tokens ({self.default_max_new_tokens}) must be at most max_new_tokens "
                             f"({self.max_new_tokens}): every request that names no limit would be refused")
        return self
