"""The producer's side of a fast calibration, computed once per producer and reused by every new
consumer of it.

What depends only on the producer and the prompts: its pre-RoPE K/V of every layer on the
calibration prompts (the consumer pairs them with its own to fit the REUSE maps), the moments of
its normalized hidden states (the PCA bases of PATCH codes), and its full prefill state (K/V, hidden
and residual states of every layer) on the validation prompts. They live on the large-assets disk,
``$SCD_HOME/producer-cache/<producer fingerprint>-<key>/``, where the key hashes the prompts and
everything else that shapes the tensors; a different producer, other prompts or another format
version simply miss. The folder is written under a temporary name and renamed when complete, so an
interrupted build is rebuilt, never half read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from shared.model.fingerprint import weights_fingerprint
from shared.model.hf_adapter import ModelAdapter
from tools.calibration.linalg import Moments
from tools.calibration.memory import release_memory
from tools.calibration.spill import SpilledState

log = logging.getLogger(__name__)

FORMAT = 1
_DONE = "complete.json"


def cache_root() -> Path:
    from shared.paths import scd_home

    return scd_home() / "producer-cache"


@dataclass
class ProducerCache:
    """One producer's cached side for one set of calibration and validation prompts."""

    path: Path
    producer: ModelAdapter
    prompts: list[list[int]]  # calibration prompts, as traced (the last token is not a context token)
    val: list[tuple]  # validation prompts (ids, native prefix length[, held-out continuation])

    @classmethod
    def for_prompts(cls, producer: ModelAdapter, prompts: list[list[int]], val: list[tuple],
                    root: Path | None = None) -> "ProducerCache":
        fp = weights_fingerprint(producer.model)
        key = hashlib.sha256(json.dumps({"format": FORMAT, "producer": fp, "dtype": str(producer.dtype),
                                         "prompts": prompts, "val": val}).encode()).hexdigest()
        return cls((root or cache_root()) / f"{fp[:16]}-{key[:16]}", producer, prompts, val)

    @property
    def ready(self) -> bool:
        return (self.path / _DONE).exists()

    def build(self, progress: bool = True) -> None:
        """Run the producer over the calibration and validation prompts once and write its side."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        p = self.producer
        layers = list(range(p.n_layers))
        h = [Moments(p.hidden_size) for _ in layers]
        for i, ids in enumerate(tqdm(self.prompts, desc="producer cache: traces", disable=not progress)):
            sp = p.prefill(ids[:-1], hidden_layers=layers)
            save_file({f"{n}.{l}": t[l].detach().contiguous().cpu() for l in layers
                       for n, t in (("k", sp.keys), ("v", sp.values))}, tmp / f"cal-{i:05d}.safetensors")
            for l in layers:
                h[l].add(sp.hidden[l][0].cpu())
            del sp
            release_memory()
        save_file({**{f"sum.{l}": m.sum for l, m in enumerate(h)}, **{f"gram.{l}": m.gram for l, m in enumerate(h)},
                   "n": torch.tensor([h[0].n], dtype=torch.int64)}, tmp / "hidden-moments.safetensors")
        for i, (ids, *_) in enumerate(tqdm(self.val, desc="producer cache: validation", disable=not progress)):
            state = p.prefill(ids[:-1], hidden_layers=layers, residual_layers=layers)
            SpilledState(state, tmp / f"val-{i:05d}.safetensors", p.device)
            del state
            release_memory()
        (tmp / _DONE).write_text(json.dumps({"format": FORMAT, "n_prompts": len(self.prompts), "n_val": len(self.val)}))
        shutil.rmtree(self.path, ignore_errors=True)
        tmp.rename(self.path)
        log.info("producer cache written to %s", self.path)

    def kv(self, i: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Calibration prompt i's producer K and V, per layer."""
        with safe_open(self.path / f"cal-{i:05d}.safetensors", framework="pt", device="cpu") as f:
            n = self.producer.n_layers
            return [f.get_tensor(f"k.{l}") for l in range(n)], [f.get_tensor(f"v.{l}") for l in range(n)]

    def hidden_moments(self) -> list[Moments]:
        t = load_file(self.path / "hidden-moments.safetensors")
        out = []
        for l in range(self.producer.n_layers):
            m = Moments(self.producer.hidden_size)
            m.n, m.sum, m.gram = int(t["n"][0]), t[f"sum.{l}"], t[f"gram.{l}"]
            out.append(m)
        return out

    def val_states(self) -> list[SpilledState]:
        return [SpilledState.reopen(self.path / f"val-{i:05d}.safetensors", self.producer.device)
                for i in range(len(self.val))]
