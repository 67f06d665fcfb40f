"""The CUDA path on a GPU: the kernels, the engine at world 1, several optimizers over one module (each
its own step, GradScaler state and graph; Muon's phases without host waits), the compact state formats,
ranks sharing one GPU over gloo (a refusal one of them alone sees raised on both), NCCL on 2+ GPUs, and
the engine under torch's CUDA sanitizer. Skipped, with the
reason, where CUDA is absent.

Each case runs in its own process (gpu_cases.py) without ``TRITON_INTERPRET``: tests/conftest.py turns
the interpreter on for the CPU tests, and Triton reads it once per process, so the GPU cases could not
run the compiled kernels in this one. ``bench/gpu_check.sh`` runs this file first.
"""

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SKIP = 77  # gpu_cases.py's exit status for "this machine cannot run the case"

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA is not available: the GPU tests need an NVIDIA GPU (gpu_check.sh)")


def run_case(name: str, timeout: float = 420.0, **env):
    child_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child_env.update(env)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "gpu_cases.py"), name], env=child_env,
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode == SKIP:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, f"gpu case {name} failed (exit {proc.returncode}):\n{out[-8000:]}"


def test_kernels_against_torch_optim():
    run_case("kernels")


def test_kernels_equal_their_exact_reference():
    run_case("kernels_exact")


def test_engine_world1_every_mode():
    run_case("engine_world1")


def test_muon_beside_adamw():
    run_case("muon")


def test_several_optimizers_each_its_own_step_scale_and_graph():
    run_case("several_optimizers")


def test_compact_state_formats():
    run_case("formats")


def test_several_optimizers_torch_optimizers_twins():
    run_case("torch_optimizers")


def test_step_path_never_syncs_the_host():
    run_case("no_host_sync")


def test_step_replayed_from_a_cuda_graph():
    run_case("capture")


def test_two_gloo_ranks_on_one_gpu():
    run_case("two_ranks_one_gpu")


def test_two_gloo_ranks_refuse_together_what_one_saw():
    run_case("refusal_on_every_rank")


def test_rank0_state_dict_right_after_step():
    run_case("rank0_state_dict")


def test_nccl_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL needs one GPU per rank; this machine has {torch.cuda.device_count()}")
    run_case("nccl_multi_gpu")


def test_engine_under_the_cuda_sanitizer():
    run_case("engine_sanitized", TORCH_CUDA_SANITIZER="1")
