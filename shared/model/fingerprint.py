"""A model's weight fingerprint: sha256 over its parameters in fp32, name-sorted.

Independent of device and load dtype round-trips of fp32 weights, so a producer on CUDA and a
calibration on CPU agree. Takes about a second for a 135M model.
"""

from __future__ import annotations

import hashlib

import torch


@torch.inference_mode()
def weights_fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
