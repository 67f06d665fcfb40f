"""fused_zero.transformers on 2 gloo ranks launched as torchrun does: the Hugging Face Trainer with a
fused_zero optimizer (optimizer_cls_and_kwargs, and optimizers=(opt, sched)) against the Trainer with
optim="adamw_torch", a tiny GPT-2 built from a config: parameters, losses, grad_norm and learning rates
bit for bit over 20 steps with clipping on and gradient accumulation; the rank-0-only checkpoint at step
10 equal to torch's and a resume from it equal to the uninterrupted run; ZeRO-2 with the clip routed
into the update to rounding; overlap="backward" clipped in the backward to the Trainer's max_grad_norm,
to rounding; bf16; fp16 with the Trainer's GradScaler and an inf on one rank (the same
step skipped everywhere); refusals before training. One spawn for all of it."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import run_ranks

from fused_zero.demo.spawn import _free_port

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="the transformers extra is not installed: pip install 'fused-zero[transformers]'")


def test_trainer_with_fused_zero(tmp_path):
    from transformers_cases import CLIP, STEPS, run

    results = run_ranks(run, 2, _free_port(), str(tmp_path), fresh=True)
    for r in results:
        assert r["distributed"] == "DistributedType.MULTI_CPU"
        assert r["stepping"] == ("fused_zero.optimizer", True), r["stepping"]
        assert r["zero2_mode"] == ("reduce_scatter", False), r["zero2_mode"]
        assert r["fp16_dtypes"] == ["torch.float16"], r["fp16_dtypes"]  # the forward ran in autocast
        assert r["parity"] == [] and r["log"] == [], (r["parity"][:5], r["log"][:5])
        assert sum(n > CLIP for n in r["clipped"]) >= STEPS // 2, r["clipped"]  # the clip changed most steps
        assert r["saved"] == [], r["saved"]
        assert r["resume"] == [] and r["resume_log"] == [], (r["resume"][:5], r["resume_log"][:5])
        assert r["zero2"] == [] and r["zero2_log"] == [], (r["zero2"][:5], r["zero2_log"][:5])
        assert r["defaults_mode"] == "backward" and r["defaults_clip"] == CLIP, (r["defaults_mode"], r["defaults_clip"])
        assert r["defaults"] == [] and r["defaults_log"] == [], (r["defaults"][:5], r["defaults_log"][:5])
        assert r["bf16"] == [], r["bf16"][:5]
        assert r["fp16"] == [] and r["fp16_skipped"] and r["fp16_lr"] == [], (r["fp16"][:5], r["fp16_lr"])
        scales, ref_scales = r["fp16_scales"]
        # halved at the inf (step 3) on every rank, as the reference's
        assert scales == ref_scales and scales[2] == scales[1] / 2, r["fp16_scales"]
        assert r["refusals"] == ["ok"] * 4, r["refusals"]
    assert results[0]["fp16_scales"] == results[1]["fp16_scales"]


_ONE_LAUNCH = """\
import gc, os, runpy, sys

# examples/train_transformers.py, then docs/integrations.md's code, each in a folder of its own (their
# out/trainer_out) and as its own __main__; the second Trainer finds the first one's process group
for folder, script in zip(("example", "docs"), sys.argv[1:]):
    os.makedirs(folder, exist_ok=True)
    os.chdir(folder)
    runpy.run_path(script, run_name="__main__")
    os.chdir("..")
    gc.collect()  # the first run's optimizer and its checkpoint server go before the second starts
    print(f"ran {folder}", flush=True)
"""


@pytest.fixture(scope="module")
def trainer_scripts(tmp_path_factory):
    """examples/train_transformers.py and docs/integrations.md's "The Hugging Face Trainer" code, both
    under one torchrun launch of 2 CPU processes (a launch and the Trainer's imports cost more than
    either run's 20 steps): the example first, then the docs' code."""
    tmp = tmp_path_factory.mktemp("trainer_scripts")
    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "integrations.md").read_text()
    section = page.split("## The Hugging Face Trainer", 1)[1]
    docs = tmp / "readme_trainer.py"
    docs.write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    launcher = tmp / "both.py"
    launcher.write_text(_ONE_LAUNCH)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(launcher),
           str(root / "examples" / "train_transformers.py"), str(docs)]
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=400)
    return tmp, done, done.stdout[-2000:] + done.stderr[-3000:]


def test_trainer_example_runs(trainer_scripts):
    """examples/train_transformers.py under torchrun, as its docstring says."""
    tmp, done, tail = trainer_scripts
    example = done.stdout.split("ran example", 1)[0]
    assert "ran example" in done.stdout and "last loss" in example, tail
    assert (tmp / "example" / "out" / "trainer_out" / "checkpoint-10" / "optimizer.pt").exists()


def test_readme_trainer_section_runs_as_written(trainer_scripts):
    """docs/integrations.md's "The Hugging Face Trainer" code, under torchrun on 2 CPU processes."""
    tmp, done, tail = trainer_scripts
    assert done.returncode == 0 and "ran docs" in done.stdout, tail
    assert (tmp / "docs" / "out" / "trainer_out" / "checkpoint-20" / "optimizer.pt").exists()
