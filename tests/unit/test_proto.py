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


