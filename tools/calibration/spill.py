"""Validation prefill states spilled to disk, read back one tensor at a time.

Selection scores many configurations on the same validation prompts, and each needs the
producer's K/V, normalized hidden states and residual states of every layer of every prompt: held
in memory that is validation tokens x layers x (2 x kv_dim + 2 x hidden) floats (~4.4 GB for 24
prompts of ~1k tokens on a 135M model, ~40x that at 7B). Here each prompt's state is written once
to a safetensors file, and a configuration reads only the tensors it needs, when it needs them,
through a file opened for that read (its pages are not kept mapped), so peak memory grows with one
prompt's layer, not with the validation set.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared.model.hf_adapter import PrefillState

log = logging.getLogger("scd.calibration")


PREFIX = "scd-spill-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_orphans(parent: Path) -> list[Path]:
    """Remove the spill folders under ``parent`` whose process (the id in their name) is gone; the
    folders removed, each logged."""
    gone = []
    for d in parent.glob(f"{PREFIX}*-*"):
        pid = d.name[len(PREFIX):].split("-", 1)[0]
        if d.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            log.warning("removed %s: the spill folder of calibration process %s, which ended without removing it",
                        d, pid)
            gone.append(d)
    return gone


class SpillDir:
    """A temporary folder that is removed when the object is garbage-collected (or at exit). Its name
    holds this process's id: a calibration killed before it could remove its own (the OOM killer,
    SIGKILL) left gigabytes behind for good; the next one removes the folders of processes that are
    gone."""

    def __init__(self, parent: str | Path | None = None):
        if parent is None:  # beside the models (the large-assets disk), not in a possibly small /tmp
            from shared.paths import scd_home

            parent = scd_home() / "spill"
        Path(parent).mkdir(parents=True, exist_ok=True)
        remove_orphans(Path(parent))
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.path, True)

    def cleanup(self) -> None:
        self._finalizer()


class _Layers(Sequence):
    def __init__(self, st: "SpilledState", prefix: str, n: int):
        self._st, self._prefix, self._n = st, prefix, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, layer):
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(self._n))]
        if not -self._n <= layer < self._n:
            raise IndexError(layer)
        return self._st.tensor(f"{self._prefix}.{layer % self._n}")


class _ByLayer(Mapping):
    def __init__(self, st: "SpilledState", prefix: str, layers: list[int]):
        self._st, self._prefix, self._layers = st, prefix, layers

    def __getitem__(self, layer: int) -> torch.Tensor:
        if layer not in self._layers:
            raise KeyError(layer)
        return self._st.tensor(f"{self._prefix}.{layer}")

    def __iter__(self):
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)


class SpilledState:
    """A ``PrefillState`` whose tensors live in a safetensors file: ``keys[l]``, ``values[l]``,
    ``hidden[l]``, ``residual[l]`` each read from disk on access, onto ``device``."""

    def __init__(self, state: PrefillState, path: Path, device: torch.device):
        tensors = {f"k.{i}": k for i, k in enumerate(state.keys)}
        tensors.update({f"v.{i}": v for i, v in enumerate(state.values)})
        tensors.update({f"h.{i}": h for i, h in state.hidden.items()})
        tensors.update({f"r.{i}": r for i, r in state.residual.items()})
        for name, t in (("ids", state.token_ids), ("logits", state.last_logits)):
            if t is not None:
                tensors[name] = t
        save_file({k: t.detach().contiguous().cpu() for k, t in tensors.items()}, path)
        self._index(path, device)

    @classmethod
    def reopen(cls, path: Path, device: torch.device) -> "SpilledState":
        """A state spilled earlier (e.g. by another run: the producer cache), read from ``path``."""
        st = cls.__new__(cls)
        st._index(path, device)
        return st

    def _index(self, path: Path, device: torch.device) -> None:
        with safe_open(path, framework="pt", device="cpu") as f:
            names = set(f.keys())
            self.token_ids = f.get_tensor("ids") if "ids" in names else None
            self.last_logits = f.get_tensor("logits").to(device) if "logits" in names else None
            layers = lambda p: sorted(int(n.split(".")[1]) for n in names if n.startswith(p + "."))  # noqa: E731
            self.n_layers = len(layers("k"))
            self.n_tokens = f.get_slice("k.0").get_shape()[2]
        self.path, self.device = path, device
        self.keys = _Layers(self, "k", self.n_layers)
        self.values = _Layers(self, "v", self.n_layers)
        self.hidden = _ByLayer(self, "h", layers("h"))
        self.residual = _ByLayer(self, "r", layers("r"))

    def tensor(self, name: str) -> torch.Tensor:
        with safe_open(self.path, framework="pt", device="cpu") as f:
            t = f.get_tensor(name)
        return t.to(self.device)


def spill(state: PrefillState, folder: SpillDir, index: int, device: torch.device) -> SpilledState:
    return SpilledState(state, folder.path / f"{index:05d}.safetensors", device)


class KVMemo:
    """Per-prompt K/V of many layers computed once (a REUSE decode of every layer, a recomputed
    block) and kept on disk: ``get(tag, i, compute)`` writes ``compute()`` ({layer: (K, V)}) the first
    time and afterwards reads one layer at a time. Only the latest prompt's tensors stay in memory."""

    def __init__(self, folder: SpillDir, device: torch.device):
        self.folder, self.device = folder, device
        self._files: dict[tuple, Path] = {}
        self._n = 0  # files written so far: names are never reused, even after ``forget``
        self._last: tuple | None = None
        self._last_kv: dict = {}

    def get(self, tag: str, i: int, compute, keep: bool = True) -> Mapping[int, tuple[torch.Tensor, ...]]:
        """Prompt i's K/V of ``tag``; ``keep=False`` holds a new result only while prompt i is the
        latest one asked for (a configuration scored once), without writing it."""
        key = (tag, i)
        if key == self._last:
            return self._last_kv
        if key in self._files:
            kv: Mapping = _LazyKV(self._files[key], self.device)
        elif not keep:
            kv = compute()
        else:
            kv = compute()
            self._n += 1
            path = self.folder.path / f"memo-{self._n:06d}.safetensors"
            tensors = {f"{n}.{layer}": t.detach().contiguous().cpu() for layer, pair in kv.items()
                       for n, t in zip("kv", pair)}
            save_file(tensors, path)
            self._files[key] = path
        self._last, self._last_kv = key, kv
        return kv

    def forget(self, which) -> None:
        """Delete the entries whose tag is ``which`` (a string) or satisfies it (a predicate)."""
        match = which if callable(which) else (lambda tag: tag == which)
        for key in [k for k in self._files if match(k[0])]:
            self._files.pop(key).unlink(missing_ok=True)
        if self._last and match(self._last[0]):
            self._last, self._last_kv = None, {}


class _LazyKV(Mapping):
    def __init__(self, path: Path, device: torch.device):
        self.path, self.device = path, device
        with safe_open(path, framework="pt") as f:
            self._layers = sorted({int(k.split(".")[1]) for k in f.keys()})

    def __getitem__(self, layer: int):
        if layer not in self._layers:
            raise KeyError(layer)
        with safe_open(self.path, framework="pt", device="cpu") as f:
            return f.get_tensor(f"k.{layer}").to(self.device), f.get_tensor(f"v.{layer}").to(self.device)

    def __iter__(self):
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)
