"""The deploy files wire what operations need: the HTTP front and metrics ports, the bearer token
from a secret on both services, and the artifact store on a volume both containers share."""

from pathlib import Path

import pytest
import yaml

from consumer_service.settings import ConsumerSettings
from producer_service.settings import ProducerSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_settings_files_enable_http_metrics_and_the_token():
    p = ProducerSettings.load(DEPLOY / "producer.yaml")
    c = ConsumerSettings.load(DEPLOY / "consumer.yaml")
    assert p.http.port == 8080 and c.http.port == 9090
    assert p.security.token_file == c.security.token_file == "/run/secrets/scd_token"
    assert c.cache_budget_bytes > 0 and c.fallback in ("fail", "recompute")


def test_compose_shares_the_store_and_the_secret_and_joins_the_nodes_only_by_grpc():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    svcs = compose["services"]
    prod, cons, assets = svcs["producer"], svcs["consumer-strong"], svcs["assets"]
    assert any(p.endswith(":8080") for p in prod["ports"]) and any(p.endswith(":9090") for p in cons["ports"])
    assert assets["command"][:3] == ["assets", "--store", "/store"]  # the job publishes the store it mounts
    # it prepares the consumer served (only: each built-in model is ~0.5 GB of the volume)
    assert assets["command"][3:] == ["--pair", "strong"]
    for svc in (prod, cons):
        assert "scd_token" in svc["secrets"]
        assert "store:/store:ro" in svc["volumes"]
        assert svc["pull_policy"] == "never"
    assert cons["environment"]["CONSUMER__ARTIFACT_STORE"] == "/store"
    assert prod["environment"]["PRODUCER__CONSUMERS__STRONG__ARTIFACTS"] == "/store/strong"
    assert "scd_token" in compose["secrets"]
    # two nodes: the only network the two containers share is the internal gRPC link
    shared = set(prod["networks"]) & set(cons["networks"])
    assert shared == {"grpc-link"} and compose["networks"]["grpc-link"]["internal"] is True
    assert cons["healthcheck"] and prod["depends_on"]["consumer-strong"]["condition"] == "service_healthy"


def test_k8s_mounts_the_token_secret_and_exposes_http_and_metrics():
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "scd-serve.yaml").read_text()))
    deps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    for name, port in (("scd-producer", 8080), ("scd-consumer-strong", 9090)):
        spec = deps[name]["spec"]["template"]["spec"]
        c = spec["containers"][0]
        assert port in [p["containerPort"] for p in c["ports"]]
        assert any(m["mountPath"] == "/run/secrets" for m in c["volumeMounts"])
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["token"]["secret"]["secretName"] == "scd-token"
        assert vols["artifacts"]["persistentVolumeClaim"]["claimName"] == "scd-artifacts"
    pvc = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]


def test_the_image_holds_every_package_the_entry_point_needs_and_runs_unprivileged():
    """The CLI (``scd``) lives in tools/ and the default CMD reads deploy/: both must be in the image."""
    import tomllib

    root = DEPLOY.parent
    text = (DEPLOY / "Dockerfile").read_text()
    # what the build copies from its context (not from an earlier stage): every argument but the destination
    copied = {src.rstrip("/") for line in text.splitlines() if line.startswith("COPY ") and "--from=" not in line
              for src in line.split()[1:-1]}
    include = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in include} | {"deploy", "proto", "artifacts"} <= copied
    user = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert user and user[-1] not in ("root", "0")
    exposed = {int(p) for line in text.splitlines() if line.startswith("EXPOSE ") for p in line.split()[1:]}
    assert {50051, 50052, 8080, 9090} <= exposed and "HEALTHCHECK" in text and "liveness" in text
    # the build context is an allow-list: everything is ignored but what the image copies
    lines = [x for x in (root / ".dockerignore").read_text().splitlines() if x and not x.startswith("#")]
    assert lines[0] == "*" and "deploy/scd-token" in lines
    allowed = {x[1:].rstrip("/") for x in lines if x.startswith("!")}
    assert not allowed & {".venv", ".git", "results", "tests", "docs", ".venv-vllm"}
    assert copied <= allowed and ".wheelhouse" in copied
    assert "deploy/scd-token" in (root / ".gitignore").read_text().split()


@pytest.mark.parametrize("name", ["scd-serve.yaml", "scd-serve-cpu.yaml"])
def test_k8s_images_are_not_pulled_from_a_registry_and_liveness_is_not_readiness(name):
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"]
    containers = [c for p in pods for c in p["containers"]]
    assert containers and all(c["imagePullPolicy"] == "IfNotPresent" for c in containers + [
        i for p in pods for i in p["initContainers"]])
    assert all(not c["image"].endswith(":latest") for c in containers)
    # every pod prepares the models and publishes the store on the shared volume before it serves
    for p in pods:
        (init,) = p["initContainers"]
        assert init["args"] == ["assets", "--store", "/artifacts/store", "--pair", "strong"]
        assert {"name": "SCD_HOME", "value": "/artifacts"} in init["env"]
        assert p["securityContext"]["fsGroup"] == p["securityContext"]["runAsUser"]  # the volume is writable
    # a producer whose consumer is down is not ready, but it must not be restarted for it
    assert all(c["livenessProbe"]["grpc"]["service"] == "liveness" for c in containers)
    assert all("service" not in c["readinessProbe"]["grpc"] for c in containers)


def test_the_cpu_manifests_are_generated_from_the_gpu_ones():
    from tools.deploy import k8s

    assert (DEPLOY / "k8s" / "scd-serve-cpu.yaml").read_text() == k8s.render(), \
        "deploy/k8s/scd-serve-cpu.yaml is stale: run `python -m tools.deploy.k8s`"
    cpu = [d for d in yaml.safe_load_all(k8s.render()) if d]
    cm = next(d for d in cpu if d["kind"] == "ConfigMap")
    for name, cls in (("producer.yaml", ProducerSettings), ("consumer.yaml", ConsumerSettings)):
        s = cls.load(overrides=(), **yaml.safe_load(cm["data"][name]))
        assert (s.model.device, s.model.dtype) == ("cpu", "float32")
    limits = [c["resources"]["limits"] for d in cpu if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]]
    assert limits and not any("nvidia.com/gpu" in x for x in limits)


@pytest.mark.parametrize("name", ["scd-serve.yaml", "scd-serve-cpu.yaml"])
def test_k8s_manifests_validate_against_the_kubernetes_schemas(name):
    """Offline, strict (unknown fields refused), against Kubernetes 1.32's schemas."""
    import kubernetes_validate

    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]
    assert len(docs) >= 7
    for d in docs:
        kubernetes_validate.validate(d, "1.32.0", strict=True)  # raises ValidationError naming the field
