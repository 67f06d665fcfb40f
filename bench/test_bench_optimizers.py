"""Each torch.optim optimizer fused_zero has a twin of: its step per parameter element, fused_zero's
against torch.optim's foreach implementation (torch's own choice on CUDA; on the CPU its multi-tensor
path) under plain DDP, side by side in one run: 2 ranks (gloo on CPU, NCCL on up to 2 GPUs), a GPT of
the demo's design (test_bench_step.py's models), fused_zero with ``overlap="step"`` so that
``opt.step()`` holds the whole update and the all-gather; torch.optim's ``step()`` updates every
element on every rank (DDP reduced the gradients in the backward).

``extra_info`` per optimizer: ``ns_per_element`` (median step over the model's parameters) for both,
``step_vs_torch`` (fused_zero's median over torch's, same run), ``state_bytes_per_rank`` of each, and
the bytes the update moves per parameter element (``bytes_per_element``: torch's update reads the
gradient and the parameter and reads and writes each state tensor and the parameter: 4 + 4 + 8 x
states + 4 bytes; fused_zero's per rank is that over W elements, plus the all-gather's 4 (W - 1) / W).
AdamW (fused_zero's kernel against torch's foreach AdamW) is the row to read the others against.

    pytest bench/test_bench_optimizers.py --benchmark-json out.json
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from test_bench_step import CLOCK, CUDA, PAIR_WORLD, _median, _report, device_name, run_ranks

from fused_zero.algorithms import registry

HP = {d.name: d.bench for d in registry.DECLARATIONS if d.bench is not None}
"""Each benchmarked optimizer's hyperparameters, as it declares them (fused_zero/algorithms/registry.py)."""
OPTIMIZERS = list(HP)
MODEL = (256, 4, 8) if not CUDA else (1024, 8, 16)  # n_embd, n_layer, n_head
ITERS = int(os.environ.get("FUSED_ZERO_BENCH_ITERS", 20 if CUDA else 6))
WARMUP = 2
pytestmark = pytest.mark.benchmark(timer=CLOCK)


def _rank_main(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero
    from fused_zero.demo.model import GPT, GPTConfig

    device = torch.device("cuda", rank) if CUDA else torch.device("cpu")
    if not CUDA:
        torch.set_num_threads(1)
    n_embd, n_layer, n_head = MODEL
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(65, (4, 64), generator=g).to(device)
    y = torch.randint(65, (4, 64), generator=g).to(device)

    def sync():
        if CUDA:
            torch.cuda.synchronize(device)

    out = {}
    for name in OPTIMIZERS:
        for system in ("fused_zero", "torch"):
            torch.manual_seed(0)
            model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=n_layer, n_head=n_head, n_embd=n_embd))
            model = model.to(device)
            ddp = DDP(model, bucket_cap_mb=25.0, gradient_as_bucket_view=True, device_ids=[device.index] if CUDA
                      else None)
            if system == "fused_zero":
                opt = getattr(fused_zero, name)(ddp.parameters(), ddp=ddp, overlap="step", **HP[name])
            else:
                opt = getattr(torch.optim, name)(ddp.parameters(), foreach=True, **HP[name])
            times = []
            for i in range(WARMUP + ITERS):
                _, loss = ddp(x, y)
                loss.backward()
                sync()
                t = time.perf_counter()
                opt.step()
                if system == "fused_zero":
                    opt.synchronize()
                sync()
                if i >= WARMUP:
                    times.append(time.perf_counter() - t)
                opt.zero_grad(set_to_none=True)
            state = int(opt.memory()["state"]) if system == "fused_zero" else sum(
                t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
            out[(name, system)] = {"step": times, "state_bytes": state,
                                   "params": sum(p.numel() for p in model.parameters())}
            if system == "fused_zero":  # the state tensors per element (Adafactor's: a few per row and column)
                out[(name, "states")] = len(opt._algorithm.state_names())
            if system == "fused_zero":
                opt._engine.close()
            del ddp, opt, model
    return out


_RESULTS: dict = {}


@pytest.mark.parametrize("system", ["fused_zero", "torch"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_step(benchmark, name, system):
    if not _RESULTS:
        _RESULTS["ranks"] = run_ranks(_rank_main, PAIR_WORLD)
    r0 = _RESULTS["ranks"][0]
    mine, theirs = r0[(name, system)], r0[(name, "torch")]
    per_element = 4 + 4 + 8 * r0[(name, "states")] + 4
    info = dict(
        bench="optimizers", optimizer=name, system=system, world=PAIR_WORLD, device=device_name(),
        torch=torch.__version__, model=f"GPT n_embd={MODEL[0]} n_layer={MODEL[1]}", params=mine["params"],
        ns_per_element=_median(mine["step"]) / mine["params"] * 1e9,
        step_ms_median=_median(mine["step"]) * 1e3,
        step_vs_torch=_median(mine["step"]) / _median(theirs["step"]),
        state_bytes_per_rank=mine["state_bytes"],
        bytes_per_element=(per_element / PAIR_WORLD + 4 * (PAIR_WORLD - 1) / PAIR_WORLD
                           if system == "fused_zero" else per_element),
        load=list(os.getloadavg()))
    _report(benchmark, mine["step"], f"optimizers-{name}", info)
