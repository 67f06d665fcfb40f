"""Named ranges for Nsight Systems (NVTX) and torch.profiler (record_function), in one context manager.

NVTX is used only when CUDA is available, so CPU-only builds pay nothing but a record_function."""

from __future__ import annotations

import contextlib

import torch

_NVTX = torch.cuda.is_available()


@contextlib.contextmanager
def range_push(name: str):
    with torch.profiler.record_function(name):
        if _NVTX:
            torch.cuda.nvtx.range_push(name)
            try:
                yield
            finally:
                torch.cuda.nvtx.range_pop()
        else:
            yield
