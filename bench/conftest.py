"""Benchmarks run the kernels on the GPU when there is one. Without CUDA they run on CPU tensors through
Triton's interpreter, which must be switched on before the kernels are first imported (``triton.jit``
reads ``TRITON_INTERPRET`` when it decorates them), so this is done here, before test collection."""

import gc
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "fused_zero.kernels" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError(
            "fused_zero.kernels was imported before bench/conftest.py could set TRITON_INTERPRET=1; "
            "without CUDA, run with TRITON_INTERPRET=1 in the environment")
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _fresh():
    """Same inputs every run; hand the previous case's buffers back before the next is allocated."""
    torch.manual_seed(0)
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pytest_benchmark_update_machine_info(config, machine_info):
    """Record what the numbers depend on beside the CPU: library versions and the accelerator."""
    import platform

    import triton

    machine_info["torch_version"] = torch.__version__
    machine_info["triton_version"] = triton.__version__
    machine_info["cuda_device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    machine_info["cuda_device_count"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    machine_info["cpu_count"] = os.cpu_count()
    machine_info.setdefault("processor", platform.processor())
