"""What requests free goes back to the system (issue 58: a consumer's RSS grew with every stream and
did not come back, with no Python object left: glibc's arenas kept the freed tensors' memory)."""

import os

import pytest
import torch

from shared import memory


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(memory._TRIM is None, reason="not glibc: nothing to release")
def test_freed_tensors_memory_goes_back_to_the_system():
    # 200 MB in tensors under glibc's mmap threshold (they live in the heap), the last one kept: the
    # heap's top stays in use, so free() alone cannot give the rest back
    xs = [torch.ones(25_000) for _ in range(2_000)]
    keep = xs[-1]
    del xs
    before = rss_mb()
    assert memory.release_freed(force=True)
    after = rss_mb()
    assert before - after > 100, (before, after)
    assert keep.sum() == 25_000
    assert not memory.release_freed()  # at most once per MIN_INTERVAL_S
