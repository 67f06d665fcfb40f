"""The console script, as a user runs it, and its verdict when parity breaks."""

import json
import math
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import fused_zero
from fused_zero.demo import run as demo
from fused_zero.demo.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_and_reports_parity(tmp_path):
    proc = subprocess.run(
        ["fused-zero", "demo", "--steps", "20", "--overlap", "backward", "--profile", str(tmp_path / "trace")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # the README's promise: on CPU (torch backend, fp32) the parameters are bit-identical to torch.optim's,
    # and the report says that this is the claim it checked (no tolerance beside it)
    assert "largest parameter difference over 20 steps, every rank: 0.000e+00; claimed: bit-identical" in out, out
    assert "PARITY OK" in out and "tolerance" not in out, out
    assert "maximum over the 2 ranks" in out, out
    assert "optimizer state per rank" in out
    assert "no measure of GPU speed" in out, out  # the CPU timing says what it is
    assert re.search(r"^took \d+\.\d s", out, re.M), out
    # the progress lines (stderr, not a terminal) and the table show the same steps
    table = [int(line.split()[0]) for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\.\d{6}\s", line)]
    progress = [int(m) for m in re.findall(r"step\s+(\d+)/20", proc.stderr)]
    assert table == progress == [1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20], (table, progress)
    traces = list((tmp_path / "trace").glob("*.json"))
    assert traces, "no torch.profiler trace written"
    assert f"trace of rank 0, steps 4-6: {traces[0]}" in out, out  # says where the trace went
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    # the ranges docs/benchmarks.md names (param_sync="step": the wait is at the end of step())
    assert {"fused_zero.reduce", "fused_zero.update", "fused_zero.all_gather", "fused_zero.gather_wait"} <= names


def test_demo_trains_muon_beside_adamw_bit_for_bit(tmp_path):
    """``--optimizer muon`` (any case): Muon for the blocks' matrices beside AdamW, two fused_zero
    optimizers over one DDP module, against torch.optim.Muon + torch.optim.AdamW."""
    proc = subprocess.run(["fused-zero", "demo", "--optimizer", "muon", "--steps", "12", "--overlap", "bucket"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Muon (lr 0.02) + AdamW, 2 ranks" in proc.stdout, proc.stdout
    assert "every rank: 0.000e+00; claimed: bit-identical" in proc.stdout and "PARITY OK" in proc.stdout


def test_demo_help_and_version(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fused_zero.demo.cli", "demo", "--help"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and "--overlap" in proc.stdout
    demo_parser = build_parser()._subparsers._group_actions[0].choices["demo"]
    helps = {a.option_strings[-1]: a.help for a in demo_parser._actions}
    assert all(helps.values()), [flag for flag, text in helps.items() if not text]  # every option says what it is
    version = subprocess.run(["fused-zero", "--version"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version.returncode == 0 and version.stdout.strip() == f"fused-zero {declared}", version
    assert fused_zero.__version__ == declared


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
            with torch.no_grad():  # through .data, as the engine's own buffers are written: a write through
                # the parameter on one rank is the user's, refused on every rank (pipeline/reducing/weight_watch.py)
                self.param_groups[0]["params"][0].data.view(-1)[0] = value
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
