"""The PATCH aligner: a small MLP from a producer hidden-state code to the consumer's own
normalized pre-attention input. Lives with the codecs because the consumer runs it online;
calibration trains it (``tools/calibration/aligner.py``)."""

from __future__ import annotations

import torch
from torch import nn


class Aligner(nn.Module):
    """f(u) = mu + u A + W2 gelu(W1 u + b1): a linear map plus a non-linear correction."""

    def __init__(self, r: int, d: int, hidden: int):
        super().__init__()
        self.linear = nn.Linear(r, d)
        self.up = nn.Linear(r, hidden)
        self.down = nn.Linear(hidden, d)
        nn.init.zeros_(self.down.weight)
        nn.init.zeros_(self.down.bias)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.linear(u) + self.down(nn.functional.gelu(self.up(u)))

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> "Aligner":
        r, d = state["linear.weight"].shape[1], state["linear.weight"].shape[0]
        m = cls(r, d, state["up.weight"].shape[0])
        m.load_state_dict(state)
        return m.eval()
