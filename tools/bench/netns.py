"""Two Linux network namespaces joined by a rate-limited veth pair: the benchmark's two "hosts".

::

    root namespace          producer namespace (scdb-p-PID)        consumer namespace (scdb-c-PID)
    scdbPIDr 10.251.X.5 --- scdbPIDq 10.251.X.6
      (client link, not shaped)  scdbPIDp 10.251.X.1 ===================== scdbPIDc 10.251.X.2
                                           (the link: tbf rate on both directions' egress)

The producer -> consumer link is the one under test: a token-bucket filter (``tc qdisc tbf``) on
the egress of both of its ends sets its rate, and ``netem`` (when the kernel has it) adds a one-way
delay. The client reaches the producer through a second, unshaped veth from the root namespace.
Addresses come from a /24 in 10.251.0.0/16 that no route of the root namespace covers, so nothing
but the benchmark's own namespaces is ever addressed.

Everything is removed on every exit path: ``close()`` from the context manager, SIGTERM/SIGHUP
(turned into SystemExit so ``finally`` blocks run), and ``atexit``. Namespaces left behind by a
killed run (their PID is gone) are removed by the next run.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass

log = logging.getLogger(__name__)

PREFIX = "scdb"
_NS_RE = re.compile(rf"^{PREFIX}-[pc]-(\d+)$")


class BenchError(RuntimeError):
    """The benchmark cannot run (privileges, tools, kernel support); the message says what is needed."""


def check_privileges() -> None:
    """Root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the iproute2 tools, or a clear refusal."""
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise BenchError(f"scd bench needs the {' and '.join(missing)} command(s) from iproute2 (e.g. `apt-get install "
                         "iproute2`) to create network namespaces and rate-limit their link")
    if os.geteuid() != 0:
        raise BenchError("scd bench needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces, veth "
                         "pairs and tc qdiscs; run it as root, e.g. `sudo -E .venv/bin/scd bench ...`")


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise BenchError(f"`{' '.join(args)}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    r = sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def ours() -> list[str]:
    """Benchmark namespaces present now (any run's)."""
    return [n for n in namespaces() if _NS_RE.match(n)]


def remove_stale() -> list[str]:
    """Delete namespaces of earlier runs whose process is gone; returns their names."""
    gone = [n for n in ours() if not _alive(int(_NS_RE.match(n).group(1)))]
    for n in gone:
        sh("ip", "netns", "del", n, check=False)
        log.warning("removed namespace %s left by an earlier run", n)
    return gone


def _free_subnet(pid: int) -> ipaddress.IPv4Network:
    """A /24 in 10.251.0.0/16 that no route in the root namespace overlaps."""
    r = sh("ip", "-j", "-4", "route", "show", "table", "all", check=False)
    taken = []
    try:
        for route in json.loads(r.stdout or "[]"):
            dst = route.get("dst", "")
            if dst and dst != "default":
                try:
                    taken.append(ipaddress.ip_network(dst, strict=False))
                except ValueError:
                    pass
    except json.JSONDecodeError:
        pass
    for i in range(256):
        net = ipaddress.ip_network(f"10.251.{(pid + i) % 256}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise BenchError("no free /24 in 10.251.0.0/16 for the benchmark's addresses (every one is routed already)")


@dataclass
class Shape:
    rate_mbit: float
    delay_ms: float = 0.0

    def tbf(self) -> list[str]:
        """tbf arguments: the bucket holds 0.25 ms of the rate (at least 16 KiB; tbf splits larger GSO
        packets), so a transfer cannot beat bytes/rate by more than that; the queue holds at most 20 ms
        of the rate (at least 256 KiB)."""
        rate_bytes = self.rate_mbit * 1e6 / 8
        burst = max(16 << 10, int(rate_bytes * 0.25e-3))
        limit = max(256 << 10, int(rate_bytes * 20e-3))
        return ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", str(burst), "limit", str(limit)]


class Testbed:
    """``with Testbed(rate_mbit, delay_ms) as tb:`` tb.producer_ns, tb.consumer_ns, tb.producer_addr (on the
    shaped link), tb.consumer_addr, tb.client_addr (the producer's address the root namespace reaches);
    ``tb.set_rate(mbit)`` changes the link between measurements without restarting anything."""

    def __init__(self, rate_mbit: float, delay_ms: float = 0.0):
        check_privileges()
        if rate_mbit <= 0:
            raise BenchError(f"link rate must be positive, got {rate_mbit} Mbit/s")
        if delay_ms < 0:
            raise BenchError(f"delay must be >= 0 ms, got {delay_ms}")
        self.pid = os.getpid()
        self.producer_ns, self.consumer_ns = f"{PREFIX}-p-{self.pid}", f"{PREFIX}-c-{self.pid}"
        self.dev_p, self.dev_c = f"{PREFIX}{self.pid}p", f"{PREFIX}{self.pid}c"
        self.dev_r, self.dev_q = f"{PREFIX}{self.pid}r", f"{PREFIX}{self.pid}q"
        self.shape = Shape(rate_mbit, delay_ms)
        self._created = False
        self._closed = False
        self._old_handlers: dict[int, object] = {}
        self.cleanups: list = []  # callables run first on close (e.g. stopping the services)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Testbed":
        remove_stale()
        for n in (self.producer_ns, self.consumer_ns):
            if n in namespaces():
                raise BenchError(f"namespace {n} exists already; another benchmark with this PID is running?")
        self._install_handlers()
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _install_handlers(self) -> None:
        def stop(signum, frame):
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, stop)
            except ValueError:  # not the main thread: atexit and the context manager still clean up
                pass

    def _create(self) -> None:
        net = _free_subnet(self.pid)
        hosts = list(net.hosts())
        self.producer_addr, self.consumer_addr = str(hosts[0]), str(hosts[1])  # .1, .2 (/30)
        self.root_addr, self.client_addr = str(hosts[4]), str(hosts[5])  # .5, .6 (/30)
        self._created = True
        P, C = self.producer_ns, self.consumer_ns
        sh("ip", "netns", "add", P)
        sh("ip", "netns", "add", C)
        sh("ip", "link", "add", self.dev_p, "type", "veth", "peer", "name", self.dev_c)
        sh("ip", "link", "set", self.dev_p, "netns", P)
        sh("ip", "link", "set", self.dev_c, "netns", C)
        sh("ip", "link", "add", self.dev_r, "type", "veth", "peer", "name", self.dev_q)
        sh("ip", "link", "set", self.dev_q, "netns", P)
        for ns, dev, addr in ((P, self.dev_p, self.producer_addr), (C, self.dev_c, self.consumer_addr),
                              (P, self.dev_q, self.client_addr)):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
        for ns in (P, C):
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "addr", "add", f"{self.root_addr}/30", "dev", self.dev_r)
        sh("ip", "link", "set", self.dev_r, "up")
        self._shape(add=True)

    def _shape(self, add: bool) -> None:
        """tbf (rate) on the egress of both ends of the link; netem (delay) above it when asked for."""
        s = self.shape
        for ns, dev in ((self.producer_ns, self.dev_p), (self.consumer_ns, self.dev_c)):
            tc = ["ip", "netns", "exec", ns, "tc", "qdisc"]
            if s.delay_ms > 0:
                if add:
                    r = sh(*tc, "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{s.delay_ms:g}ms",
                           "limit", "100000", check=False)
                    if r.returncode != 0:
                        raise BenchError(f"--delay-ms needs the kernel's netem qdisc (sch_netem), which `tc` could not "
                                         f"use here ({r.stderr.strip()}); load it (`modprobe sch_netem`) or run with "
                                         "--delay-ms 0")
                sh(*tc, "add" if add else "change", "dev", dev, "parent", "1:1", "handle", "10:", *s.tbf())
            else:
                r = sh(*tc, "add" if add else "change", "dev", dev, "root", "handle", "10:", *s.tbf(), check=False)
                if r.returncode != 0:
                    raise BenchError(f"cannot rate-limit the link with `tc qdisc ... tbf` ({r.stderr.strip()}); the "
                                     "kernel needs the tbf qdisc (sch_tbf)")

    def set_rate(self, rate_mbit: float) -> None:
        if rate_mbit <= 0:
            raise BenchError(f"link rate must be positive, got {rate_mbit} Mbit/s")
        self.shape = Shape(rate_mbit, self.shape.delay_ms)
        self._shape(add=False)
        log.info("link set to %g Mbit/s, %g ms one-way delay", rate_mbit, self.shape.delay_ms)

    def qdiscs(self) -> str:
        """The link's qdiscs as ``tc`` reports them (recorded in the results)."""
        out = []
        for ns, dev in ((self.producer_ns, self.dev_p), (self.consumer_ns, self.dev_c)):
            r = sh("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev, check=False)
            out.append(f"{dev}: {' | '.join(line.strip() for line in r.stdout.splitlines())}")
        return "; ".join(out)

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fn in reversed(self.cleanups):
            try:
                fn()
            except Exception as e:  # keep cleaning
                log.warning("cleanup step failed: %s", e)
        if self._created:
            for n in (self.producer_ns, self.consumer_ns):
                sh("ip", "netns", "del", n, check=False)
            sh("ip", "link", "del", self.dev_r, check=False)  # gone with its peer already, normally
        for sig, h in self._old_handlers.items():
            try:
                signal.signal(sig, h)
            except (ValueError, TypeError):
                pass
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
