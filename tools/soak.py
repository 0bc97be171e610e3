"""``scd soak``: minutes of mixed traffic against both real services (subprocesses on localhost), to
find what only time finds: lost requests, 5xx, memory that does not come back.

Traffic, from a few client threads at once: every served method over gRPC (streamed), the HTTP
front (completions and chat, streamed and not), cancellations after the first token, corrupt frames
sent straight to the consumer, and one consumer restart (SIGTERM, start again) early in the run.
Printed: requests by kind and outcome, p50/p99 TTFT of the successful ones, each service's RSS
after warm-up, at its peak and at the end. Exit status 1 if a request was lost (no final event and
no error), an HTTP 5xx came outside the restart window, a well-formed request was refused (a 4xx
other than 429, a corrupt stream answered other than DATA_LOSS), or a service's final RSS is over
its post-warm-up level by more than 5% (or 50 MB, whichever is more). ``--faults`` adds streams
that fail part-way (``tools.soak_faults``), each of which must get its one answer. One request of
the traffic's shape goes first: settings the services refuse (``--max-new-tokens`` over the
consumer's limit) end the run before the traffic starts."""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx2 as httpx

from tools import client
from tools.demo import free_port, stop, wait_healthy

METHODS = ("oracle", "raw", "quant", "spectrum", "droidspeak", "ridge", "scd-reuse", "scd")
KINDS = ("grpc", "http", "http-stream", "chat", "cancel", "corrupt")
SERVED = {"ok", "http 200", "resource_exhausted", "http 429"}
"""Outcomes of a well-formed request: answered, or told to come back (the services at capacity)."""
APART = {"deadline_exceeded", "transport error", "unavailable", "internal", "unknown"}
"""Outcomes counted apart: lost requests, and server errors (tolerated inside the consumer's restart)."""


FAULT_FRAME_TIMEOUT_S = 5.0
"""The consumer's frame_timeout_s under ``--faults``: a stalled sender is cut after this long."""
RSS_GROWTH, RSS_GROWTH_MB = 0.05, 50.0
"""A service's RSS at the end may exceed its RSS after warm-up by 5% or 50 MB, whichever is more."""


class SoakError(RuntimeError):
    """The soak cannot run as asked (the services refused its first request)."""


def unexpected(outcomes: collections.Counter) -> list[tuple[str, str]]:
    """The ``(kind, outcome)`` counts a healthy pair of services does not give: a well-formed request
    refused (INVALID_ARGUMENT, an HTTP 400, ...; only 429 says come back), a corrupt stream answered
    other than DATA_LOSS (or unavailable, in the consumer's restart window). The
    soak's traffic is well-formed, so a refusal is the services' fault or the soak's settings', never
    a pass (a soak whose every request was refused passed). Lost requests and 5xx are counted apart."""
    out = []
    for kind, outcome in sorted(outcomes):
        if kind.startswith("fault:"):  # checked as they are sent (Tally.wrong): each kind has its one answer
            continue
        base, restart = outcome.removesuffix(" (restart)"), outcome.endswith(" (restart)")
        if kind == "corrupt":  # must be DATA_LOSS; the consumer is down in the restart window
            fine = {"data_loss"} | ({"unavailable", "internal", "unknown"} if restart else set())
        else:
            fine = SERVED | APART
        if base not in fine and not (kind != "corrupt" and base.startswith("http 5")):
            out.append((kind, outcome))
    return out


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@dataclass
class Tally:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    ttft_ms: list[float] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    examples: dict = field(default_factory=dict)  # (kind, outcome) -> the first such answer's message
    server_errors: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)  # a failing stream answered other than it must be
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, outcome: str, ttft: float | None = None, detail: str = "") -> None:
        with self.lock:
            self.outcomes[(kind, outcome)] += 1
            if detail:
                self.examples.setdefault((kind, outcome), detail[:200])
            if ttft is not None:
                self.ttft_ms.append(ttft)


