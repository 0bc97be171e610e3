"""Train a PATCH aligner with an L2 feature-matching loss (full-batch AdamW; seconds on CPU)."""

from __future__ import annotations

import torch

from shared.codecs.aligner import Aligner


def train_aligner(u: torch.Tensor, target: torch.Tensor, hidden: int = 512, steps: int = 400, lr: float = 3e-3,
                  weight_decay: float = 1e-4, seed: int = 0, val_frac: float = 0.1) -> tuple[Aligner, dict]:
    """Fit f(u) ≈ target. Returns the aligner and {train_rel_err, val_rel_err} (relative L2)."""
    torch.manual_seed(seed)
    u, target = u.float(), target.float()
    n_val = max(1, int(len(u) * val_frac))
    perm = torch.randperm(len(u), generator=torch.Generator().manual_seed(seed))
    vi, ti = perm[:n_val], perm[n_val:]
    model = Aligner(u.shape[1], target.shape[1], hidden)
    with torch.no_grad():  # start from the least-squares linear map
        x = torch.cat([u[ti], torch.ones(len(ti), 1)], 1)
        sol = torch.linalg.lstsq(x, target[ti]).solution
        model.linear.weight.copy_(sol[:-1].T)
        model.linear.bias.copy_(sol[-1])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(steps):
        loss = ((model(u[ti]) - target[ti]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    with torch.no_grad():
        rel = lambda idx: float((model(u[idx]) - target[idx]).norm() / target[idx].norm())  # noqa: E731
        return model, {"train_rel_err": rel(ti), "val_rel_err": rel(vi)}
