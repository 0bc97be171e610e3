"""Consumer settings: file + environment (``CONSUMER__...``) + ``--set`` flags."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.config import ModelSettings, ServerSettings, ServiceSettings


class ConsumerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="CONSUMER__", env_nested_delimiter="__", extra="forbid", frozen=True)

    name: str = Field("strong", min_length=1)
    """The consumer's name: what producers and clients address it by."""
    model: ModelSettings
    server: ServerSettings = ServerSettings(port=50052)
    artifact_store: str | None = None
    """Artifact store directory (local or a mounted shared volume); the pair's artifacts are read
    from ``<artifact_store>/<name>``. Needed by the cross-model methods (scd, scd-reuse)."""
    producer_fingerprint: str | None = None
    """Weights fingerprint of the producer this consumer accepts streams from; None accepts any
    producer for methods that need no calibration (raw, oracle)."""
    methods: tuple[str, ...] = ("oracle", "raw", "quant", "scd-reuse", "scd")
    """Transfer methods this consumer accepts."""
    max_prompt_tokens: int = Field(4096, ge=2)
    max_new_tokens: int = Field(512, ge=1)
    default_max_new_tokens: int = Field(64, ge=1)
    frame_timeout_s: float = Field(30.0, gt=0)
    """A request that receives no frame for this long is aborted and its memory freed (lease)."""
