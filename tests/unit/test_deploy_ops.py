"""The deploy files wire what operations need: the HTTP front and metrics ports, the bearer token
from a secret on both services, and the artifact store on a volume both containers share."""

from pathlib import Path

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


def test_compose_shares_the_store_and_the_secret():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    prod, cons = compose["services"]["producer"], compose["services"]["consumer-strong"]
    assert "8080:8080" in prod["ports"] and "9090:9090" in cons["ports"]
    for svc in (prod, cons):
        assert "scd_token" in svc["secrets"]
        assert "artifacts:/app/artifacts/store" in svc["volumes"]
    assert "scd_token" in compose["secrets"]


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
    copied = {line.split()[1].rstrip("/") for line in text.splitlines() if line.startswith("COPY ")}
    include = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {p.rstrip("*") for p in include} | {"deploy", "proto", "artifacts"} <= copied
    user = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert user and user[-1] not in ("root", "0")
    exposed = {int(p) for line in text.splitlines() if line.startswith("EXPOSE ") for p in line.split()[1:]}
    assert {50051, 50052, 8080, 9090} <= exposed and "HEALTHCHECK" in text and "liveness" in text
    ignored = (root / ".dockerignore").read_text().split()
    assert ".venv/" in ignored and ".git/" in ignored
    assert "deploy/scd-token" in (root / ".gitignore").read_text().split()


def test_k8s_images_are_not_pulled_from_a_registry_and_liveness_is_not_readiness():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "scd-serve.yaml").read_text()) if d]
    containers = [c for d in docs if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]]
    assert containers and all(c["imagePullPolicy"] == "IfNotPresent" for c in containers)
    # a producer whose consumer is down is not ready, but it must not be restarted for it
    assert all(c["livenessProbe"]["grpc"]["service"] == "liveness" for c in containers)
    assert all("service" not in c["readinessProbe"]["grpc"] for c in containers)
