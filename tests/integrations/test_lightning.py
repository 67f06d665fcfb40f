"""FusedZeroStrategy on 2 gloo ranks: Trainer.fit matches Lightning + torch.optim.AdamW after every batch
(plain, accumulation, scheduler; clipping to rounding; 16-mixed with Lightning's GradScaler and an inf on
one rank; bf16-mixed), resumes bit-identically from a ModelCheckpoint, trains in bf16-true (to bf16
rounding of torch.optim's own bf16 run), and refuses what it cannot
honour with a message. One spawn for all of it."""

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

    results = run_ranks(run, 2, str(tmp_path), fresh=True)
    for r in results:
        assert r["plain"] == [], r["plain"]
        assert r["accumulate"] == [], r["accumulate"]
        assert r["scheduler"] == [], r["scheduler"]
        assert r["clip"] == [] and r["clip_moved"], r["clip"]
        assert r["resume"] == [], r["resume"]
        assert r["bf16"] == [True, True, True]
        assert r["bf16_mixed"] == [], r["bf16_mixed"]
        assert r["bf16_true"] == [], r["bf16_true"]
        assert r["fp16"] == {"backward": [], "step-clip": []}, r["fp16"]
        for scales, ref_scales in r["fp16_scales"].values():
            # the same scale on both sides after every batch: halved at the inf (batch 2), grown after
            # 3 clean steps; both ranks' scalers agree (the results of both ranks are equal below)
            assert scales == ref_scales and scales[2] == scales[1] / 2 and scales[5] == 2 * scales[4], scales
        assert r["refusals"] == ["ok"] * 6, r["refusals"]
    assert results[0]["fp16_scales"] == results[1]["fp16_scales"]


def test_lightning_example_runs(tmp_path):
    """examples/train_lightning.py as written: Lightning starts the second process itself."""
    script = Path(__file__).resolve().parents[2] / "examples" / "train_lightning.py"
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "max_epochs=2` reached" in done.stdout + done.stderr, done.stderr[-3000:]
