import torch

from shared.codecs.aligner import Aligner
from tools.calibration.aligner import train_aligner


def test_aligner_overfits_a_small_batch():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(32, 8, generator=g)
    target = torch.tanh(u @ torch.randn(8, 16, generator=g)) * 3 + u.pow(2) @ torch.randn(8, 16, generator=g)
    model, rep = train_aligner(u, target, hidden=128, steps=1500, lr=1e-2, weight_decay=0.0, val_frac=0.01)
    assert rep["train_rel_err"] < 0.05, rep
    x = torch.cat([u, torch.ones(32, 1)], 1)
    linear_only = float((x @ torch.linalg.lstsq(x, target).solution - target).norm() / target.norm())
    assert linear_only > 0.1 and rep["train_rel_err"] < linear_only / 2


def test_aligner_state_round_trips():
    a = Aligner(4, 6, 10)
    b = Aligner.from_state({k: v.clone() for k, v in a.state_dict().items()})
    u = torch.randn(3, 4)
    torch.testing.assert_close(a(u), b(u))
