"""The console script, as a user runs it."""

import subprocess
import sys


def test_demo_runs_and_reports_parity(tmp_path):
    proc = subprocess.run(
        ["fused-zero", "demo", "--steps", "6", "--overlap", "backward", "--profile", str(tmp_path / "trace")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PARITY OK" in proc.stdout
    assert "optimizer state per rank" in proc.stdout
    assert list((tmp_path / "trace").glob("*.json")), "no torch.profiler trace written"


def test_demo_help(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fused_zero.cli", "demo", "--help"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and "--overlap" in proc.stdout
