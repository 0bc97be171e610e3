"""A model's weight fingerprint.

A model loaded from a folder (``shared.model.loading.load_model``) carries the fingerprint of its
stored tensors (``model.scd_fingerprint``): the same whatever dtype or device it was loaded in, so
artifacts calibrated in fp32 on a CPU serve a bf16 model on a GPU. A model built in memory (the
tiny test models) is fingerprinted from its parameters in fp32, name-sorted.
"""

from __future__ import annotations

import hashlib

import torch


@torch.inference_mode()
def weights_fingerprint(model: torch.nn.Module) -> str:
    stored = getattr(model, "scd_fingerprint", None)
    if stored:
        return stored
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
