"""The benchmark commands run in their smallest form (no timings asserted)."""

import json
import subprocess
import sys


def test_bench_overlap_tiny(tmp_path):
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, "-m", "tools.cli", "bench-overlap", "--tiny", "--tokens", "200",
                        "--iters", "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(last["methods"]["raw"]) >= {"transfer_ms", "tail_ms", "reconstruct_ms", "wire_bytes"}
    assert json.loads(out.read_text())["prompt_tokens"] == 200
