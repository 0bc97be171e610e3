"""The CPU variant of the Kubernetes manifests, generated from the GPU ones (``deploy/k8s/scd-serve.yaml``).

One hand-written file holds the deployment; the CPU file differs only where a CPU node must: the
models run in fp32 on the CPU, the pods ask for CPU cores instead of a GPU, and no node selector
asks for one. ``python -m tools.deploy.k8s`` rewrites ``deploy/k8s/scd-serve-cpu.yaml``; a test
checks that the committed file is what this makes.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
GPU_FILE, CPU_FILE = K8S / "scd-serve.yaml", K8S / "scd-serve-cpu.yaml"
CPU_RESOURCES = {"requests": {"cpu": "2", "memory": "3Gi"}, "limits": {"cpu": "4", "memory": "6Gi"}}
HEADER = ("# Kubernetes on CPU nodes: GENERATED from scd-serve.yaml by `python -m tools.deploy.k8s`; edit that file.\n"
          "# The same deployment, the models in fp32 on the CPU, CPU requests instead of a GPU.\n")


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's settings files) as literal blocks, as in the source."""


_Dumper.add_representer(
    str, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style="|" if "\n" in v else None))


def _cpu_settings(text: str) -> str:
    s = yaml.safe_load(text)
    s["model"] = {**s["model"], "device": "cpu", "dtype": "float32"}
    return yaml.safe_dump(s, sort_keys=False, default_flow_style=None, width=120)


def cpu_variant(docs: list[dict]) -> list[dict]:
    out = []
    for d in map(copy.deepcopy, docs):
        if d["kind"] == "ConfigMap":
            d["data"] = {k: _cpu_settings(v) if k.endswith(".yaml") else v for k, v in d["data"].items()}
        if d["kind"] == "Deployment":
            spec = d["spec"]["template"]["spec"]
            spec.pop("nodeSelector", None)
            for c in spec["containers"]:
                c["resources"] = copy.deepcopy(CPU_RESOURCES)
        out.append(d)
    return out


def render() -> str:
    docs = [d for d in yaml.safe_load_all(GPU_FILE.read_text()) if d]
    return HEADER + yaml.dump_all(cpu_variant(docs), Dumper=_Dumper, sort_keys=False, default_flow_style=None,
                                  width=120)


def main() -> None:
    CPU_FILE.write_text(render())
    print(f"wrote {CPU_FILE}", file=sys.stderr)


if __name__ == "__main__":
    main()
