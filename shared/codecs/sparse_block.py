"""SCD's token-sparse PATCH block (``block_tokens`` < 1), the consumer's side: each block layer runs
for the chosen positions as soon as its codes arrive, over the other positions' REUSE K/V corrected
by a ridge map per KV head fitted on this prompt's recomputed positions, plus what that map still
misses at the recomputed positions next to them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shared.codecs.selective_recompute import BlockSession
from shared.errors import InvalidPayload


class SparseBlock(BlockSession):
    """The token-sparse block's part of ``SCDSession`` (whose method is ``SCD``)."""

    _sparse: "_SparseState | None" = None

    def sparse_layer(self, layer, tensors, block):
        """One layer of a token-sparse block, run as soon as its codes arrive: the selected positions
        are recomputed over the others' REUSE K/V (the native prefix's own K/V where the consumer
        has them), which ``block_fit=heads`` first corrects per KV head by a ridge map fitted on
        this prompt's recomputed positions (their REUSE K/V to their own, captured as the layer
        runs). At the block's entry the positions and their residual-stream states arrive: the
        producer chose them (``block_select=producer``: the top of its attention from the prompt's
        last tokens, summed over the block's layers, and always the last 16), or with
        ``block_select=attention`` the consumer chooses from its projections of the entry state."""
        cfg, s = self.method, self.job.start
        if layer == block[0]:
            self._sparse = self.start_sparse(tensors, block)
        sp = self._sparse
        assert sp is not None
        k, v = self.with_prefix(layer, *cfg._reuse(layer, tensors))
        correct = self.corrector(sp) if sp.fits else None
        sp.x, k, v = sp.run.step(sp.x, layer, k, v, correct)
        return k[:, :, s:], v[:, :, s:]

    def start_sparse(self, tensors, block) -> "_SparseState":
        from shared.model.sparse import SparseLayers

        a, b = block
        m, cfg = self.model, self.method
        n, s = self.job.n_tokens, self.job.start
        if cfg.sends_positions:
            idx = tensors["pos"].to(m.device).long()
            if not (bool((idx[1:] > idx[:-1]).all()) and int(idx[0]) >= s and int(idx[-1]) < n):
                raise InvalidPayload(f"{cfg.kind} block {a}-{b}: the recomputed positions must be increasing and "
                                     f"within [{s}, {n})")
            x = cfg._uncode(tensors, "r", m.hidden_size)
            if cfg.entry_map:
                x = cfg.map_entry(x, a, idx)
        else:
            h = self.entry_state(tensors, block)
            self.check_entry(h, block)
            h = h.to(m.device, m.dtype)
            idx = cfg.top_positions(m.attention_mass(a, h.unsqueeze(0), 32), s)
            x = h[idx]
        fits = cfg.block_fit == "heads" and len(idx) < n - s
        near = neighbours(idx, n, cfg.block_fit_span, cfg.block_fit_prior) if fits and cfg.block_fit_span > 0 else None
        return _SparseState(idx, x.to(m.device, m.dtype).unsqueeze(0), SparseLayers(m, idx, n), fits, near)

    def sparse_exit(self, layer, tensors):
        """The layer after a token-sparse block: the recomputed positions' native K/V from their block
        output state, the others' from their codes, corrected by the same per-prompt fit."""
        sp, s = self._sparse, self.job.start
        assert sp is not None
        k, v = self.with_prefix(layer, *self.decode_outside(layer, tensors))
        nk, nv = self.model.kv_from_residual(layer, sp.x)
        if sp.fits:
            k, v = self.corrector(sp)(k, v, nk, nv)  # new tensors, the recomputed rows already native
        else:
            k, v = k.clone(), v.clone()
            k[:, :, sp.idx], v[:, :, sp.idx] = nk.to(k.dtype), nv.to(v.dtype)
        self._sparse = None
        return k[:, :, s:], v[:, :, s:]

    def corrector(self, sp: "_SparseState"):
        """K/V [1, H, T, D] with the rows after the native prefix mapped per KV head by the ridge fit
        of the recomputed rows ``sp.idx`` on the native K/V given for them ([1, H, S, D]), and (with
        ``block_fit_span`` > 0) the fit's residuals at the recomputed rows added to their neighbours."""
        lam, start, idx, near = self.method.block_fit_lambda, self.job.start, sp.idx, sp.near

        def correct(k, v, nk, nv):
            out = []
            for given, native in ((k, nk), (v, nv)):
                fit = heads_ridge(given[0], idx, native[0], lam, near)
                fit[:, :start] = given[0, :, :start]
                out.append(fit.unsqueeze(0))
            return out[0], out[1]

        return correct


