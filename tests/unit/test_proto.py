"""The checked-in stubs are what the proto generates; the services import only what they may."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh(tmp_path):
    out = tmp_path / "gen"
    (out / "shared" / "rpc").mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-Ishared/rpc={ROOT / 'proto'}", f"--python_out={out}",
         f"--pyi_out={out}", f"--grpc_python_out={out}", str(ROOT / "proto" / "scd.proto")],
        check=True, cwd=ROOT,
    )
    for name in ("scd_pb2.py", "scd_pb2.pyi", "scd_pb2_grpc.py"):
        fresh = (out / "shared" / "rpc" / name).read_text()
        assert fresh == (ROOT / "shared" / "rpc" / name).read_text(), f"{name} is stale: run `make proto`"


def test_services_do_not_import_offline_code():
    code = ("import sys, producer_service.servicer, consumer_service.servicer, producer_service.server, "
            "consumer_service.server; bad=[m for m in sys.modules if m.startswith(('tools.calibration', "
            "'tools.eval'))]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
