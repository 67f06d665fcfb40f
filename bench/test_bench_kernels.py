"""Throughput of the fused_zero update kernels, side by side with a plain copy and torch.optim.

Every case steps one flat slice of ``size`` elements, cut into ``N_PARAMS`` parameters that share one
param group (one `Segments` table and one coefficient table, built once, for the fused kernels). The
providers, measured in the same run for every size:

    copy-28B, copy-20B              ``dst.copy_(src)`` of 14 (10) bytes per element: it moves the same
                                    28 (20) bytes per element as an Adam (SGD) step, the roofline.
    adamw-fp32                      fused_zero AdamW, fp32 parameters updated in place, no master.
    adamw-bf16master                fused_zero AdamW, bf16 parameters and gradients, fp32 master weights.
    adam-bf16master                 fused_zero Adam (coupled decay off, amsgrad off), bf16 + fp32 master.
    sgd-fp32, sgd-bf16master        fused_zero SGD with momentum (steady state: the buffer exists).
    torch-fused-adamw-fp32          torch.optim.AdamW(fused=True) on fp32 parameters.
    torch-fused-adamw-bf16master    the same on fp32 master weights, with the casts a user needs around
                                    it: the bf16 gradient copied into an fp32 one, the step, then the
                                    master copied back into the bf16 parameters.
    torch-foreach-adamw-*           the same two with torch.optim.AdamW(foreach=True).

``extra_info`` of every case holds the provider, size (elements), dtype config, the bytes an ideal
single pass moves per step (``bytes``; Adam/AdamW 28 and SGD with momentum 20 per element, whatever
the dtype config: bf16 + fp32 master reads grad 2 + master 4 + state, writes master 4 + state + param 2;
a copy counts its read and its write), ``GB/s`` = bytes / median step time and the device. torch's
steps move more than that (the casts, and several passes for foreach), so their GB/s is the effective
rate of the same update, directly comparable with the fused kernels and the copy.
``test_adam_coefficients`` times the host work of rebuilding the coefficient table of 1000 parameters,
which a step with a new learning rate needs.

On a CUDA GPU the sizes are 1M to 256M elements and every round is timed with CUDA events around the
step alone, after evicting the L2 cache (as ``triton.testing.do_bench`` does): `CudaEventClock` is the
pytest-benchmark timer, so the reported statistics are GPU time. Without CUDA one 64K-element size runs
on the CPU, the kernels through the Triton interpreter (``conftest.py`` switches it on), timed by
pytest-benchmark's ordinary wall clock over a few rounds: that checks the benchmarks run, the numbers
mean little.

Run (bench/ is not part of the default ``pytest`` run, whose testpaths are tests/)::

    pytest bench/test_bench_kernels.py --benchmark-json out.json
    pytest bench/ --benchmark-only --benchmark-group-by=group --benchmark-columns=median,rounds

Nothing here is asserted about time or values: correctness is tested in tests/.
"""

from __future__ import annotations

import itertools
import os
import platform

import numpy as np
import pytest
import torch

from fused_zero.kernels import Segments, adam_coefficients, adam_step, sgd_coefficients, sgd_step

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DEVICE_NAME = (torch.cuda.get_device_name(DEVICE) if CUDA
               else f"cpu ({platform.processor() or platform.machine()})")
SIZES = [k << 20 for k in (1, 4, 16, 64, 256)] if CUDA else [64 << 10]
N_PARAMS = 8
# Rounds of one step each, fixed rather than calibrated so that a noisy machine cannot stretch the run.
# Few on the CPU, where the interpreter takes a good fraction of a second per fused step.
ROUNDS, WARMUP_ROUNDS = 100, 10
CPU_ROUNDS = {"fused_zero": 3, "copy": 20, "torch-fused": 20, "torch-foreach": 20}

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 1e-2
MOMENTUM = 0.9
STEP = 10  # the step count the Adam coefficients are built for: past the first, nothing special

BYTES_PER_ELEMENT = {"adamw": 28, "adam": 28, "sgd": 20}

PROVIDERS = {
    # provider: (implementation, optimizer, dtype config)
    "copy-28B": ("copy", "adamw", "bytes"),
    "copy-20B": ("copy", "sgd", "bytes"),
    "adamw-fp32": ("fused_zero", "adamw", "fp32"),
    "adamw-bf16master": ("fused_zero", "adamw", "bf16master"),
    "adam-bf16master": ("fused_zero", "adam", "bf16master"),
    "sgd-fp32": ("fused_zero", "sgd", "fp32"),
    "sgd-bf16master": ("fused_zero", "sgd", "bf16master"),
    "torch-fused-adamw-fp32": ("torch-fused", "adamw", "fp32"),
    "torch-fused-adamw-bf16master": ("torch-fused", "adamw", "bf16master"),
    "torch-foreach-adamw-fp32": ("torch-foreach", "adamw", "fp32"),
    "torch-foreach-adamw-bf16master": ("torch-foreach", "adamw", "bf16master"),
}


