"""The services' domain types: what engines take and return. Protobuf never reaches an engine;
``shared/rpc/convert.py`` translates these to and from the wire's messages (KServe-style)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingRequest:
    """Sampling as the client asked for it (validated by the consumer, which owns the limits)."""

    max_new_tokens: int = 0  # 0: the consumer's default
    temperature: float = 0.0
    top_p: float = 0.0  # 0: 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None  # None: a fresh random seed per request (it matters only when temperature > 0)


@dataclass(frozen=True)
class GenerateRequest:
    """A client's request to the producer."""

    prompt: str | tuple[int, ...]  # text (wrapped in the consumer's chat template) or token ids, used as is
    consumer: str
    method: str = ""  # empty: the producer's default
    method_params: dict[str, str] = field(default_factory=dict)
    sampling: SamplingRequest = SamplingRequest()
    native_prefix: bool = True
    request_id: str = ""


@dataclass(frozen=True)
class StreamHeader:
    """What the producer tells the consumer before any layer: the request and the method."""

    request_id: str
    method: str
    method_version: int
    protocol_version: int
    pair_fingerprint: str  # producer weights : method kind and version : settings : artifacts/profile pin
    n_layers: int
    n_tokens: int  # positions whose cache is transferred (prompt minus its last token)
    prompt_ids: tuple[int, ...]
    params: dict[str, str]
    sampling: SamplingRequest
    native_prefix: bool
    prefix_len: int
    consumer: str
    deadline_unix: float

    @property
    def producer_fingerprint(self) -> str:
        return self.pair_fingerprint.split(":")[0]

    @property
    def pin(self) -> str:
        """The content hash of the calibration artifacts or profile the producer encoded with ("" if none)."""
        parts = self.pair_fingerprint.split(":")
        return parts[3] if len(parts) > 3 else ""


# ------------------------------------------------------------------ what a method declares it sends
@dataclass(frozen=True)
class TensorSpec:
    """One tensor a method sends for a layer: its dtype and shape. ``exact=False``: each dimension
    is at most ``shape[i]`` (sizes that depend on the data, e.g. how many tokens a precision tier
    holds); the method checks those against each other when it decodes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    exact: bool = True

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def mismatch(self, dtype: torch.dtype, shape: tuple[int, ...]) -> str | None:
        """Why a tensor of ``dtype`` and ``shape`` does not fit this spec; None when it does."""
        if dtype != self.dtype:
            return f"dtype {dtype} where {self.dtype} is declared"
        if self.exact and tuple(shape) != self.shape:
            return f"shape {list(shape)} where {list(self.shape)} is declared"
        if len(shape) != len(self.shape) or any(d < 0 or d > m for d, m in zip(shape, self.shape)):
            return f"shape {list(shape)} outside the declared bounds {list(self.shape)}"
        return None


Schema = dict[str, TensorSpec]


# ------------------------------------------------------------------ what a frame stream yields
@dataclass(frozen=True)
class HeaderReceived:
    header: StreamHeader


@dataclass(frozen=True)
class LayerReceived:
    layer: int
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class TrailerReceived:
    """The stream is complete: every layer arrived and the trailer's counts and checksum matched."""


StreamEvent = HeaderReceived | LayerReceived | TrailerReceived


# ------------------------------------------------------------------ what the consumer streams back
@dataclass
class Timings:
    """What one request cost, on the final token event. The consumer fills its part; the producer
    adds TTFT, its prefill and encode times and the bytes it sent."""

    ttft_ms: float = 0.0
    """Request received by the producer -> first token event sent by the consumer."""
    prefill_ms: float = 0.0
    encode_ms: float = 0.0
    """Producer encode, all layers."""
    wire_bytes: int = 0
    """Serialized frame bytes, producer -> consumer."""
    payload_bytes: int = 0
    """Tensor bytes after the wire's compression (zstd by default)."""
    reconstruct_ms: float = 0.0
    """Consumer decode work, all layers."""
    transfer_ms: float = 0.0
    """First frame after the header -> the trailer, as the consumer saw them."""
    last_frame_to_first_token_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    method: str = ""
    fallback_recompute: bool = False
    """The consumer prefilled the prompt itself instead of using the transfer."""
    auto_reason: str = ""
    """For a request that asked for ``auto``: the method it chose and why (set by the producer)."""
    method_identity: str = ""
    """The method as requested, as ``TransferMethod.identity`` gives it: producer weights, kind and version,
    settings, calibration pin (set by the producer; ``scd bench`` matches it against ``scd eval``'s)."""
    consumer_fingerprint: str = ""
    """The consumer's weights fingerprint (set by the consumer): the other half of what a KL depends on."""


@dataclass
class TokenEvent:
    text: str
    token_id: int
    index: int
    finish_reason: str = ""  # "", "stop", "length"
    request_id: str = ""
    timings: Timings | None = None  # on the final event only


@dataclass(frozen=True)
class EncodedLayer:
    """One layer's named tensors as the producer's method encoded them."""

    layer: int
    tensors: dict[str, torch.Tensor]
