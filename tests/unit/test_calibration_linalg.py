import torch

from tools.calibration.linalg import Moments, fit_reuse, pca, ridge, top_eig


def test_ridge_recovers_a_planted_map():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 12, generator=g, dtype=torch.float64)
    w = torch.randn(12, 5, generator=g, dtype=torch.float64)
    y = x @ w + 0.01 * torch.randn(4000, 5, generator=g, dtype=torch.float64)
    m = Moments(17)
    m.add(torch.cat([x, y], 1))
    c = m.cov(center=False)
    w_hat = ridge(c[:12, :12], c[:12, 12:], 1e-8)
    torch.testing.assert_close(w_hat, w, atol=2e-3, rtol=0)


def test_truncated_svd_error_equals_tail_singular_values():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(500, 10, generator=g, dtype=torch.float64) @ torch.randn(10, 10, generator=g, dtype=torch.float64)
    m = Moments(10)
    m.add(z)
    _, s, vh = torch.linalg.svd(z, full_matrices=False)
    vals, vecs = top_eig(m.cov(center=False), 4)
    torch.testing.assert_close(vals * 500, s[:4] ** 2)
    err = ((z - z @ vecs @ vecs.T) ** 2).sum()
    torch.testing.assert_close(err, (s[4:] ** 2).sum())


def test_moments_accumulate_like_one_batch():
    x = torch.randn(300, 6, dtype=torch.float64)
    a, b = Moments(6), Moments(6)
    a.add(x)
    b.add(x[:100])
    b.add(x[100:])
    torch.testing.assert_close(a.cov(), b.cov())
    torch.testing.assert_close(a.cov(), torch.cov(x.T, correction=0))


def test_full_rank_reuse_is_the_ridge_map_and_low_rank_is_worse():
    g = torch.Generator().manual_seed(2)
    xp = torch.randn(5000, 8, generator=g) * torch.linspace(3, 0.1, 8) + 2.0
    xc = xp @ (torch.eye(8) + 0.3 * torch.randn(8, 8, generator=g)) + 0.05 * torch.randn(5000, 8, generator=g) - 1.0
    m = Moments(16)
    m.add(torch.cat([xp, xc], 1))
    full = fit_reuse(m, 8, 8, ridge_rel=1e-9)
    pred = (xp - full.mu_p) @ full.enc @ full.dec + full.mu_c
    emp = float(((xc - pred).norm() / xc.norm()))
    assert abs(emp - full.rel_err) < 1e-3 and full.rel_err < 0.02
    low = fit_reuse(m, 8, 3)
    assert low.rel_err > full.rel_err and 0 < low.var_explained < full.var_explained <= 1.0 + 1e-9


def test_pca_projection_is_orthonormal():
    x = torch.randn(1000, 9) @ torch.randn(9, 9)
    m = Moments(9)
    m.add(x)
    w, mu, ve = pca(m, 4)
    torch.testing.assert_close(w.T @ w, torch.eye(4), atol=1e-5, rtol=0)
    assert 0 < ve < 1
