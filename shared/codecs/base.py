"""The transfer-method plugin interface.

A method turns the producer's prefill into per-layer named tensors (``encode_layer``, producer
side) and turns them back into the consumer's native pre-RoPE K/V for that layer
(``DecodeSession.add_layer``, consumer side), one layer at a time so that reconstruction overlaps
the transfer. Methods never see protobuf: ``shared/rpc/wire.py`` moves their tensors.

Lifecycle on the consumer: ``session = method.start(job)``, then ``add_layer(l, tensors)`` for
every layer in order as its frames arrive, then ``finish()`` returns the cache to decode from.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from shared.config import Checked
from shared.domain import Schema, TensorSpec
from shared.errors import DataLoss, InvalidPayload, InvalidRequest, clip
from shared.model.hf_adapter import ModelAdapter, PrefillState


class MethodConfig(Checked):
    """Base of every method's settings."""

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True).encode()).hexdigest()[:12]

    def wire_params(self) -> dict[str, str]:
        """The settings as the wire's string map: JSON values (lists stay lists when read back)."""
        return {k: v if isinstance(v, str) else json.dumps(v) for k, v in self.model_dump(exclude={"kind"}).items()}


def parse_int_list(value):
    """A list of layer indices from a list, one number, a JSON/YAML list string or ``"3,7"``; ValueError
    (as a setting's message) saying how to write one."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, str) and value.strip() not in ("auto", "none", ""):
        text = value.strip()
        try:
            value = json.loads(text) if text.startswith("[") else [int(x) for x in text.split(",")]
            if not (isinstance(value, list) and all(type(x) is int for x in value)):
                raise ValueError
        except ValueError:
            raise ValueError(f"write layer numbers separated by commas (e.g. 0,3), a JSON list ([0, 3]), auto or "
                             f"none; got {clip(text)}") from None
    if isinstance(value, list):
        twice = sorted({x for x in value if value.count(x) > 1 and isinstance(x, int)})
        if twice:
            raise ValueError(f"layer(s) {', '.join(map(str, twice))} given twice; name each layer once")
        return value
    return "none" if value == "" else value


def parse_blocks(value):
    """Blocks [[a, b], ...] (end exclusive) from a list, a JSON list string or ``"3-6,10-12"``; ValueError
    (as a setting's message) saying how to write them."""
    given = value
    try:
        if isinstance(value, str) and value.strip() != "auto":
            text = value.strip()
            if text.startswith("["):
                value = json.loads(text)
            else:
                value = []
                for part in text.split(","):
                    a, dash, b = part.partition("-")
                    if not dash:
                        raise ValueError
                    value.append([int(a), int(b)])
        if value != "auto" and not (isinstance(value, list) and all(isinstance(b, (list, tuple)) for b in value)):
            raise ValueError
    except ValueError:
        raise ValueError(f"write blocks as FIRST-END layers, END exclusive, separated by commas (e.g. 13-24 or "
                         f"3-6,10-12), a JSON list ([[13, 24]]) or auto; got {clip(str(given))}") from None
    return value


@dataclass
class CodecContext:
    """What a method may use on its side: the local model, and the pair's artifacts if loaded."""

    model: ModelAdapter
    artifacts: object | None = None
    profiles: dict = field(default_factory=dict)  # small per-pair baseline artifacts, by method kind


@dataclass
class DecodeJob:
    """One request as the consumer sees it."""

    prompt_ids: list[int]  # the whole prompt
    n_tokens: int  # positions whose cache is needed: len(prompt_ids) - 1
    start: int  # positions [0, start) come from the consumer's own native prefix
    prefix_keys: tuple[torch.Tensor, ...] = ()  # per layer [1, H, start, D], pre-RoPE
    prefix_values: tuple[torch.Tensor, ...] = ()

    @property
    def n_transfer(self) -> int:
        return self.n_tokens - self.start


class DecodeSession(ABC):
    """Collects per-layer K/V and returns the cache. Subclasses implement ``decode_layer``."""

    def __init__(self, method: "TransferMethod", job: DecodeJob):
        self.method, self.job, self.model = method, job, method.ctx.model
        self._rotated: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # this prompt's RoPE tables, made once

    def schema(self, layer: int) -> Schema:
        """The tensors ``layer`` must carry (names, dtypes, shapes), as the method declares them."""
        return self.method.schema(layer, self.job)

    def max_transfer_bytes(self) -> int:
        """The most payload bytes a conforming stream carries for this request (before the wire's compression)."""
        if not self.method.transfers_layers:
            return 0
        return sum(spec.nbytes for layer in range(self.model.n_layers) for spec in self.schema(layer).values())

    def add_layer(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        if layer != len(self._rotated):
            raise InvalidPayload(f"layer {layer} arrived out of order; expected layer {len(self._rotated)}")
        check_tensors(self.method.kind, layer, self.schema(layer), tensors)
        k, v = self.decode_layer(layer, tensors)
        self._rotated.append(self._entry(layer, k, v))

    def entry(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An added layer's cache entry: RoPE-rotated keys and values [1, H_kv, n_tokens, D] (an engine
        that writes its own paged cache takes them layer by layer instead of ``finish``)."""
        return self._rotated[layer]

    def replace_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace an added layer's K/V (a method that refines earlier layers once later ones arrive)."""
        self._rotated[layer] = self._entry(layer, k, v)

    def _entry(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(layer, k, v)
        k, v = self.with_prefix(layer, k, v)
        if self._rope is None:
            self._rope = self.model.rope_tables(k.shape[2])
        return self.model.rotate(k, *self._rope), v

    def with_prefix(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the transferred positions [start, n) preceded by the native prefix's own [0, start),
        on the model's device and dtype."""
        dev, dt = self.model.device, self.model.dtype
        k, v = k.to(dev, dt), v.to(dev, dt)
        if self.job.start:
            k = torch.cat([self.job.prefix_keys[layer].to(dev, dt), k], dim=2)
            v = torch.cat([self.job.prefix_values[layer].to(dev, dt), v], dim=2)
        return k, v

    def _check(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        want = (1, self.model.n_kv_heads, self.job.n_transfer, self.model.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                raise InvalidPayload(f"layer {layer} {name} decodes to shape {tuple(t.shape)}; expected {want}")
            if not all_finite(t):
                raise DataLoss(f"layer {layer} {name} decodes to non-finite values: the payload is corrupt")

    @abstractmethod
    def decode_layer(self, layer: int, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The consumer's pre-RoPE K and V [1, H_kv, n_transfer, D] of ``layer`` from its tensors."""

    def finish(self):
        """The consumer's cache for positions [0, n_tokens)."""
        if len(self._rotated) != self.model.n_layers:
            raise InvalidPayload(f"stream ended after {len(self._rotated)} of {self.model.n_layers} layers")
        return ModelAdapter.cache_from_rotated(self._rotated, self.model.config)

    def finish_for_decoding(self) -> tuple[Any, torch.Tensor | None]:
        """What the consumer decodes from: the cache, and the logits [vocab] that predict the first new
        token where this session computed them with the whole prompt (None: the cache holds positions
        [0, n_tokens) and the first decode step feeds the prompt's last token)."""
        return self.finish(), None


def check_group_size(width: int, g: int, when: str = "") -> None:
    """A request's ``group_size`` for groups of K/V channels must divide the model's K/V width."""
    if width % g:
        fits = [d for d in range(2, min(width, 128) + 1) if width % d == 0][-4:] or [1]
        raise InvalidRequest(f"group_size: {g} does not divide the model's K/V width {width}{when}; the width must be "
                             f"a multiple of it (this model takes e.g. {', '.join(map(str, fits))})",
                             param="group_size")


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of a floating-point tensor is finite: one pass (a sum, which is finite
    only if every element is), and the exact elementwise test only when the sum is not (it may also
    overflow on huge finite values)."""
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    return bool(torch.isfinite(t.sum(dtype=acc))) or bool(torch.isfinite(t).all())


def check_tensors(kind: str, layer: int, schema: Schema, tensors: dict[str, torch.Tensor]) -> None:
    """Names, dtypes and shapes exactly as declared (``InvalidPayload``); floating-point values
    finite (``DataLoss``)."""
    if set(tensors) != set(schema):
        missing, extra = sorted(set(schema) - set(tensors)), sorted(set(tensors) - set(schema))
        raise InvalidPayload(f"{kind} layer {layer} carries tensors {sorted(tensors)[:8]}; expected {sorted(schema)}"
                             + (f" (missing {missing})" if missing else "") + (f" (unexpected {extra[:8]})" if extra
                                                                              else ""))
    for name, spec in schema.items():
        t = tensors[name]
        why = spec.mismatch(t.dtype, tuple(t.shape))
        if why:
            raise InvalidPayload(f"{kind} layer {layer} tensor {name!r}: {why}")
        if t.is_floating_point() and not all_finite(t):
            raise DataLoss(f"{kind} layer {layer} tensor {name!r} holds NaN or infinite values: the payload is corrupt")


def kv_spec(model: ModelAdapter, n: int, dtype: torch.dtype = torch.float16) -> TensorSpec:
    """K or V of ``n`` positions as the model lays them out: [1, H_kv, n, D]."""
    return TensorSpec(dtype, (1, model.n_kv_heads, n, model.head_dim))


SKIP = {"skip": TensorSpec(torch.uint8, (0,))}
"""A layer inside a recompute block: nothing but a marker crosses."""


def skip_tensors() -> dict[str, torch.Tensor]:
    """What ``encode_layer`` sends for a layer whose schema is ``SKIP``."""
    return {"skip": torch.zeros(0, dtype=torch.uint8)}


class PerLayerSession(DecodeSession):
    """A session for methods that rebuild each layer on its own from its tensors and the number of
    transferred positions: ``method.decode_tensors(layer, tensors, n_transfer)``."""

    method: Any

    def decode_layer(self, layer, tensors):
        return self.method.decode_tensors(layer, tensors, self.job.n_transfer)


_TRAITS = frozenset({"kind", "version", "lossless", "transfers_layers", "compressive", "cross_model", "requires"})


class TransferMethod(ABC):
    kind: ClassVar[str]
    version: ClassVar[int] = 1
    lossless: ClassVar[bool] = False
    transfers_layers: ClassVar[bool] = True  # False: only token ids cross (the Oracle)
    compressive: ClassVar[bool] = False  # promises fewer bytes than raw fp16 K/V
    cross_model: ClassVar[bool] = False  # maps into the consumer's space (needs the pair's artifacts)
    requires: ClassVar[frozenset[str]] = frozenset()  # "artifacts" (SCD store) and/or "profile" (a baseline's JSON)
    Config: ClassVar[type[MethodConfig]]
    Session: ClassVar[type[DecodeSession]]

    def __init_subclass__(cls, **traits: Any):
        """Traits are declared on the class line: ``class Raw(TransferMethod, kind="raw")``."""
        super().__init_subclass__()
        for name, value in traits.items():
            if name not in _TRAITS:
                raise TypeError(f"{cls.__name__}: unknown method trait {name!r}; one of {sorted(_TRAITS)}")
            setattr(cls, name, frozenset(value) if name == "requires" else value)

    def __init__(self, cfg: MethodConfig, ctx: CodecContext):
        self.cfg, self.ctx = cfg, ctx

    def hidden_layers(self) -> tuple[int, ...]:
        """Layers whose normalized pre-attention input the producer's prefill must capture."""
        return ()

    def residual_layers(self) -> tuple[int, ...]:
        """Layers whose residual-stream input the producer's prefill must capture."""
        return ()

    @property
    def decides_after_prefill(self) -> bool:
        """Whether ``settings_for`` may change this method's settings once the prefill is known: the
        producer then sends the stream header (which carries the settings) after its prefill."""
        return False

    def settings_for(self, state: PrefillState, start: int) -> dict[str, str] | None:
        """Producer: the settings to serve this prompt with instead of this method's own (both sides
        make the method anew with them, from the header), or None to keep them."""
        return None

    @abstractmethod
    def encode_layer(self, state: PrefillState, layer: int, start: int) -> dict[str, torch.Tensor]:
        """Producer: the named tensors that carry ``layer`` for positions [start, n_tokens)."""

    @abstractmethod
    def schema(self, layer: int, job: DecodeJob) -> Schema:
        """The tensors ``encode_layer`` sends for ``layer`` of ``job``: names, dtypes, shapes. The
        consumer's frame decoder refuses any other tensor before allocating it, admission charges
        their bytes, and the session checks every layer against it before decoding."""

    def start(self, job: DecodeJob) -> DecodeSession:
        return self.Session(self, job)

    def pin(self) -> str:
        """A content hash of the per-pair data both sides of this method read (calibration
        artifacts, a profile), or "" when it reads none. The stream header carries the producer's;
        the consumer refuses a stream whose pin differs from its own (FAILED_PRECONDITION)."""
        return ""

    def calibration(self) -> str:
        """A content hash of what this side of the method reads of the pair's store: ``pin`` (both
        sides read it), unless the producer reads more (``ridge``'s maps, which its consumer never
        sees). Part of ``identity``, not of the handshake."""
        return self.pin()

    def _fingerprint(self, producer_fp: str, data: str) -> str:
        return f"{producer_fp}:{self.kind}.v{self.version}:{self.cfg.fingerprint()}:{data}"

    def pair_fingerprint(self, producer_fp: str) -> str:
        """The stream header's ``pair_fingerprint`` from the producer weights ``producer_fp``: those weights,
        this method's kind and version, its settings and ``pin`` (what the consumer checks)."""
        return self._fingerprint(producer_fp, self.pin())

    def identity(self, producer_fp: str) -> str:
        """What this method is, as served from the producer weights ``producer_fp``: ``pair_fingerprint``
        with ``calibration`` in place of the pin. ``scd eval --json`` records it for each method and a
        request's final timings give the requested method's: a KL measured by ``scd eval`` is this
        method's only where the two are equal (``scd bench`` checks)."""
        return self._fingerprint(producer_fp, self.calibration())

    def error_bound(self) -> float:
        """Declared bound on the relative error of reconstructed K/V against the producer's own
        (same model on both sides); 0 for lossless methods."""
        return 0.0
