"""`scd anatomy` on the tiny pair, whose consumer differs from the producer only in layer 2's K/V
projections: the probes must find the drift exactly there."""

import pytest
import torch

from tools.eval import anatomy


def test_anatomy_locates_the_drift_of_the_tiny_pair(tiny_pair):
    producer, consumer = tiny_pair
    g = torch.Generator().manual_seed(21)
    cal = [torch.randint(0, 256, (40,), generator=g).tolist() for _ in range(6)]
    val = [(torch.randint(0, 256, (36,), generator=g).tolist(), 0) for _ in range(3)]
    res = anatomy.run(producer, consumer, cal, val, stop_ids=(), ranges=((0, 2), (2, 4)), single=(2,),
                      blocks=((2, 4), (3, 4)), progress=False)
    assert res["raw"] > 1e-3
    assert res["own K/V on layers 0-1"] == pytest.approx(res["raw"], abs=1e-6)  # identical layers
    assert res["own K/V on layers 2-3"] < 1e-5  # every difference is there
    assert res["own K/V on layer 2"] < res["raw"]
    # layers 0-1 are shared, so the producer's residual at 2 is the consumer's: recompute is exact
    assert res["consumer recomputes 2-3 from the producer's residual"] < 1e-5
    assert res["consumer recomputes 3-3 from the producer's residual"] > 1e-4
    assert {"ridge map K/V -> K/V, every layer", "ridge map h_l -> K/V, every layer"} <= set(res)
