"""bench/gpu_check.sh's status logic, where there is no GPU: a failing step makes the script exit
non-zero and name the step; passing and skipped steps do not. ``nvidia-smi`` is a stand-in on PATH."""

import os
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_check(tmp_path, nvidia_smi_status: int):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho fake nvidia-smi\nexit {nvidia_smi_status}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    python = bindir / "python3"  # the summary runs with the interpreter running this test
    python.symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "GPU_CHECK_ONLY": "nvidia-smi"}
    return subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("status", [0, 3])
def test_gpu_check_exit_status_names_the_failing_step(tmp_path, status):
    proc = run_check(tmp_path, status)
    lines = (tmp_path / "out" / "status.txt").read_text().splitlines()
    assert f"nvidia-smi {status}" in "\n".join(lines)
    assert "install skipped 0" in lines
    if status:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "FAILED: nvidia-smi (exit 3)" in proc.stderr
        assert "FAILED steps: nvidia-smi (exit 3)" in proc.stdout  # the summary says it too
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "every step passed" in proc.stdout
