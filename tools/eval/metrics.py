"""Quality metrics of method.md: token F1 (SQuAD normalization), teacher-forced KL and top-1."""

from __future__ import annotations

import collections
import re
import string

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize(text: str) -> list[str]:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    return _ARTICLES.sub(" ", text).split()


def token_f1(pred: str, ref: str) -> float:
    p, r = normalize(pred), normalize(ref)
    if not p and not r:
        return 1.0
    common = sum((collections.Counter(p) & collections.Counter(r)).values())
    if common == 0:
        return 0.0
    prec, rec = common / len(p), common / len(r)
    return 2 * prec * rec / (prec + rec)


def kl_top1(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(ref ‖ method) in nats and top-1 agreement, from log-probs [N, V]."""
    kl = (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum(-1).clamp_min(0)
    top1 = (ref_logprobs.argmax(-1) == logprobs.argmax(-1)).float()
    return kl, top1


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12))
