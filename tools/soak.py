"""``scd soak``: minutes of mixed traffic against both real services (subprocesses on localhost), to
find what only time finds: lost requests, 5xx, memory that does not come back.

Traffic, from a few client threads at once: every served method over gRPC (streamed), the HTTP
front (completions and chat, streamed and not), cancellations after the first token, corrupt frames
sent straight to the consumer, and one consumer restart (SIGTERM, start again) early in the run.
Printed: requests by kind and outcome, p50/p99 TTFT of the successful ones, each service's RSS
after warm-up, at its peak and at the end. Exit status 1 if a request was lost (no final event and
no error), an HTTP 5xx came outside the restart window, or a service's final RSS is over 110% of
its post-warm-up level."""

from __future__ import annotations

import collections
import json
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc
import httpx2 as httpx

from tools import client
from tools.demo import free_port, stop, wait_healthy

METHODS = ("oracle", "raw", "quant", "spectrum", "droidspeak", "ridge", "scd-reuse", "scd")
KINDS = ("grpc", "http", "http-stream", "chat", "cancel", "corrupt")


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
    server_errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, outcome: str, ttft: float | None = None) -> None:
        with self.lock:
            self.outcomes[(kind, outcome)] += 1
            if ttft is not None:
                self.ttft_ms.append(ttft)


class Soak:
    def __init__(self, pair: str, minutes: float, clients: int, max_new_tokens: int, seed: int):
        self.pair, self.seconds, self.clients, self.max_new = pair, minutes * 60, clients, max_new_tokens
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.restarting = threading.Event()  # the consumer is (being) restarted: 503 / UNAVAILABLE expected
        self.stop = threading.Event()
        self.procs: dict[str, subprocess.Popen] = {}
        self.rss: dict[str, dict[str, float]] = {"producer": {}, "consumer": {}}

    # ------------------------------------------------------------------ services
    def _consumer(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "tools.cli", "serve", "consumer", "--pair", self.pair,
                                 "--port", str(self.cport)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> None:
        self.cport, self.pport, self.hport = free_port(), free_port(), free_port()
        self.procs["consumer"] = self._consumer()
        wait_healthy(f"127.0.0.1:{self.cport}", self.procs["consumer"])
        self.procs["producer"] = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "serve", "producer", "--port", str(self.pport), "--consumer",
             f"{self.pair}=127.0.0.1:{self.cport}", "--set", f"methods={list(METHODS)}", "--set",
             f"http.port={self.hport}", "--set", "prefill_cache_entries=0", "--set", "health_probe_s=1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(f"127.0.0.1:{self.pport}", self.procs["producer"])

    def restart_consumer(self) -> None:
        self.restarting.set()
        stop([self.procs["consumer"]])
        self.procs["consumer"] = self._consumer()
        wait_healthy(f"127.0.0.1:{self.cport}", self.procs["consumer"])
        self._wait_producer_sees_consumer()  # the window ends when the producer reports the consumer again
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
        method = self.rng.choice(METHODS)
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
            else:
                self._http(kind, method)
        except grpc.RpcError as e:
            code = e.code().name
            restart = window or self.restarting.is_set()
            if code == "DEADLINE_EXCEEDED":
                t.lost.append(f"{kind} {method}: no answer within 120 s")
            elif code in ("UNAVAILABLE", "INTERNAL", "UNKNOWN") and not restart:
                t.server_errors.append(f"{kind} {method}: {code} {e.details()[:200]}")
            t.add(kind, code.lower() + (" (restart)" if restart else ""))
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
        self.tally.add(kind, f"http {r.status_code}", ttft if kind == "http-stream" else None)

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
                self.tally.add("corrupt", e.code().name.lower() + (" (restart)" if self.restarting.is_set() else ""))

    def worker(self) -> None:
        weights = (5, 2, 2, 2, 1, 1)
        while not self.stop.is_set():
            self.one(self.rng.choices(KINDS, weights)[0])

    # ------------------------------------------------------------------ run
    def sample_rss(self, label: str) -> None:
        for role, p in self.procs.items():
            self.rss[role][label] = rss_mb(p.pid)

    def run(self) -> dict:
        t_start = time.monotonic()
        self.start()
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
        print(f"\nscd soak: {self.seconds / 60:.1f} min of traffic, {self.clients} clients, pair {self.pair}")
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
            within = base > 0 and final <= 1.10 * base
            ok_mem &= within
            print(f"{role:9s} RSS after warm-up {base:7.0f} MB, peak {r.get('peak', 0):7.0f} MB, final {final:7.0f} MB "
                  f"({'within' if within else 'OVER'} 110%)")
        for what in t.lost[:10] + t.server_errors[:10]:
            print("  !", what)
        passed = not t.lost and not t.server_errors and ok_mem
        out = {"minutes": self.seconds / 60, "clients": self.clients, "requests": sum(t.outcomes.values()),
               "outcomes": {f"{k}|{o}": n for (k, o), n in sorted(t.outcomes.items())},
               "ttft_p50_ms": q(0.5), "ttft_p99_ms": q(0.99), "rss_mb": self.rss, "lost": len(t.lost),
               "server_errors": len(t.server_errors), "memory_returned": ok_mem, "passed": passed,
               "wall_s": round(wall_s, 1)}
        print(json.dumps(out))
        return out
