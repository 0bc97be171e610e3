"""The Kubernetes pods simulated under ``docker run`` from the manifests themselves (their image,
args, env, mounted config, init container and probes), starting from an empty volume."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import yaml
from deploy_support import DEPLOY, IMAGE, PROJECT, health, sh, wait_for

pytestmark = pytest.mark.deploy


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