class Soak:
    def __init__(self, pair: str, minutes: float, clients: int, max_new_tokens: int, seed: int,
                 methods: tuple[str, ...] = METHODS, faults: bool = False, rss_every: int = 200):
        """``methods``: those the pair can serve (its store's artifacts and profiles), of ``METHODS``.
        ``faults``: streams that fail part-way beside the good traffic (``tools.soak_faults``), the
        consumer's frame_timeout_s at ``FAULT_FRAME_TIMEOUT_S`` so that a stalled sender is cut soon."""
        self.pair, self.seconds, self.clients, self.max_new = pair, minutes * 60, clients, max_new_tokens
        self.faults, self.rss_every, self.faulty = faults, rss_every, None
        self.rss_series: list[dict] = []
        self.methods = methods
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.restarting = threading.Event()  # the consumer is (being) restarted: 503 / UNAVAILABLE expected
        self.stop = threading.Event()
        self.procs: dict[str, subprocess.Popen] = {}
        self.rss: dict[str, dict[str, float]] = {"producer": {}, "consumer": {}}

    # ------------------------------------------------------------------ services
    def _spawn(self, role: str, args: list[str]) -> subprocess.Popen:
        """``scd serve ROLE`` with its output appended to a log of the run's own (a service that does not
        start is told with the end of its log: it said only its exit code), request logs off."""
        env = dict(os.environ, PRODUCER__ACCESS_LOG="false", CONSUMER__ACCESS_LOG="false")
        with open(self.logdir / f"{role}.log", "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "tools.cli", "serve", role, *args], stdout=log,
                                    stderr=subprocess.STDOUT, env=env)

    def _ready(self, role: str, port: int) -> None:
        try:
            wait_healthy(f"127.0.0.1:{port}", self.procs[role])
        except (RuntimeError, TimeoutError) as e:
            lines = (self.logdir / f"{role}.log").read_text(errors="replace").splitlines()
            tail = "\n".join(line for line in lines if "it/s]" not in line)[-2000:]  # not the progress bars
            raise SoakError(f"the {role} did not start ({e}); the end of its log:\n{tail}") from None

    def _consumer(self) -> subprocess.Popen:
        extra = ["--set", f"frame_timeout_s={FAULT_FRAME_TIMEOUT_S}"] if self.faults else []
        return self._spawn("consumer", ["--pair", self.pair, "--port", str(self.cport), *extra])

    def start(self) -> None:
        self.cport, self.pport, self.hport = free_port(), free_port(), free_port()
        self.procs["consumer"] = self._consumer()
        self._ready("consumer", self.cport)
        self.procs["producer"] = self._spawn("producer", [
            "--port", str(self.pport), "--consumer", f"{self.pair}=127.0.0.1:{self.cport}", "--set",
            f"methods={list(self.methods)}", "--set", f"default_method={self.methods[-1]}", "--set",
            f"http.port={self.hport}", "--set", "prefill_cache_entries=0", "--set", "health_probe_s=1"])
        self._ready("producer", self.pport)

    def restart_consumer(self) -> None:
        """Stop the consumer and start it again (in a thread of its own, while the traffic goes on). One
        that does not come back is a server error of the soak's (it was a thread's traceback, and the
        rest of the run counted as the restart window)."""
        self.restarting.set()
        try:
            stop([self.procs["consumer"]])
            self.procs["consumer"] = self._consumer()
            self._ready("consumer", self.cport)
            self._wait_producer_sees_consumer()  # the window ends when the producer reports the consumer again
        except (SoakError, TimeoutError, grpc.RpcError) as e:
            self.tally.server_errors.append(f"the consumer did not come back after its restart: {e}")
        finally:
            self.restarting.clear()

    def _wait_producer_sees_consumer(self, timeout: float = 60.0) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            with grpc.insecure_channel(f"127.0.0.1:{self.pport}") as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=f"scd.v1.Producer/{self.pair}"), timeout=5)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.2)
        raise TimeoutError(f"the producer did not see consumer {self.pair!r} again within {timeout:.0f} s")

    # ------------------------------------------------------------------ traffic
    def _prompt(self) -> str:
        topics = ("the sea", "a lighthouse", "bread", "rivers in winter", "a violin", "the moon", "salt")
        return f"Request {self.rng.randrange(10**6)}: tell me about {self.rng.choice(topics)}."

    def one(self, kind: str) -> None:
        t = self.tally
        window = self.restarting.is_set()
        method = self.rng.choice(self.methods)
        try:
            if kind in ("grpc", "cancel"):
                req = client.request(self._prompt(), consumer=self.pair, method=method, max_new_tokens=self.max_new)
                t0, ttft, final = time.perf_counter(), None, False
                for ev in client.stream(f"127.0.0.1:{self.pport}", req, timeout=120):
                    ttft = ttft if ttft is not None else (time.perf_counter() - t0) * 1e3
                    if kind == "cancel":
                        break  # closing the stream cancels the call
                    final = final or bool(ev.finish_reason)
                if kind == "grpc" and not final:
                    t.lost.append(f"grpc {method}: the stream ended without a final event")
                t.add(kind, "ok", ttft if kind == "grpc" else None)
            elif kind == "corrupt":
                self._corrupt()
            elif kind.startswith("fault:"):
                self._fault(kind)
            else:
                self._http(kind, method)
        except grpc.RpcError as e:
            code = e.code().name
            restart = window or self.restarting.is_set()
            if code == "DEADLINE_EXCEEDED":
                t.lost.append(f"{kind} {method}: no answer within 120 s")
            elif code in ("UNAVAILABLE", "INTERNAL", "UNKNOWN") and not restart:
                t.server_errors.append(f"{kind} {method}: {code} {e.details()[:200]}")
            t.add(kind, code.lower() + (" (restart)" if restart else ""), detail=e.details() or "")
            if restart:
                time.sleep(0.2)  # the consumer is down: do not spin
        except httpx.HTTPError as e:
            t.lost.append(f"{kind} {method}: {type(e).__name__} {e}")
            t.add(kind, "transport error")

    def _http(self, kind: str, method: str) -> None:
        url = f"http://127.0.0.1:{self.hport}/v1/" + ("chat/completions" if kind == "chat" else "completions")
        body = {"model": self.pair, "max_tokens": self.max_new, "method": method, "stream": kind == "http-stream"}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": self._prompt()}]
        else:
            body["prompt"] = self._prompt()
        window = self.restarting.is_set()
        t0 = time.perf_counter()
        r = httpx.post(url, json=body, timeout=120)
        ttft = (time.perf_counter() - t0) * 1e3  # whole answer for non-streamed requests: not a TTFT
        if r.status_code >= 500:
            restart = window or self.restarting.is_set()
            if not restart:
                self.tally.server_errors.append(f"{kind} {method}: HTTP {r.status_code} {r.text[:200]}")
            self.tally.add(kind, f"http {r.status_code}" + (" (restart)" if restart else ""))
            if restart:
                time.sleep(0.2)
            return
        if kind == "http-stream" and r.status_code == 200 and not r.text.rstrip().endswith("[DONE]"):
            self.tally.lost.append(f"{kind} {method}: the event stream did not end with [DONE]")
        ok = r.status_code == 200  # a refusal's time is not a TTFT
        self.tally.add(kind, f"http {r.status_code}", ttft if kind == "http-stream" and ok else None,
                       detail="" if ok else r.text)

    def _corrupt(self) -> None:
        """A raw stream straight to the consumer with one flipped checksum: must be DATA_LOSS."""
        import torch

        from shared.rpc import scd_pb2 as pb
        from shared.rpc import scd_pb2_grpc as pbg
        from shared.rpc.wire import PROTOCOL_VERSION, StreamTotals, layer_frames
        from tools.assets import registry

        e, n = registry.get(self.pair), 24
        totals = StreamTotals()
        frames = [totals.add(pb.KVFrame(header=pb.Header(
            request_id="soak-corrupt", method="raw", method_version=1, protocol_version=PROTOCOL_VERSION,
            pair_fingerprint=f"{e.producer_fingerprint}:raw", n_layers=e.n_layers, n_tokens=n,
            prompt_ids=list(range(1, n + 2)), consumer=self.pair, sampling=pb.SamplingParams(max_new_tokens=2))))]
        n_layers = e.n_layers
        kv = torch.zeros(1, e.n_kv_heads, n, e.head_dim, dtype=torch.float16)
        for layer in range(n_layers):
            frames += [totals.add(f) for f in layer_frames(layer, {"k": kv, "v": kv})]
        frames.append(totals.trailer())
        frames[1 + self.rng.randrange(2 * n_layers)].chunk.crc32c ^= 1
        with grpc.insecure_channel(f"127.0.0.1:{self.cport}") as ch:
            try:
                list(pbg.ConsumerStub(ch).Transfer(iter(frames), timeout=60))
                self.tally.lost.append("corrupt: a corrupt stream was answered")
                self.tally.add("corrupt", "answered (wrong)")
            except grpc.RpcError as e:
                self.tally.add("corrupt", e.code().name.lower() + (" (restart)" if self.restarting.is_set() else ""),
                               detail=e.details() or "")

    def _fault(self, kind: str) -> None:
        from tools.soak_faults import EXPECTED

        what = kind.removeprefix("fault:")
        restart = self.restarting.is_set()
        outcome, detail = self.faulty.send(what)
        restart = restart or self.restarting.is_set()
        if outcome != EXPECTED[what] and not (restart and outcome in ("unavailable", "internal", "unknown")):
            self.tally.wrong.append(f"{kind}: {outcome} {detail[:200]} (expected {EXPECTED[what]})")
        self.tally.add(kind, outcome + (" (restart)" if restart else ""), detail=detail)

    def preflight(self) -> None:
        """One request of the traffic's own shape before the traffic starts (SoakError if refused)."""
        req = client.request(self._prompt(), consumer=self.pair, method=self.methods[-1], max_new_tokens=self.max_new)
        try:
            client.generate(f"127.0.0.1:{self.pport}", req, timeout=300)
        except grpc.RpcError as e:
            raise SoakError(f"the services refused the soak's first request ({e.code().name}: {e.details()}); "
                            "nothing was soaked") from None

    def worker(self) -> None:
        from tools.soak_faults import KINDS as FAULTS

        kinds, weights = list(KINDS), [5, 2, 2, 2, 1, 1]
        if self.faults:  # about half of the streams fail part-way; killed senders cost a process each
            kinds += [f"fault:{k}" for k in FAULTS]
            weights += [1 if k in ("killed", "stall") else 2 for k in FAULTS]
        while not self.stop.is_set():
            self.one(self.rng.choices(kinds, weights)[0])

    # ------------------------------------------------------------------ run
    def sample_rss(self, label: str) -> None:
        for role, p in self.procs.items():
            self.rss[role][label] = rss_mb(p.pid)

    def sample_series(self, elapsed: float) -> None:
        """Every ``rss_every`` streams: both services' RSS (printed as it goes, kept for the report)."""
        n = sum(self.tally.outcomes.values())
        if n >= (len(self.rss_series) + 1) * self.rss_every:
            row = {"streams": n, "minute": round(elapsed / 60, 1),
                   **{role: round(rss_mb(p.pid)) for role, p in self.procs.items()}}
            self.rss_series.append(row)
            print(f"  {n:6d} streams, {row['minute']:5.1f} min: producer {row['producer']} MB, consumer "
                  f"{row['consumer']} MB", flush=True)

    def run(self) -> dict:
        t_start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="scd-soak-") as logs:
            self.logdir = Path(logs)
            try:
                self.start()
                if self.faults:
                    from tools.soak_faults import FaultyStreams, Shape

                    self.faulty = FaultyStreams(Shape.of_pair(self.pair), f"127.0.0.1:{self.cport}",
                                                random.Random(self.rng.random()), FAULT_FRAME_TIMEOUT_S)
                self.preflight()
                return self._traffic(t_start)
            finally:  # a refusal, a service that did not start, ^C: no service left behind
                stop(list(self.procs.values()))

    def _traffic(self, t_start: float) -> dict:
        threads = [threading.Thread(target=self.worker, daemon=True) for _ in range(self.clients)]
        for th in threads:
            th.start()
        peak = {"producer": 0.0, "consumer": 0.0}
        restarted = warmed = False
        t0 = time.monotonic()
        while (elapsed := time.monotonic() - t0) < self.seconds:
            if not restarted and elapsed > 0.15 * self.seconds:
                restarted = True
                threading.Thread(target=self.restart_consumer, daemon=True).start()
            if not warmed and restarted and not self.restarting.is_set() and elapsed > 0.35 * self.seconds:
                warmed = True
                self.sample_rss("after_warmup")
            for role, p in self.procs.items():
                peak[role] = max(peak[role], rss_mb(p.pid))
            self.sample_series(elapsed)
            time.sleep(1)
        self.stop.set()
        for th in threads:
            th.join(180)
        time.sleep(5)  # idle: what the services still hold
        self.sample_rss("final")
        for role in peak:
            self.rss[role]["peak"] = peak[role]
        stop(list(self.procs.values()))
        return self.report(time.monotonic() - t_start)

    def report(self, wall_s: float) -> dict:
        t = self.tally
        print(f"\nscd soak: {self.seconds / 60:.1f} min of traffic, {self.clients} clients, pair {self.pair}, methods "
              f"{','.join(self.methods)}")
        print(f"{'kind':12s} {'outcome':32s} {'requests':>9s}")
        for (kind, outcome), n in sorted(t.outcomes.items()):
            print(f"{kind:12s} {outcome:32s} {n:9d}")
        ttft = sorted(t.ttft_ms)

        def q(f: float) -> float:
            return ttft[min(len(ttft) - 1, int(f * len(ttft)))] if ttft else float("nan")

        print(f"\nTTFT (client, gRPC and streamed HTTP, ok): p50 {q(0.5):.0f} ms, p99 {q(0.99):.0f} ms, n={len(ttft)}")
        ok_mem = True
        for role, r in self.rss.items():
            base, final = r.get("after_warmup", 0.0), r.get("final", 0.0)
            allowed = base + max(RSS_GROWTH * base, RSS_GROWTH_MB)
            within = base > 0 and final <= allowed
            ok_mem &= within
            print(f"{role:9s} RSS after warm-up {base:7.0f} MB, peak {r.get('peak', 0):7.0f} MB, final {final:7.0f} MB "
                  f"({'within' if within else 'OVER'} {allowed:.0f} MB: warm-up + 5% or 50 MB)")
        refused = unexpected(t.outcomes)
        for what in t.lost[:10] + t.server_errors[:10] + t.wrong[:10]:
            print("  !", what)
        for kind, outcome in refused[:10]:
            print(f"  ! {kind} {outcome}: {t.outcomes[kind, outcome]} request(s) refused, as "
                  f"{t.examples.get((kind, outcome), '(no message)')!r}")
        passed = not t.lost and not t.server_errors and not refused and not t.wrong and ok_mem
        out = {"minutes": self.seconds / 60, "clients": self.clients, "methods": list(self.methods),
               "requests": sum(t.outcomes.values()),
               "outcomes": {f"{k}|{o}": n for (k, o), n in sorted(t.outcomes.items())},
               "ttft_p50_ms": q(0.5), "ttft_p99_ms": q(0.99), "rss_mb": self.rss, "lost": len(t.lost),
               "server_errors": len(t.server_errors), "refused": len(refused), "wrong_answers": len(t.wrong),
               "faults": self.faults, "rss_series": self.rss_series, "memory_returned": ok_mem,
               "passed": passed, "wall_s": round(wall_s, 1)}
        print(json.dumps(out))
        return out
