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
