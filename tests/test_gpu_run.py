"""bench/gpu_run.py, the measurement program for a GPU machine, run here as its CPU dry run: tiny sizes,
CPU tensors, the process group on gloo, the kernels through Triton's interpreter (``TRITON_INTERPRET=1``
in the child's environment, before the kernels are imported). Every section writes its lines, the
summary renders from the lines alone, a killed run leaves valid lines and a summary, and a budget too
small for the sections skips with a line instead of overrunning. The trace reader is checked on a
synthetic GPU trace (the dry run's traces hold CPU ops only)."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "bench" / "gpu_run.py"
HEADINGS = ["## Environment", "## Compile", "## Kernels", "## Step level", "## torch.optim", "## End to end",
            "## Profile", "## ncu", "## Two or more GPUs", "## Skipped and failed", "## Time"]
FILES = {"run.jsonl", "summary.md", "run.log", "trace-adamw-bucket.json.gz"}


def _env(tmp: Path) -> dict:
    return {**os.environ, "TRITON_INTERPRET": "1", "TRITON_CACHE_DIR": str(tmp / "triton"),
            "PYTHONPATH": str(ROOT)}


def _lines(path: Path) -> list[dict]:
    """Every complete line (a torn last line, without its newline, left out), each valid JSON."""
    text = path.read_text()
    complete = text if text.endswith("\n") else text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def _summarize(path: Path, tmp: Path) -> str:
    proc = subprocess.run([sys.executable, str(PROGRAM), "--summarize", str(path)], capture_output=True, text=True,
                          env=_env(tmp), timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_run")
    out = tmp / "out"
    proc = subprocess.run([sys.executable, str(PROGRAM), "--out", str(out), "--dry-run"], capture_output=True,
                          text=True, env=_env(tmp), timeout=300)
    return proc, out, tmp


def test_the_dry_run_writes_every_kind_of_line(dry):
    proc, out, _ = dry
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = _lines(out / "run.jsonl")
    assert lines[0]["kind"] == "env" and lines[0]["dry_run"] is True, lines[0]
    for key in ("torch", "triton", "cuda", "nccl", "triton_cache", "plan", "budget", "gpu"):
        assert key in lines[0], key
    kinds = {r["kind"] for r in lines}
    assert {"env", "compile", "kernel", "step_level", "torch_kernel", "e2e", "trace", "multi_gpu", "skip",
            "section", "end"} <= kinds, kinds
    assert [r for r in lines if r["kind"] == "error"] == [], "a dry-run measurement failed"
    assert lines[-1]["kind"] == "end"
    assert all({"kind", "section", "t"} <= set(r) for r in lines)
    sections = [r["name"] for r in lines if r["kind"] == "section"]
    assert sections == ["env", "compile", "kernels", "e2e", "profile", "ncu", "multi_gpu", "summary"], sections

    compiled = {r["variant"] for r in lines if r["kind"] == "compile"}
    assert {"adamw-fp32", "adamw-bf16master", "sgd-fp32", "sgd-bf16master", "adamw-8bit-fp32",
            "step-adamw-fp32"} <= compiled, compiled
    kernels = [r for r in lines if r["kind"] == "kernel"]
    sizes = sorted({r["size"] for r in kernels})
    assert len(sizes) == 2, sizes
    for size in sizes:
        at = {r["provider"]: r for r in kernels if r["size"] == size}
        assert {"copy-28B", "copy-20B", "copy-16B", "adamw-fp32", "adamw-bf16master", "sgd-fp32", "sgd-bf16master",
                "adamw-8bit-fp32", "adamw-8bit-bf16master"} <= set(at), sorted(at)
        assert at["adamw-fp32"]["bytes_per_element"] == 28 and at["sgd-fp32"]["bytes_per_element"] == 20
        assert at["adamw-8bit-fp32"]["copy"] == "copy-16B" and at["adamw-8bit-fp32"]["vs_copy"] > 0
    steps = [r for r in lines if r["kind"] == "step_level"]
    assert {r["provider"] for r in steps} >= {"step-adamw-fp32", "step-adamw-bf16master"}
    bf16 = next(r for r in steps if r["provider"] == "step-adamw-bf16master")
    assert (bf16["actual_bytes_per_element"], bf16["useful_bytes_per_element"]) == (30, 28)
    torch_rows = [r for r in lines if r["kind"] == "torch_kernel"]
    assert {r["provider"] for r in torch_rows} == {"torch-fused-adamw-fp32", "torch-foreach-adamw-fp32",
                                                   "torch-fused-adamw-bf16master", "torch-foreach-adamw-bf16master"}
    assert all(r["torch_over_fused_zero"] > 0 for r in torch_rows)

    e2e = [r for r in lines if r["kind"] == "e2e"]
    for model in ("gpt2-small", "demo"):
        systems = [r["system"] for r in e2e if r["model"] == model]
        assert systems == ["fwd+bwd", "ddp+torch-adamw", "ddp+zero", "fused_zero-bucket", "fused_zero-backward",
                           "fused_zero-step"], (model, systems)
    zero = next(r for r in e2e if r["system"] == "ddp+zero")
    assert "gloo refuses the overlap hook" in zero["note"]
    assert all(r["exposed_ms"] is not None for r in e2e if r["system"] != "fwd+bwd")

    traces = {r["optimizer"]: r for r in lines if r["kind"] == "trace"}
    assert set(traces) == {"adamw", "muon+adamw", "nadam", "rmsprop"}, set(traces)
    for r in traces.values():
        assert r["update_kernels_per_iter"] > 0 and r["ranges"].get("fused_zero.update"), r
        assert set(r["host_syncs_per_iter"]) == {"stream", "event", "device"}
    assert traces["adamw"]["trace_file"] == "trace-adamw-bucket.json.gz"
    assert traces["muon+adamw"]["ranges"].get("fused_zero.muon"), traces["muon+adamw"]["ranges"]
    multi = next(r for r in lines if r["kind"] == "multi_gpu")
    assert multi["world"] == 2 and len(multi["ranks"]) == 2 and multi["vs_ddp"] > 0, multi
    assert any(r["kind"] == "skip" and r["section"] == "ncu" for r in lines)


def test_the_dry_run_leaves_few_files_and_its_summary(dry):
    proc, out, tmp = dry
    assert proc.returncode == 0, proc.stderr[-4000:]
    names = set(os.listdir(out))
    assert names <= FILES and len(names) <= 8, names
    summary = (out / "summary.md").read_text()
    for heading in HEADINGS:
        assert heading in summary, heading
    assert "Complete:" in summary and "Dry run" in summary
    assert summary in proc.stdout, "the summary is printed"
    assert _summarize(out / "run.jsonl", tmp) == summary, "--summarize renders the same summary from the lines"


def _stopped(tmp_path: Path, sig: int) -> tuple[Path, int]:
    """The dry run, sent ``sig`` once its third compile line is written; its OUT and exit status."""
    out = tmp_path / "out"
    log = open(tmp_path / "stdout", "w")
    proc = subprocess.Popen([sys.executable, str(PROGRAM), "--out", str(out), "--dry-run"], stdout=log,
                            stderr=subprocess.STDOUT, env=_env(tmp_path))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            path = out / "run.jsonl"
            if path.exists() and path.read_text().count('"kind": "compile"') >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be stopped"
        os.kill(proc.pid, sig)
    finally:
        code = proc.wait(timeout=60)
        log.close()
    return out, code


def test_a_killed_run_leaves_valid_lines_and_a_summary(tmp_path):
    out, _ = _stopped(tmp_path, signal.SIGKILL)
    lines = _lines(out / "run.jsonl")
    assert lines[0]["kind"] == "env" and sum(r["kind"] == "compile" for r in lines) >= 3
    assert not any(r["kind"] == "end" for r in lines)
    summary = _summarize(out / "run.jsonl", tmp_path)
    assert "**Incomplete**" in summary
    for heading in HEADINGS:
        assert heading in summary, heading
    assert "| adamw-fp32 |" in summary  # what it did measure


def test_a_terminated_run_writes_why_and_its_summary(tmp_path):
    """SIGTERM (timeout's signal; SIGINT and the watchdog take the same path): an abort line, then
    summary.md from the lines so far."""
    out, code = _stopped(tmp_path, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, code
    lines = _lines(out / "run.jsonl")
    assert lines[-1]["kind"] == "abort" and lines[-1]["reason"] == "SIGTERM", lines[-1]
    summary = (out / "summary.md").read_text()
    assert "**Stopped**: SIGTERM" in summary and "| adamw-fp32 |" in summary


def test_a_small_budget_skips_with_a_line_instead_of_overrunning(tmp_path):
    out, budget = tmp_path / "out", 4.0
    proc = subprocess.run([sys.executable, str(PROGRAM), "--out", str(out), "--dry-run", "--budget", str(budget),
                           "--only", "compile,kernels"], capture_output=True, text=True, env=_env(tmp_path),
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = _lines(out / "run.jsonl")
    end = lines[-1]
    assert end["kind"] == "end"
    assert end["t"] < budget + 3, f"the run ended at {end['t']} s, its budget {budget} s"  # one measurement past it
    skips = [r for r in lines if r["kind"] == "skip"]
    assert any(r["reason"].startswith(("section limit", "budget")) for r in skips), skips
    assert {r["what"] for r in skips if r["reason"] == "not selected (--only)"} == {"e2e", "profile", "ncu",
                                                                                      "multi_gpu"}
    summary = (out / "summary.md").read_text()
    assert "## Skipped and failed" in summary and ("section limit" in summary or "budget:" in summary)


@pytest.fixture(scope="module")
def program():
    spec = importlib.util.spec_from_file_location("gpu_run_under_test", PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plan_fits_six_minutes(program):
    assert sum(program.PLAN.values()) == program.BUDGET
    assert program.BUDGET + program.GRACE <= 360
    assert [name for name, _ in program.SECTIONS] + ["summary"] == list(program.PLAN)


def test_the_trace_reader_on_a_gpu_trace(program):
    """Update kernels by name and by the range their launch sits in, the overlap with the backward's
    compute kernels, streams, host synchronizations and device-to-host copies inside the iterations."""
    def x(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}

    events = [
        x("user_annotation", "gpu_run.iteration", 0, 100), x("user_annotation", "gpu_run.forward", 0, 30),
        x("user_annotation", "gpu_run.backward", 30, 50), x("user_annotation", "gpu_run.step", 80, 20),
        x("gpu_user_annotation", "gpu_run.iteration", 0, 300, tid=7),  # the GPU's projection: not a host range
        x("user_annotation", "fused_zero.update", 50, 5, tid=2),
        x("cuda_runtime", "cudaLaunchKernel", 35, 1, tid=2, correlation=1),
        x("kernel", "sm90_xmma_gemm", 40, 30, tid=7, stream=7, correlation=1),
        x("cuda_driver", "cuLaunchKernel", 51, 1, tid=2, correlation=2),
        x("kernel", "_adam_kernel", 60, 20, tid=13, stream=13, correlation=2),
        x("cuda_runtime", "cudaLaunchKernel", 52, 1, tid=2, correlation=3),
        x("kernel", "void at::native::vectorized_elementwise_kernel", 80, 10, tid=13, stream=13, correlation=3),
        x("cuda_runtime", "cudaLaunchKernel", 5, 1, correlation=6),
        x("kernel", "ampere_sgemm", 5, 20, tid=7, stream=7, correlation=6),
        x("cuda_runtime", "cudaLaunchKernel", 85, 1, correlation=5),
        x("kernel", "ncclDevKernel_AllGather_RING_LL", 95, 25, tid=20, stream=20, correlation=5),
        x("cuda_runtime", "cudaMemcpyAsync", 20, 1, correlation=4),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 22, 2, tid=7, stream=7, correlation=4),
        x("cuda_runtime", "cudaStreamSynchronize", 90, 3),
        x("cuda_runtime", "cudaDeviceSynchronize", 150, 3),  # after the iterations: not counted
    ]
    got = program.analyze_trace({"traceEvents": events}, 1)
    assert got["timeline"] == "gpu kernels"
    assert got["update_kernels_per_iter"] == 2 and got["update_us_per_iter"] == 30
    assert got["update_streams"] == ["13"] and got["backward_compute_streams"] == ["7"]
    assert got["update_overlap_backward"] == pytest.approx(10 / 30)
    assert got["host_syncs_per_iter"] == {"stream": 1, "event": 0, "device": 0}
    assert got["d2h_copies_per_iter"] == 1
    assert got["all_gather_us_per_iter"] == 25 and got["all_gather_overlap_forward"] == 0
    assert got["iteration_ms"] == pytest.approx(0.1)
    assert program.overlap_share([(0, 10)], [(5, 20), (8, 9)]) == pytest.approx(0.5)
    assert program.overlap_share([], [(0, 1)]) is None
