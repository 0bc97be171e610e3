"""Calibration's spill folders: one a killed calibration left behind (gigabytes, for good) is removed
by the next; a running calibration's and any other folder are left alone."""

from __future__ import annotations

import os
import subprocess
import sys

from tools.calibration.spill import SpillDir


def test_the_spill_folder_of_a_process_that_is_gone_is_removed_by_the_next_calibration(tmp_path):
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f"scd-spill-{int(ended.stdout)}-k1ll3d"
    (dead / "states").mkdir(parents=True)
    (dead / "states" / "p0.safetensors").write_bytes(b"x" * 1000)
    running = tmp_path / f"scd-spill-{os.getppid()}-running"  # the process that started this test: alive
    running.mkdir()
    other = tmp_path / "scd-spill-abc123"  # an earlier build's name: no process id in it
    other.mkdir()
    spill = SpillDir(tmp_path)
    assert not dead.exists() and running.exists() and other.exists()
    assert spill.path.parent == tmp_path and spill.path.name.startswith(f"scd-spill-{os.getpid()}-")
    spill.cleanup()
    assert not spill.path.exists()
