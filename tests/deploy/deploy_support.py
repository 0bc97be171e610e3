"""What the deploy tests share: the image and compose project they run, and small helpers around
``docker`` (a command with its output on failure, a container's gRPC health, metrics, a chat)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
IMAGE = os.environ.get("SCD_IMAGE", "scd-serve:0.1.0")
PROJECT = "scd-deploytest"
COMPOSE = [str(Path(sys.executable).parent / "docker-compose"), "-p", PROJECT, "-f", str(DEPLOY / "compose.yaml")]
PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def sh(*cmd: str, check: bool = True, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode:
        raise AssertionError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, fn, timeout: float = 240, every: float = 1.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def health(container: str, port: int, service: str = "") -> str:
    """The gRPC health status of ``service`` inside ``container`` (as the probes ask it), or the error."""
    code = ("import grpc,sys;from grpc_health.v1 import health_pb2 as h,health_pb2_grpc as g\n"
            "try:\n"
            f" r=g.HealthStub(grpc.insecure_channel('localhost:{port}'))"
            f".Check(h.HealthCheckRequest(service='{service}'),timeout=3)\n"
            " print(h.HealthCheckResponse.ServingStatus.Name(r.status))\n"
            "except grpc.RpcError as e:print(e.code().name)")
    r = sh("docker", "exec", container, "python", "-c", code, check=False, timeout=30)
    return (r.stdout.strip() or r.stderr.strip()).splitlines()[-1] if (r.stdout or r.stderr) else "?"


def metrics(url: str, token: str) -> dict[tuple[str, frozenset], float]:
    import httpx2 as httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10).raise_for_status().text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def chat(base_url: str, token: str, method: str) -> tuple[str, dict]:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=token, timeout=180, max_retries=0)
    r = client.chat.completions.create(model="strong", messages=PROMPT, max_tokens=12, temperature=0,
                                       extra_body={"method": method})
    return r.choices[0].message.content or "", (r.model_extra or {}).get("scd_timings", {})
