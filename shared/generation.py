"""Token-by-token generation from a prepared cache: sampling, stop conditions, text deltas.

Runs one step per call so that a service can interleave requests and stream each token."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.model.hf_adapter import ModelAdapter


def fresh_seed() -> int:
    """A seed for a request that names none: each such request samples differently."""
    return secrets.randbits(63)


class Sampling(BaseModel):
    """Validated sampling settings (what a request asks for)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=10.0, allow_inf_nan=False)
    """0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: tuple[str, ...] = ()
    seed: int = Field(0, ge=0)

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in stop) or len(stop) > 16 or any(len(s) > 256 for s in stop):
            raise ValueError("send at most 16 stop strings of 1 to 256 characters")
        return stop


def sample(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> int:
    if s.temperature == 0.0:
        return int(logits.argmax())
    logits = logits.float()
    # less the largest first: a tiny temperature then sends the others to -inf, not the largest to +inf
    # (inf - inf is NaN: 1e-40 failed every request)
    probs = torch.softmax((logits - logits.max()) / s.temperature, dim=-1)
    if s.top_p < 1.0:
        sp, idx = probs.sort(descending=True)
        keep = sp.cumsum(0) - sp < s.top_p
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sp[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


@dataclass
class Step:
    token_id: int
    text: str  # text delta
    finish_reason: str  # "", "stop", "length"


@dataclass
class Generator:
    """Incremental decoding over ``cache``; call ``step()`` until ``finished``."""

    model: ModelAdapter
    cache: Any  # a transformers Cache
    next_id: int  # the last prompt token (its K/V is not in the cache, unless ``first_logits`` is given)
    sampling: Sampling
    tokenizer: Any  # a transformers tokenizer, or None (token ids only)
    stop_ids: frozenset[int] = frozenset()
    first_logits: torch.Tensor | None = None
    """The logits that predict the first token when the cache already holds the whole prompt (the
    Oracle's own prefill); the first step then runs no forward pass and ``next_id`` is not fed."""
    tokens: list[int] = field(default_factory=list)
    """The answer's tokens (a stop token is left out: it is not text)."""
    sampled: int = 0
    """Every token sampled, a stop token included: the usage's ``completion_tokens``, as vLLM counts."""
    finished: bool = False
    _emitted: str = ""
    _gen: torch.Generator | None = None

    def __post_init__(self):
        if self.sampling.temperature > 0:
            self._gen = torch.Generator().manual_seed(self.sampling.seed)

    def _stop_prefix(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins a stop string (0: none)."""
        return max((k for s in self.sampling.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)

    def _text(self) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    @torch.inference_mode()
    def step(self) -> Step:
        if self.first_logits is not None:
            logits, self.first_logits = self.first_logits, None
        else:
            logits = self.model.forward_with_cache(self.cache, [self.next_id])[0, -1]
        tok = sample(logits, self.sampling, self._gen)
        self.next_id = tok
        self.sampled += 1
        self.tokens.append(tok)
        finish = ""
        if tok in self.stop_ids:
            finish = "stop"
            self.tokens.pop()
        text = self._text()
        for s in self.sampling.stop:
            if s in text:
                text, finish = text[: text.index(s)], "stop"
        if not finish and len(self.tokens) >= self.sampling.max_new_tokens:
            finish = "length"
        if not finish and text.endswith("\ufffd"):
            delta = ""  # an incomplete UTF-8 sequence: wait for the next token
        else:
            if not finish:  # hold back what may be the start of a stop string: it is never to be sent
                text = text[: len(text) - self._stop_prefix(text)]
            delta = text[len(self._emitted):] if text.startswith(self._emitted) else ""
            self._emitted = text if delta or text.startswith(self._emitted) else self._emitted
        self.finished = bool(finish)
        return Step(tok, delta, finish)
