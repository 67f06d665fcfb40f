"""fused_zero.accelerate on 2 gloo ranks launched as `accelerate launch` does: an Accelerate loop with
gradient accumulation and a scheduler matches Accelerate + torch.optim.AdamW after every step, clipping
is routed to the optimizer, save_state/load_state resume bit-identically, refusals carry a message."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import run_ranks

from fused_zero.spawn import _free_port

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                reason="the accelerate extra is not installed: pip install 'fused-zero[accelerate]'")


def test_accelerate_attach(tmp_path):
    from accelerate_cases import run

    for r in run_ranks(run, 2, _free_port(), str(tmp_path)):
        assert r["distributed"] == "DistributedType.MULTI_CPU"
        assert r["plain"] == [], r["plain"]
        assert r["clip"] == [] and r["clip_moved"] and r["clip_returned"], r["clip"]
        assert r["resume"] == [], r["resume"]
        assert r["refusals"] == ["ok"] * 5, r["refusals"]


def test_accelerate_example_runs(tmp_path):
    """examples/train_accelerate.py launched with `accelerate launch` as its docstring says."""
    script = Path(__file__).parent.parent / "examples" / "train_accelerate.py"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", str(_free_port()), str(script)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "last loss" in done.stdout, done.stderr[-3000:]
    assert (tmp_path / "checkpoint" / "optimizer.bin").exists()
