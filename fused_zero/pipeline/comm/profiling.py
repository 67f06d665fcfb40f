"""Named ranges for Nsight Systems (NVTX) and torch.profiler (record_function), in one context manager.

NVTX is used only when CUDA is available, and ``record_function`` only while a torch profiler runs:
entering one costs microseconds even with no profiler, on paths that run once per bucket."""

from __future__ import annotations

import contextlib

import torch

_NVTX = torch.cuda.is_available()
_NOTHING = contextlib.nullcontext()


def range_push(name: str):
    if not _NVTX and not torch.autograd._profiler_enabled():
        return _NOTHING
    return _range(name)


@contextlib.contextmanager
def _range(name: str):
    with torch.profiler.record_function(name):
        if _NVTX:
            torch.cuda.nvtx.range_push(name)
            try:
                yield
            finally:
                torch.cuda.nvtx.range_pop()
        else:
            yield
