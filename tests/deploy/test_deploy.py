"""The two containers built and run for real (``make test-deploy``; needs a Docker daemon and the image
from ``make image``): compose with the producer and the consumer on separate networks joined only by
the gRPC link, OpenAI requests through the producer, both services' metrics; the image with no
arguments; and the Kubernetes pods simulated under ``docker run`` from the manifests themselves
(their image, args, env, mounted config, init container and probes)."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.deploy
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


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("secret") / "scd-token"
    f.write_text(secrets.token_hex(32) + "\n")
    f.chmod(0o644)  # a compose file secret is a bind mount: the image's unprivileged user must read it
    return f


@pytest.fixture(scope="module", autouse=True)
def image():
    r = sh("docker", "image", "inspect", IMAGE, check=False)
    if r.returncode:
        pytest.fail(f"image {IMAGE} not found: run `make image` first ({r.stderr.strip()})")
    return IMAGE


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


# ------------------------------------------------------------------ the Kubernetes pods, simulated
def _docker_run_args(pod: dict, c: dict, cfg_dir: Path, token_file: Path, volume: str) -> list[str]:
    """`docker run` flags that give container ``c`` of pod spec ``pod`` what the kubelet would."""
    args = ["--user", f"{pod['securityContext']['runAsUser']}:{pod['securityContext']['runAsGroup']}"]
    for e in c.get("env", []):
        args += ["-e", f"{e['name']}={e['value']}"]
    vols = {v["name"]: v for v in pod["volumes"]}
    for m in c.get("volumeMounts", []):
        v = vols[m["name"]]
        if "persistentVolumeClaim" in v:
            args += ["-v", f"{volume}:{m['mountPath']}"]
        elif "configMap" in v:
            args += ["-v", f"{cfg_dir}:{m['mountPath']}:ro"]
        elif "secret" in v:
            args += ["-v", f"{token_file}:{m['mountPath']}/{v['secret']['items'][0]['path']}:ro"]
    return args


def test_kubernetes_pods_start_from_an_empty_volume_and_the_producer_waits_for_its_consumer(token_file, tmp_path):
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "scd-serve-cpu.yaml").read_text()) if d]
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    for name, text in cm["data"].items():
        (tmp_path / name).write_text(text)
    (tmp_path).chmod(0o755)
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"}
    images = {c["image"] for p in pods.values() for c in p["containers"] + p["initContainers"]}
    assert images == {IMAGE}, f"the manifests run {images}; make image built {IMAGE}"
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    net, vol = f"{PROJECT}-k8s", f"{PROJECT}-k8s-pvc"
    started: list[str] = []
    sh("docker", "network", "create", net, check=False)
    try:
        # a PVC starts empty, owned by the fsGroup (the kubelet's doing)
        sh("docker", "run", "--rm", "--user", "0", "-v", f"{vol}:/pvc", "--entrypoint", "chown", IMAGE,
           f"{pods['scd-producer']['securityContext']['fsGroup']}", "/pvc")

        def start(deploy: str) -> str:
            pod = pods[deploy]
            for init in pod["initContainers"]:  # run to completion first, as the kubelet does
                sh("docker", "run", "--rm", *_docker_run_args(pod, init, tmp_path, token_file, vol), init["image"],
                   *init["args"], timeout=600)
            (c,) = pod["containers"]
            name = f"{PROJECT}-{deploy}"
            alias = deploy if deploy in services else name
            sh("docker", "run", "-d", "--name", name, "--network", net, "--network-alias", alias,
               *_docker_run_args(pod, c, tmp_path, token_file, vol), c["image"], *c["args"])
            started.append(name)
            return name

        def port(deploy: str) -> int:
            return pods[deploy]["containers"][0]["readinessProbe"]["grpc"]["port"]

        t0 = time.monotonic()
        prod = start("scd-producer")
        print(f"\nproducer pod (init: scd assets on an empty volume) started in {time.monotonic() - t0:.0f} s",
              file=sys.stderr)
        live = pods["scd-producer"]["containers"][0]["livenessProbe"]["grpc"]
        wait_for("the producer to be live", lambda: health(prod, live["port"], live["service"]) == "SERVING")
        # no consumer yet: live (not restarted) but not ready (no traffic routed to it)
        assert health(prod, port("scd-producer")) == "NOT_SERVING"
        cons = start("scd-consumer-strong")
        wait_for("the consumer to be ready", lambda: health(cons, port("scd-consumer-strong")) == "SERVING")
        wait_for("the producer to become ready", lambda: health(prod, port("scd-producer")) == "SERVING", every=2)
        # one request through the producer's HTTP front, from inside its network namespace
        req = ("import json,urllib.request as u;t=open('/run/secrets/scd_token').read().strip()\n"
               "b=json.dumps({'model':'strong','messages':[{'role':'user','content':'What is the capital of France?'}],"
               "'max_tokens':8,'method':'scd'}).encode()\n"
               "r=u.urlopen(u.Request('http://localhost:8080/v1/chat/completions',b,{'Authorization':'Bearer '+t,"
               "'Content-Type':'application/json'}),timeout=180);print(r.read().decode())")
        import json

        out = json.loads(sh("docker", "exec", prod, "python", "-c", req).stdout)
        assert out["choices"][0]["message"]["content"].strip() and out["scd_timings"]["method"] == "scd", out
    finally:
        for name in started:
            if sh("docker", "inspect", name, check=False).returncode == 0:
                logs = sh("docker", "logs", "--tail", "15", name, check=False)
                print(f"--- {name}\n{logs.stderr[-1500:]}", file=sys.stderr)
            sh("docker", "rm", "-f", name, check=False)
        sh("docker", "network", "rm", net, check=False)
        sh("docker", "volume", "rm", "-f", vol, check=False)
