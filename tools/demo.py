"""The two-process demo: a consumer and a producer on localhost, a real question about real
passages, the answer streamed for each method, TTFT and bytes side by side, clean shutdown."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tools import client, data


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(address: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"service for {address} exited with code {proc.returncode} before it was ready")
        try:
            with grpc.insecure_channel(address) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{address} not healthy after {timeout:.0f} s")


def stop(procs: list[subprocess.Popen], timeout: float = 20.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Refused(RuntimeError):
    """A request the demo's services refused (a prompt over their limit, more tokens than the consumer
    allows): the method and the services' own error; both services are stopped before it is raised."""


def _generate(address: str, method: str, req, **kw):
    try:
        return client.generate(address, req, timeout=300, **kw)
    except grpc.RpcError as e:  # it was a traceback
        raise Refused(f"{method}: {e.code().name}: {e.details()}") from None


def run(entry, methods: tuple[str, ...] = ("oracle", "raw", "scd"), max_new_tokens: int = 24,
        item_index: int = 0, data_file=None) -> dict:
    """``entry``: the registered pair (``tools.assets.registry.PairEntry``); the question is a test
    prompt of the built-in QA data, or of ``data_file`` (JSONL), in the pair's own prompt format."""
    from shared.model.loading import load_tokenizer
    from shared.model.prompt import PromptFormat

    pair = entry.name
    fmt = PromptFormat(load_tokenizer(entry.tokenizer))
    if data_file:
        from tools.data import user

        item = user.load(data_file, fmt, "test")[item_index]
    else:
        item = data.load("qa", "test", fmt=fmt)[item_index]
    cport, pport = free_port(), free_port()
    exe = [sys.executable, "-m", "tools.cli", "serve"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PRODUCER__ACCESS_LOG="false",  # the demo prints its own table;
               CONSUMER__ACCESS_LOG="false")  # request log lines would land inside the streamed answers
    procs = [subprocess.Popen(exe + ["consumer", "--pair", pair, "--port", str(cport)], env=env)]
    results = {}
    try:
        procs.append(subprocess.Popen(exe + ["producer", "--port", str(pport), "--consumer",
                                             f"{pair}=127.0.0.1:{cport}", "--set", f"methods={list(methods)}",
                                             "--set", f"default_method={methods[-1]}",  # keeps the one prompt's
                                             "--set", "prefill_cache_entries=1"], env=env))  # prefill for the warm pass
        for addr, p in ((f"127.0.0.1:{cport}", procs[0]), (f"127.0.0.1:{pport}", procs[1])):
            wait_healthy(addr, p)
        question = item.question or (item.prompt if isinstance(item.prompt, str) else item.prompt[-1]["content"])
        print(f"\nQuestion ({len(item.prompt_ids)}-token prompt): {question[-300:]}\n"
              + (f"Gold answer: {item.answer}\n" if item.answer else ""))
        for m in methods:
            print(f"--- {m} ---", flush=True)
            req = client.request(item.prompt_ids, pair, m, max_new_tokens=max_new_tokens)
            res = _generate(f"127.0.0.1:{pport}", m, req, on_event=lambda ev: print(ev.text, end="", flush=True))
            print()
            results[m] = res
        print("\nthe same prompt again, now that the producer holds its prefill (prefill_cache_entries) ...",
              flush=True)
        warm = {m: _generate(f"127.0.0.1:{pport}", m, client.request(item.prompt_ids, pair, m, max_new_tokens=1))
                for m in methods}
        print(f"\n{'method':<12}{'cold TTFT':>11}{'warm TTFT':>11}{'wire bytes':>13}{'reconstruct':>13}  answer")
        for m, r in results.items():
            t = r.timings
            print(f"{m:<12}{t.ttft_ms:>8.0f} ms{warm[m].timings.ttft_ms:>8.0f} ms{t.wire_bytes:>13,}"
                  f"{t.reconstruct_ms:>10.0f} ms  {r.text.strip()[:60]!r}")
        print("cold: the producer prefills the prompt first (the Oracle sends token ids only and the consumer "
              "prefills it itself);\nwarm: the producer already holds the prompt's prefill, as for a prefix shared "
              "by many requests, so a\nmethod's TTFT is its transfer and reconstruction. Both services share this "
              "machine's CPU here; `scd bench`\nmeasures them over a rate-limited link, `scd eval` each method's "
              "quality (README).")
        oracle = results.get("oracle")
        if item.answer and oracle is not None and oracle.text.strip() != item.answer.strip():
            print("The Oracle's answer is the fine-tuned model's own (it prefills the prompt itself): where it differs "
                  "from the\ngold answer, the model differs, not the transfer; a transfer is right when it "
                  "answers as the Oracle does.")
    finally:
        stop(procs)
    alive = [p.pid for p in procs if p.poll() is None]
    print(f"\nboth services stopped (exit codes {[p.returncode for p in procs]})" if not alive
          else f"\nstill running: {alive}")
    return results
