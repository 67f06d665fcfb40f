"""FusedZeroStrategy on 2 gloo ranks: Trainer.fit matches Lightning + torch.optim.AdamW after every batch
(plain, accumulation, scheduler; clipping to rounding), resumes bit-identically from a ModelCheckpoint,
trains in bf16-true, and refuses what it cannot honour with a message. One spawn for all of it."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="the lightning extra is not installed: pip install 'fused-zero[lightning]'")


def test_lightning_strategy(tmp_path):
    from lightning_cases import run

    for r in run_ranks(run, 2, str(tmp_path)):
        assert r["plain"] == [], r["plain"]
        assert r["accumulate"] == [], r["accumulate"]
        assert r["scheduler"] == [], r["scheduler"]
        assert r["clip"] == [] and r["clip_moved"], r["clip"]
        assert r["resume"] == [], r["resume"]
        assert r["bf16"] == [True, True, True]
        assert r["refusals"] == ["ok"] * 5, r["refusals"]


def test_lightning_example_runs(tmp_path):
    """examples/train_lightning.py as written: Lightning starts the second process itself."""
    script = Path(__file__).parent.parent / "examples" / "train_lightning.py"
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "max_epochs=2` reached" in done.stdout + done.stderr, done.stderr[-3000:]
