import math

import torch

from tools.eval.metrics import kl_top1, normalize, rel_err, token_f1


def test_token_f1_squad_normalization():
    assert normalize("The  Eiffel Tower!") == ["eiffel", "tower"]
    assert token_f1("the Eiffel tower", "Eiffel Tower.") == 1.0
    assert token_f1("Paris", "London") == 0.0
    assert math.isclose(token_f1("Mount Kilimanjaro in Tanzania", "Mount Kilimanjaro"), 2 * 0.5 * 1 / 1.5)


def test_kl_zero_on_self_and_positive_otherwise():
    lp = torch.log_softmax(torch.randn(5, 11), -1)
    kl, top1 = kl_top1(lp, lp)
    assert torch.allclose(kl, torch.zeros(5), atol=1e-6) and bool(top1.all())
    other = torch.log_softmax(torch.randn(5, 11), -1)
    kl2, _ = kl_top1(lp, other)
    ref = (lp.exp() * (lp - other)).sum(-1)
    torch.testing.assert_close(kl2, ref)
    assert bool((kl2 > 0).all())


def test_rel_err():
    x = torch.ones(4)
    assert rel_err(x, x) == 0.0
    assert math.isclose(rel_err(2 * x, x), 1.0)
