"""fused_zero.accelerate on 2 gloo ranks launched as `accelerate launch` does: an Accelerate loop with
gradient accumulation and a scheduler matches Accelerate + torch.optim.AdamW after every step (fp16 too,
with Accelerate's GradScaler as it is on a GPU and an inf on one rank), clipping is routed to the
optimizer (the clip applied inside the update, the pre-clip norm returned; a norm query after the clip
refused, never lifting it) or left to Accelerate where step() reads param.grad (bit for bit),
save_state/load_state resume bit-identically, refusals carry a message."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import run_ranks

from fused_zero.demo.spawn import _free_port

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                reason="the accelerate extra is not installed: pip install 'fused-zero[accelerate]'")


def test_accelerate_attach(tmp_path):
    from accelerate_cases import run

    results = run_ranks(run, 2, _free_port(), str(tmp_path), fresh=True)
    for r in results:
        assert r["distributed"] == "DistributedType.MULTI_CPU"
        assert r["plain"] == [], r["plain"]
        assert r["clip"] == [] and r["clip_moved"] and r["clip_returned"][0], (r["clip"], r["clip_returned"])
        moved, kinds, refusal, first_calls_equal = r["query_after"]
        assert moved == [] and kinds == ["str"] and first_calls_equal, r["query_after"]
        assert "after this step's clip to 0.05: fused_zero clips once" in refusal, refusal
        assert r["query_before"] == ([], True), r["query_before"]
        assert r["clip_native"] == ([], True), r["clip_native"]
        assert r["resume"] == [], r["resume"]
        assert r["refusals"] == ["ok"] * 5, r["refusals"]
        assert r["fp16"] == {"backward": [], "step-clip": []}, r["fp16"]
        for extra, ref_extra in r["fp16_extra"].values():
            # after every optimizer step: the same scale, skip report and LR as the reference; the inf of
            # step 2 halves the scale, is reported skipped, and the scheduler does not advance
            assert extra == ref_extra, (extra, ref_extra)
            assert [skipped for _, skipped, _, _ in extra] == [False, False, True, False, False, False], extra
            assert extra[2][0] == extra[1][0] / 2 and extra[2][2] == extra[1][2], extra
            assert {dtype for *_, dtype in extra} == {"torch.float16"}, extra  # the forward ran in autocast
        # neither Accelerate's step nor the routed clip_grad_norm_ calls scaler.unscale_ on our optimizer
        assert r["fp16_unscale_calls"] == {"backward": [], "step-clip": []}, r["fp16_unscale_calls"]
        assert r["fp16_unscale_all"] == [], r["fp16_unscale_all"]
        assert r["fp16_refusals"] == ["ok"] * 3, r["fp16_refusals"]
    assert results[0]["fp16_extra"] == results[1]["fp16_extra"]


def test_accelerate_example_runs(tmp_path):
    """examples/train_accelerate.py launched with `accelerate launch` as its docstring says."""
    script = Path(__file__).resolve().parents[2] / "examples" / "train_accelerate.py"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", str(_free_port()), str(script)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "last loss" in done.stdout, done.stderr[-3000:]
    assert (tmp_path / "out" / "checkpoint" / "optimizer.bin").exists()
