"""Calibration's memory: the measured peak resident set per stage, and a model of what a pair of a
given size needs (so an operator can tell before starting whether a 7B pair fits).

After the spill (``tools.calibration.spill``) nothing grows with validation tokens x layers: what
remains is both models' weights, the per-layer second moments of the traces (float64), the sampled
hidden-state rows the aligners train on, one prompt's prefill states at a time, and the Oracle's
teacher-forced log-probs of the validation set."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import resource
import threading
import time


def rss_bytes() -> int:
    """This process's resident set now (Linux /proc), else its peak so far."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


def release_memory() -> None:
    """Give freed heap pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Calibration interleaves long-lived small tensors (moments, row samples, log-probs) with large
    per-prompt transients of varying size; glibc keeps the freed transients' pages, so the resident
    set grew by ~35 MB per calibration prompt on SmolLM2 (3.5 GB after 48 prompts, 2.1 GB with a trim
    after each prompt, at the same speed)."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)


class PeakRSS:
    """Samples the resident set every ``interval`` seconds in a daemon thread; ``take()`` returns
    the peak in MB since the previous ``take()`` (a stage's peak)."""

    def __init__(self, interval: float = 0.05):
        self._peak = rss_bytes()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            now = rss_bytes()
            with self._lock:
                self._peak = max(self._peak, now)

    def take(self) -> float:
        now = rss_bytes()
        with self._lock:
            peak, self._peak = max(self._peak, now), now
        return round(peak / 2**20, 1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)


def estimate(n_params: int, n_layers: int, kv_dim: int, hidden: int, vocab: int, prompt_tokens: int,
             n_val: int = 24, val_tokens: int = 32, aligner_rows: int = 4096, weight_bytes: int = 4) -> dict:
    """Peak memory (MB) of ``scd calibrate`` for a pair of this size, by component. ``prompt_tokens``
    is the longest calibration or validation prompt; weights are held in ``weight_bytes`` per
    parameter (4: fp32 on CPU, 2: bf16 on a GPU, where they live in GPU memory instead)."""
    mb = 2**20
    parts = {
        "weights (both models)": 2 * n_params * weight_bytes / mb,
        "trace moments, float64": n_layers * ((4 * kv_dim) ** 2 + hidden ** 2) * 8 / mb,
        "aligner row samples": n_layers * 2 * aligner_rows * hidden * 4 / mb,
        "one prompt's prefill states (both models)": 2 * prompt_tokens * n_layers * (2 * kv_dim + 2 * hidden) * 4 / mb,
        "one scoring cache": prompt_tokens * n_layers * 2 * kv_dim * 4 / mb,
        "Oracle log-probs of the validation set": n_val * val_tokens * vocab * 4 / mb,
    }
    parts = {k: round(v, 1) for k, v in parts.items()}
    parts["total"] = round(sum(parts.values()), 1)
    return parts


def timed_stages(report: dict, rss: PeakRSS):
    """A ``stage(name, t0) -> now`` function recording each stage's seconds and peak RSS in ``report``."""
    def stage(name: str, t0: float) -> float:
        import logging

        now = time.perf_counter()
        report.setdefault("stage_seconds", {})[name] = round(now - t0, 2)
        report.setdefault("peak_rss_mb", {})[name] = rss.take()
        logging.getLogger("tools.calibration").info("stage %s: %.1f s, peak RSS %.0f MB", name, now - t0,
                                                     report["peak_rss_mb"][name])
        return now
    return stage