@dataclass
class _SparseState:
    idx: torch.Tensor  # the recomputed positions [S], sorted
    x: torch.Tensor  # their residual-stream states [1, S, d] at the next layer's input
    run: Any  # SparseLayers
    fits: bool  # ``block_fit=heads`` and some positions are not recomputed: their K/V get the per-prompt fit
    near: torch.Tensor | None = None  # ``neighbours``: the weights with which each row takes the residuals


def neighbours(idx: torch.Tensor, n: int, span: float, prior: float, per_side: int = 2) -> torch.Tensor:
    """The weights [n, len(idx)] (sparse, COO) with which each of ``n`` positions takes the residuals at
    the recomputed positions ``idx`` (sorted): for the ``per_side`` nearest on each side,
    exp(-distance / ``span``) over (their sum + ``prior``), weights below 1e-4 dropped. A position
    next to recomputed ones takes nearly their mean residual; one farther than a few ``span`` from any
    takes none, as the weights' sum falls below ``prior``. Computed once per prompt: the positions are
    the same at every block layer."""
    pos = torch.arange(n, device=idx.device)
    right = torch.searchsorted(idx, pos)  # the first recomputed position at or after each position
    cand = right.unsqueeze(1) + torch.arange(-per_side, per_side, device=idx.device)  # [n, 2 * per_side]
    valid = (cand >= 0) & (cand < len(idx))
    cand = cand.clamp(0, len(idx) - 1)
    w = torch.exp(-(pos.unsqueeze(1) - idx[cand]).abs().float() / span) * valid
    w = w / (w.sum(1, keepdim=True) + prior)
    keep = w >= 1e-4
    rows = pos.unsqueeze(1).expand_as(cand)[keep]
    weights = torch.sparse_coo_tensor(torch.stack([rows, cand[keep]]), w[keep], (n, len(idx)), check_invariants=True)
    return weights.coalesce()


def heads_ridge(given: torch.Tensor, idx: torch.Tensor, target: torch.Tensor, lam: float,
                near: torch.Tensor | None = None) -> torch.Tensor:
    """``given`` [H, T, D] mapped per head by the affine map fitted on ``given[:, idx]`` -> ``target``
    [H, S, D]: the identity plus a ridge-regularized linear correction (penalty ``lam`` times the
    mean of the centred Gram's diagonal), so that with few samples it stays near the rows as given.
    With ``near`` (``neighbours``), each row also takes the weighted residuals of the map at the
    selected rows near it (the drift the map misses is shared by neighbouring tokens). The selected
    rows get ``target`` itself. Solved in float32 whatever the model's dtype; every head in one
    batched solve."""
    dtype, rows = given.dtype, given.float()
    x, y = rows[:, idx], target.float()
    mx, my = x.mean(1, keepdim=True), y.mean(1, keepdim=True)
    xc = x - mx
    g = xc.transpose(1, 2) @ xc  # [H, D, D]
    ridge = lam * g.diagonal(dim1=1, dim2=2).mean(1).clamp_min(1e-12)
    g = g + ridge.view(-1, 1, 1) * torch.eye(g.shape[-1], dtype=g.dtype, device=g.device)
    w = torch.linalg.solve(g, xc.transpose(1, 2) @ (y - my - xc))
    out = rows + (rows - mx) @ w + (my - mx)
    if near is not None:
        heads, width = y.shape[0], y.shape[2]
        res = (y - out[:, idx]).transpose(0, 1).reshape(len(idx), heads * width)  # [S, H*D]
        out = out + (near @ res).view(-1, heads, width).transpose(0, 1)
    out[:, idx] = y
    return out.to(dtype)

