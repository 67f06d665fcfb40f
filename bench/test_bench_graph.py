"""``step()`` eagerly against ``step()`` replayed from a CUDA graph (``capturable=True``,
pipeline/step_end/step_graph.py): the host's time per ``step()`` and the iteration time, where the host's
launches are most of a step's cost.

Models (one NCCL rank on GPU 0; every system built on the same weights and batches):

    demo-gpt     the ``fused-zero demo`` GPT (n_embd 64, 2 layers, block 64, batch 16), bucket_cap_mb 0.1
    small-500    250 ``Linear(32, 32)`` layers, 500 parameters of 1,024 and 32 elements, batch 8:
                 the shape where the host's per-parameter and per-launch work dominates

Systems: ``fused_zero-step`` (AdamW, overlap="step", eager) and ``fused_zero-graph`` (the same with
``capturable=True``), and ``ddp+torch-adamw`` (torch.optim.AdamW(fused=True)) as the baseline. Each runs
``WARMUP`` untimed iterations (the graph is captured within them, once DDP's buckets and the arenas are
stable) and ``ITERS`` timed: the host's ``time.perf_counter`` around ``step()`` (nothing synchronizes
inside the block, so this is launching time), and CUDA events around each whole iteration.

    pytest bench/test_bench_graph.py --benchmark-only

pytest-benchmark's statistics are the host's ``step()`` times (replayed through ``ReplayClock``);
``extra_info`` has the iteration times and the graph's captures and replays. Needs CUDA (skipped
without: a CUDA graph has no CPU form; the capture path's CPU check is tests/pipeline/step_end/test_step_graph.py).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from test_bench_step import ReplayClock

from fused_zero.demo import spawn

CLOCK = ReplayClock()
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU"),
              pytest.mark.benchmark(timer=CLOCK)]
MODELS = ("demo-gpt", "small-500")
SYSTEMS = ("ddp+torch-adamw", "fused_zero-step", "fused_zero-graph")
WARMUP, ITERS = 10, 30


def _model(name: str, device):
    torch.manual_seed(0)
    if name == "demo-gpt":
        from fused_zero.demo.model import GPT, GPTConfig

        with torch.device(device):
            model = GPT(GPTConfig(vocab_size=65, block_size=64, n_embd=64, n_layer=2, n_head=4))
        x = torch.randint(0, 65, (16, 64), device=device)
        return model, lambda m: m(x, x)[1], 0.1
    with torch.device(device):
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(250)])
    x = torch.randn(8, 32, device=device)
    return model, lambda m: m(x).square().mean(), 25.0


def _system(name: str, model_name: str, device):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero

    model, loss_of, bucket_mb = _model(model_name, device)
    ddp = DDP(model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, device_ids=[device.index])
    if name == "ddp+torch-adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    else:
        opt = fused_zero.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, ddp=ddp, overlap="step",
                               capturable=name == "fused_zero-graph")
    return ddp, opt, loss_of


def _rank_main(rank: int, world: int) -> dict:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    out = {}
    for model_name in MODELS:
        for name in SYSTEMS:
            ddp, opt, loss_of = _system(name, model_name, device)
            host, marks = [], []
            for i in range(WARMUP + ITERS):
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                loss_of(ddp).backward()
                t0 = time.perf_counter()
                opt.step()
                took = time.perf_counter() - t0
                opt.zero_grad(set_to_none=True)
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                if i >= WARMUP:
                    host.append(took)
                    marks.append((start, end))
            torch.cuda.synchronize()
            engine = getattr(opt, "_engine", None)
            graph = engine.graph if engine is not None else None
            out[(model_name, name)] = dict(
                host=host, iteration=[a.elapsed_time(b) / 1e3 for a, b in marks],
                params=sum(1 for _ in ddp.parameters()),
                captures=graph.captures if graph is not None else None,
                replays=graph.replays if graph is not None else None)
            if engine is not None:
                engine.close()
    return out


_RESULTS: dict = {}


def _results() -> dict:
    if "rank0" not in _RESULTS:
        _RESULTS["rank0"] = spawn.run_ranks(_rank_main, 1, timeout=600, backend="nccl", collective_timeout=120)[0]
    return _RESULTS["rank0"]


@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("model", MODELS)
def test_step_host_time(benchmark, model, system):
    res = _results()
    mine, eager = res[(model, system)], res[(model, "fused_zero-step")]
    benchmark.group = f"graph-{model}"
    benchmark.extra_info.update(
        model=model, system=system, params=mine["params"], device=torch.cuda.get_device_name(0),
        host_step_us_median=statistics.median(mine["host"]) * 1e6,
        host_step_vs_eager=statistics.median(mine["host"]) / statistics.median(eager["host"]),
        iteration_ms_median=statistics.median(mine["iteration"]) * 1e3,
        iteration_vs_eager=statistics.median(mine["iteration"]) / statistics.median(eager["iteration"]),
        captures=mine["captures"], replays=mine["replays"])
    benchmark.pedantic(CLOCK.replay(mine["host"]), rounds=len(mine["host"]), iterations=1, warmup_rounds=0)
