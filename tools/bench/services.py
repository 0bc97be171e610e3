"""The real services as subprocesses, one per namespace: ``ip netns exec NS python -m tools.cli serve ...``.

They die with the benchmark (PR_SET_PDEATHSIG) and are stopped (SIGTERM, then SIGKILL) on every
exit path of the testbed."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.bench.netns import BenchError, Testbed

log = logging.getLogger(__name__)

CONSUMER_PORT, PRODUCER_PORT = 50052, 50051
REPO = Path(__file__).resolve().parents[2]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class ServiceSpec:
    consumer_name: str
    producer_model: str
    consumer_model: str
    store: str
    methods: tuple[str, ...]
    threads: int = 1
    prefill_cache_entries: int = 4
    prefill_cache_bytes: int = 8 << 30
    """Warm runs need every method's state of a prompt kept (10,000 tokens: up to ~1.9 GB each)."""
    device: str = "cpu"
    dtype: str = "float32"
    consumer_adapter: str | None = None
    extra_env: dict = field(default_factory=dict)


class Services:
    """Starts the consumer in the consumer namespace and the producer in the producer namespace,
    waits until both listen, and registers their shutdown with the testbed."""

    def __init__(self, tb: Testbed, spec: ServiceSpec, log_dir: Path):
        self.tb, self.spec, self.log_dir = tb, spec, log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.producer_address = f"{tb.client_addr}:{PRODUCER_PORT}"
        tb.cleanups.append(self.stop)

    def _env(self) -> dict:
        env = dict(os.environ)
        n = str(self.spec.threads)
        env.update(OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, PYTHONUNBUFFERED="1", **self.spec.extra_env)
        return env

    def _start(self, role: str, ns: str, args: list[str], name: str | None = None) -> None:
        """``scd serve ROLE ARGS`` in namespace ``ns``, known (logs, errors) as ``name`` (default: the role)."""
        cmd = [*self.tb.exec_prefix(ns), sys.executable, "-m", "tools.cli", "serve", role, *args]
        role = name or role
        path = self.log_dir / f"{role}.log"
        self.logs[role] = path
        log.info("starting %s: %s", role, " ".join(cmd))
        with open(path, "wb") as out:
            self.procs[role] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=self._env(),
                                                start_new_session=True, preexec_fn=_die_with_parent)

    def start(self, timeout_s: float = 600.0) -> "Services":
        s, tb = self.spec, self.tb
        common = ["--set", f"methods=[{','.join(s.methods)}]", "--set", "server.grace_s=1", "--set",
                  "bench.hold_layers=true",
                  "--set", f"model.device={s.device}", "--set", f"model.dtype={s.dtype}", "--store", s.store]
        self._start("consumer", tb.consumer_ns, [
            "--name", s.consumer_name, "--model", s.consumer_model,
            *(["--adapter", s.consumer_adapter] if s.consumer_adapter else []), "--host", tb.consumer_addr,
            "--port", str(CONSUMER_PORT), *common])
        self.wait_listening(timeout_s)  # before the producer: see wait_listening
        self._start("producer", tb.producer_ns, [
            "--consumer", f"{s.consumer_name}={tb.consumer_addr}:{CONSUMER_PORT}", "--model", s.producer_model,
            "--host", tb.client_addr, "--port", str(PRODUCER_PORT), "--set", f"default_method={s.methods[0]}",
            "--set", f"prefill_cache_entries={s.prefill_cache_entries}",
            "--set", f"prefill_cache_bytes={s.prefill_cache_bytes}", *common])
        return self.wait_listening(timeout_s)

    def wait_listening(self, timeout_s: float):
        """Wait until every started service logs that it listens; a service that exits first, or a
        timeout, is a BenchError with the log's tail. Consumers must listen before the producer
        starts: the producer probes them at start-up, and a channel whose first connection was
        refused sits in gRPC's reconnect backoff, failing requests at once (UNAVAILABLE) until it
        retries, which under load outlasted the first request."""
        t0 = time.monotonic()
        waiting = set(self.procs)
        while waiting:
            for role in list(waiting):
                p = self.procs[role]
                if p.poll() is not None:
                    raise BenchError(f"the {role} exited ({p.returncode}) while starting:\n{self.tail(role)}")
                if "listening on" in self.logs[role].read_text(errors="replace"):
                    waiting.discard(role)
            if time.monotonic() - t0 > timeout_s:
                raise BenchError(f"{sorted(waiting)} not listening after {timeout_s:.0f} s:\n" +
                                 "\n".join(self.tail(r) for r in waiting))
            time.sleep(0.2)
        log.info("services up in %.1f s", time.monotonic() - t0)
        return self

    def tail(self, role: str, n: int = 30) -> str:
        try:
            lines = self.logs[role].read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"  [{role}] {line}" for line in lines[-n:])

    def check_alive(self) -> None:
        for role, p in self.procs.items():
            if p.poll() is not None:
                raise BenchError(f"the {role} exited ({p.returncode}):\n{self.tail(role)}")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)
