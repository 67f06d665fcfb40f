"""The console script, as a user runs it, and its verdict when parity breaks."""

import math
import subprocess
import sys

import pytest
import torch

import fused_zero
from fused_zero.demo import run as demo


def test_demo_runs_and_reports_parity(tmp_path):
    proc = subprocess.run(
        ["fused-zero", "demo", "--steps", "6", "--overlap", "backward", "--profile", str(tmp_path / "trace")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PARITY OK" in proc.stdout
    # the README's promise: on CPU (torch backend, fp32) the parameters are bit-identical to torch.optim's
    assert "largest parameter difference over 6 steps: 0.000e+00" in proc.stdout, proc.stdout
    assert "optimizer state per rank" in proc.stdout
    assert list((tmp_path / "trace").glob("*.json")), "no torch.profiler trace written"


def test_demo_help(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fused_zero.demo.cli", "demo", "--help"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and "--overlap" in proc.stdout


def train_with_a_corrupted_parameter(rank, world, cfg, value):
    """The demo's rank function, with one element of one of rank 1's parameters overwritten by ``value``
    after its second fused_zero step: what a broken optimizer would do, seen only by rank 1."""
    real_step = fused_zero.AdamW.step
    calls = []

    def step(self, closure=None):
        out = real_step(self, closure)
        calls.append(1)
        if len(calls) == 2 and rank == 1:
            self.synchronize()
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = value
        return out

    fused_zero.AdamW.step = step
    return demo._train(rank, world, cfg)


@pytest.mark.parametrize("value", [math.nan])  # NaN: max() and the all-reduce used to drop it
def test_demo_exits_nonzero_when_parity_breaks(monkeypatch, capsys, value):
    real_run_ranks = demo.run_ranks
    monkeypatch.setattr(demo, "run_ranks", lambda fn, world, cfg, timeout: real_run_ranks(
        train_with_a_corrupted_parameter, world, cfg, value, timeout=timeout))
    status = demo.run(demo.DemoConfig(world_size=2, steps=3))
    out = capsys.readouterr().out
    assert status == 1, out
    assert "PARITY BROKEN" in out
