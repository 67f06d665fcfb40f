"""Promises the README makes that no other test holds: the example runs as written, and the bound on the
replicated tail."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fused_zero.pipeline.layout import BucketLayout

ROOT = Path(__file__).resolve().parents[1]


def test_example_runs_as_written_on_two_ranks():
    """``torchrun --nproc_per_node 2 examples/train_ddp.py``, as the README and its docstring say."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "examples/train_ddp.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 5 and losses[-1] < losses[0], proc.stdout
    assert "optimizer bytes on this rank" in proc.stdout


@pytest.mark.parametrize("world", [2, 8, 64, 100, 1024])
@pytest.mark.parametrize("numel", [7, 1000, 4099, 65_537, 6_553_600, 8 * 1024 * 1024, 13_107_200])
def test_replicated_tail_bound(world, numel):
    """Under W x 32 elements always; under an eighth of a slice in buckets of at least 8 W^2 elements,
    under W elements in smaller ones (README, Memory)."""
    layout = BucketLayout.build([0], [numel], [0], world, 0)
    assert layout.tail < world * 32
    if numel >= 8 * world * world:
        assert layout.tail <= numel / world / 8
    else:
        assert layout.tail < world


def test_default_buckets_at_1024_ranks():
    """The README's figures: DDP's 25 MiB bucket at W=1024 in bf16 and in fp32."""
    bf16 = BucketLayout.build([0], [25 * 2**20 // 2], [0], 1024, 0)
    assert bf16.tail <= bf16.numel / 1024 / 8
    fp32 = BucketLayout.build([0], [25 * 2**20 // 4], [0], 1024, 0)
    assert fp32.numel // 1024 == 6400 and fp32.tail < 1024
    worst = BucketLayout.build([0], [25 * 2**20 // 4 + 1023], [0], 1024, 0)
    assert worst.tail == 1023
