"""The two containers built and run for real (``make test-deploy``; needs a Docker daemon and the image
from ``make image``): compose with the producer and the consumer on separate networks joined only by
the gRPC link, OpenAI requests through the producer, both services' metrics; the image with no
arguments. The Kubernetes pods are ``test_k8s.py``'s: that module starts once compose is down and its
volumes are removed (each holds models of ~0.5 GB; CI's disk ran out with both)."""

from __future__ import annotations

import os
import sys
import time

import pytest
from deploy_support import COMPOSE, IMAGE, PROJECT, chat, free_port, health, metrics, sh, wait_for

pytestmark = pytest.mark.deploy


@pytest.fixture(scope="module")
def compose(token_file):
    ports = {"PRODUCER_HTTP_PORT": free_port(), "PRODUCER_GRPC_PORT": free_port(), "CONSUMER_METRICS_PORT": free_port()}
    env = {**os.environ, **{k: str(v) for k, v in ports.items()}, "SCD_IMAGE": IMAGE,
           "SCD_TOKEN_FILE": str(token_file)}
    sh(*COMPOSE, "down", "-v", "--remove-orphans", env=env, check=False)
    t0 = time.monotonic()
    up = sh(*COMPOSE, "up", "-d", "--wait", "--wait-timeout", "420", env=env, check=False, timeout=480)
    if up.returncode:
        logs = sh(*COMPOSE, "logs", "--no-color", "--tail", "40", env=env, check=False).stdout
        sh(*COMPOSE, "down", "-v", env=env, check=False)
        raise AssertionError(f"compose up failed ({up.returncode}):\n{up.stderr[-2000:]}\n{logs[-4000:]}")
    print(f"\ncompose up --wait: {time.monotonic() - t0:.0f} s", file=sys.stderr)
    try:
        yield {**ports, "env": env, "token": token_file.read_text().strip()}
    finally:
        sh(*COMPOSE, "down", "-v", "--remove-orphans", env=env, check=False)
        left = sh("docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}").stdout.split()
        assert not left, f"compose down left containers: {left}"


def container(service: str) -> str:
    return f"{PROJECT}-{service}-1"


def test_compose_answers_through_the_producer_with_scd_and_raw(compose):
    base = f"http://127.0.0.1:{compose['PRODUCER_HTTP_PORT']}/v1"
    for method in ("scd", "raw"):
        text, timings = chat(base, compose["token"], method)
        assert text.strip(), f"{method}: empty answer"
        assert timings.get("method") == method and timings.get("wire_bytes", 0) > 0, timings
    # both containers count what they served
    pm = metrics(f"http://127.0.0.1:{compose['PRODUCER_HTTP_PORT']}/metrics", compose["token"])
    cm = metrics(f"http://127.0.0.1:{compose['CONSUMER_METRICS_PORT']}/metrics", compose["token"])
    for m, svc in ((pm, "producer"), (cm, "consumer")):
        for method in ("scd", "raw"):
            want = {("method", method), ("outcome", "ok")}
            got = sum(v for (n, labels), v in m.items() if n == f"scd_{svc}_requests_total" and want <= labels)
            assert got == 1, f"{svc} metrics: scd_{svc}_requests_total{{method={method}, outcome=ok}} = {got}"
    assert sum(v for (n, _), v in cm.items() if n == "scd_consumer_wire_bytes_total") > 0


def test_compose_nodes_share_only_the_grpc_link(compose):
    import json

    def nets(c):
        return json.loads(sh("docker", "inspect", "-f", "{{json .NetworkSettings.Networks}}", c).stdout)

    prod, cons = nets(container("producer")), nets(container("consumer-strong"))
    assert set(prod) & set(cons) == {f"{PROJECT}_grpc-link"}, (sorted(prod), sorted(cons))
    # the producer's own node network is not reachable from the consumer's container
    ip = prod[f"{PROJECT}_producer-node"]["IPAddress"]
    probe = ("import socket,sys;s=socket.socket();s.settimeout(3)\n"
             f"try:\n s.connect(('{ip}',8080));print('open')\nexcept OSError as e:print('closed',e)")
    out = sh("docker", "exec", container("consumer-strong"), "python", "-c", probe).stdout
    assert out.startswith("closed"), f"the consumer reached the producer's node network: {out}"


def test_the_image_with_no_arguments_serves_a_consumer_once_models_are_prepared(compose):
    empty = f"{PROJECT}-empty"
    try:
        r = sh("docker", "run", "--rm", "-v", f"{empty}:/models-cache", IMAGE, check=False, timeout=120)
        assert r.returncode != 0 and "scd assets" in r.stderr, (r.returncode, r.stderr[-1500:])
    finally:
        sh("docker", "volume", "rm", "-f", empty, check=False)
    name = f"{PROJECT}-noargs"
    sh("docker", "run", "-d", "--name", name, "-v", f"{PROJECT}_models:/models-cache:ro", IMAGE)
    try:
        wait_for("the no-argument consumer to serve", lambda: health(name, 50052) == "SERVING", timeout=180, every=2)
    finally:
        sh("docker", "rm", "-f", name, check=False)
