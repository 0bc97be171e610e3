"""Closed-form pieces of calibration: running second moments, ridge, the REUSE joint-SVD code.

Everything is fit from accumulated moments (float64), so traces never have to fit in memory:
a layer's K statistics are one 384x384 matrix however many tokens were seen."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class Moments:
    """Running mean and second moment of rows [N, n] (float64)."""

    def __init__(self, dim: int):
        self.n = 0
        self.sum = torch.zeros(dim, dtype=torch.float64)
        self.gram = torch.zeros(dim, dim, dtype=torch.float64)

    def add(self, x: torch.Tensor) -> None:
        """Add a batch of rows: the batch's product runs in its own dtype (fast fp32 matmul), the
        running sums are float64."""
        x = x.reshape(-1, x.shape[-1])
        self.n += x.shape[0]
        self.sum += x.sum(0, dtype=torch.float64)
        self.gram += (x.T @ x).to(torch.float64)

    def sub(self, idx: torch.Tensor) -> "Moments":
        """The moments of a subset of the columns."""
        out = Moments(len(idx))
        out.n, out.sum, out.gram = self.n, self.sum[idx].clone(), self.gram[idx][:, idx].clone()
        return out

    @property
    def mean(self) -> torch.Tensor:
        return self.sum / max(self.n, 1)

    def cov(self, center: bool = True) -> torch.Tensor:
        second = self.gram / max(self.n, 1)
        if not center:
            return second
        mu = self.mean
        return second - torch.outer(mu, mu)


def ridge(cxx: torch.Tensor, cxy: torch.Tensor, lam: float) -> torch.Tensor:
    """argmin_W E||y - x W||^2 + lam ||W||^2 from moments: (Cxx + lam I)^-1 Cxy."""
    eye = torch.eye(cxx.shape[0], dtype=cxx.dtype)
    return torch.linalg.solve(cxx + lam * eye, cxy)


def top_eig(c: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-r eigenpairs of a symmetric PSD matrix, descending: (values [r], vectors [n, r]).
    For C = Z^T Z / N these are the squared singular values / N and right singular vectors of Z."""
    vals, vecs = torch.linalg.eigh(c)
    vals, vecs = vals.flip(0).clamp_min(0), vecs.flip(1)
    return vals[:r], vecs[:, :r]


@dataclass
class ReuseMap:
    """x_c ≈ mu_c + ((x_p - mu_p) @ enc) @ dec, with codes (x_p - mu_p) @ enc of width r."""

    enc: torch.Tensor  # [m, r]
    dec: torch.Tensor  # [r, m]
    mu_p: torch.Tensor  # [m]
    mu_c: torch.Tensor  # [m]
    var_explained: float  # of the joint [X_p | X_c] by the r-dim shared subspace
    rel_err: float  # sqrt(E||x_c - x̂_c||^2 / E||x_c||^2) on the calibration moments


def fit_reuse(joint: Moments, m: int, r: int, ridge_rel: float = 1e-3, center: bool = True) -> ReuseMap:
    """REUSE for one layer and one of K/V from the moments of Z = [x_p | x_c] (N x 2m).

    The shared code is the top-r right singular subspace V_r of Z; the encoder is the ridge map
    x_p -> Z V_r and the decoder the ridge map from the *encoded* code x_p E back to x_c (fit on
    what the consumer will actually receive)."""
    c = joint.cov(center)
    mu = joint.mean if center else torch.zeros(2 * m, dtype=torch.float64)
    cpp, cpc, ccc = c[:m, :m], c[:m, m:], c[m:, m:]
    vals, vr = top_eig(c, r)
    total = torch.trace(c).clamp_min(1e-30)
    lam_p = ridge_rel * float(torch.trace(cpp)) / m
    enc = ridge(cpp, c[:m] @ vr, lam_p)  # [m, r]
    czz = enc.T @ cpp @ enc
    lam_z = ridge_rel * float(torch.trace(czz)) / r
    dec = ridge(czz, enc.T @ cpc, lam_z)  # [r, m]
    a = enc @ dec  # effective linear map [m, m]
    err = torch.trace(ccc) - 2 * torch.trace(a.T @ cpc) + torch.trace(a.T @ cpp @ a)
    second_c = torch.trace(ccc) + (mu[m:] @ mu[m:] if center else 0.0)
    return ReuseMap(enc.float(), dec.float(), mu[:m].float(), mu[m:].float(),
                    float(vals.sum() / total), float((err.clamp_min(0) / second_c).sqrt()))


def pca(mom: Moments, r: int, center: bool = True) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(projection [d, r], mean [d], variance explained) of the rows behind ``mom``."""
    c = mom.cov(center)
    vals, vecs = top_eig(c, r)
    mu = mom.mean if center else torch.zeros(c.shape[0], dtype=torch.float64)
    return vecs.float(), mu.float(), float(vals.sum() / torch.trace(c).clamp_min(1e-30))


def fit_entry_map(producer, consumer, prompts: list[list[int]], layer: int, lam: float, max_tokens: int = 1024,
                  progress: bool = True) -> dict[str, torch.Tensor]:
    """The consumer-side artifact tensors of a PATCH block's entry map at ``layer``: the ridge map
    from the producer's residual-stream state to the consumer's own at that layer, fitted on
    ``prompts`` (the identity plus a correction, penalty ``lam`` times the mean variance). The first
    position (the attention sink, whose state is orders of magnitude larger) is not fitted and is
    not mapped (``SCD.map_entry``)."""
    from tqdm import tqdm

    d = producer.hidden_size
    mom = Moments(2 * d)
    for ids in tqdm(prompts, desc="entry map", disable=not progress):
        ids = ids[:max_tokens]
        xp = producer.prefill(ids, residual_layers=[layer]).residual[layer][0, 1:].float()
        xc = consumer.prefill(ids, residual_layers=[layer]).residual[layer][0, 1:].float()
        mom.add(torch.cat([xp, xc], 1).cpu())
    c, mu = mom.cov(), mom.mean
    cxx, cxy = c[:d, :d], c[:d, d:]
    w = ridge(cxx, cxy - cxx, lam * float(cxx.diagonal().mean()))
    return {f"entry.w.{layer}": w.half(), f"entry.mu_p.{layer}": mu[:d].half(), f"entry.mu_c.{layer}": mu[d:].half()}