def size_label(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def param_spans(n: int) -> list[tuple[int, int]]:
    """``N_PARAMS`` back-to-back parameters covering the slice, as (start, end)."""
    bounds = [n * i // N_PARAMS for i in range(N_PARAMS + 1)]
    return list(itertools.pairwise(bounds))


def make_buffers(n: int, config: str, state: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The flat buffers of one slice: gradient and parameters as backward leaves them, the fp32 master
    copy for ``bf16master``, and zeroed fp32 optimizer ``state`` buffers."""
    low = torch.bfloat16 if config == "bf16master" else torch.float32
    bufs = {
        "grad": torch.randn(n, device=DEVICE).to(low),
        "param": torch.randn(n, device=DEVICE).to(low),
    }
    if config == "bf16master":
        bufs["master"] = bufs["param"].float()
    for name in state:
        bufs[name] = torch.zeros(n, device=DEVICE)
    return bufs


def make_step(impl: str, optimizer: str, config: str, n: int):
    """A callable doing one step of the case on fresh buffers."""
    if impl == "copy":
        src = torch.empty(n * BYTES_PER_ELEMENT[optimizer] // 2, dtype=torch.uint8, device=DEVICE)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)

    if impl == "fused_zero":
        segments = Segments.build([(a, b - a, a, a, pid) for pid, (a, b) in enumerate(param_spans(n))],
                                  DEVICE)
        if optimizer == "sgd":
            bufs = make_buffers(n, config, ("momentum_buffer",))
            coefs = sgd_coefficients(lr=[LR] * N_PARAMS, momentum=MOMENTUM, dampening=0.0,
                                     weight_decay=0.0, first=False).to(DEVICE)
            return lambda: sgd_step(segments, coefs, **bufs)
        bufs = make_buffers(n, config, ("exp_avg", "exp_avg_sq"))
        coefs = adam_coefficients(
            lr=[LR] * N_PARAMS, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, step=STEP,
            weight_decay=WEIGHT_DECAY if optimizer == "adamw" else 0.0,
            decoupled=optimizer == "adamw").to(DEVICE)
        return lambda: adam_step(segments, coefs, **bufs)

    # torch.optim on the same flat buffers: every parameter a view, its gradient a view of an fp32 one
    bufs = make_buffers(n, config, ())
    master = bufs.get("master", bufs["param"])
    grad32 = bufs["grad"] if config == "fp32" else torch.empty(n, device=DEVICE)
    params = []
    for a, b in param_spans(n):
        p = master[a:b]
        p.grad = grad32[a:b]
        params.append(p)
    kind = {"fused": True} if impl == "torch-fused" else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **kind)
    if config == "fp32":
        return opt.step

    def step():
        grad32.copy_(bufs["grad"])
        opt.step()
        bufs["param"].copy_(master)

    return step


class CudaEventClock:
    """pytest-benchmark timer that advances only by CUDA-event time measured around the step.

    `timed` wraps a step into the function to benchmark: it queues an L2 flush, records an event, runs
    the step, records a second event, waits for it and advances the clock by the time between the two.
    pytest-benchmark reads the clock before and after each round, so its statistics are the step's GPU
    time; the GPU is still busy with the flush while the host launches, which hides launch overhead
    unless the step's host work outlasts the flush.
    """

    def __init__(self):
        self.__name__ = "cuda_event_clock"  # how pytest-benchmark names the timer in its output
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def timed(self, step):
        flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)

        def run():
            flush.zero_()
            start.record()
            step()
            end.record()
            end.synchronize()
            self.now += start.elapsed_time(end) * 1e-3  # ms -> s

        return run


CLOCK = CudaEventClock()


@pytest.mark.benchmark(**({"timer": CLOCK} if CUDA else {}))
@pytest.mark.parametrize("size", SIZES, ids=size_label)
@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_step(benchmark, provider, size):
    impl, optimizer, config = PROVIDERS[provider]
    step = make_step(impl, optimizer, config, size)
    step()  # compiles the kernel, creates torch's optimizer state
    if CUDA:
        torch.cuda.synchronize()

    nbytes = BYTES_PER_ELEMENT[optimizer] * size
    benchmark.group = f"step-{size_label(size)}"
    benchmark.extra_info.update(
        provider=provider, size=size, config=config, bytes=nbytes, device=DEVICE_NAME,
        triton_interpret=impl == "fused_zero" and os.environ.get("TRITON_INTERPRET") == "1",
    )
    if CUDA:
        benchmark.pedantic(CLOCK.timed(step), rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
    else:
        benchmark.pedantic(step, rounds=CPU_ROUNDS[impl])
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["GB/s"] = nbytes / benchmark.stats.stats.median / 1e9


def test_adam_coefficients(benchmark):
    """Host cost of a new coefficient table for 1000 parameters (new lr, per-parameter step counts)."""
    n = 1000
    lr = np.full(n, LR)
    step = np.arange(1, n + 1)
    benchmark.group = "host"
    benchmark.extra_info.update(provider="adam_coefficients", n_params=n, device="host")
    benchmark(adam_coefficients, lr=lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
              weight_decay=WEIGHT_DECAY, step=step, decoupled=True)
