"""Optimizer state per rank and step time of every state format, against fp32 at the same world size,
measured side by side in one run: 2 ranks (gloo on CPU, NCCL on up to 2 GPUs), a GPT of the demo's
design (test_bench_step.py's models), fused_zero.AdamW with ``overlap="step"`` so that ``opt.step()``
holds the whole update (and the all-gather).

Formats (``extra_info``): ``state_bytes_per_param`` = this rank's optimizer bytes x W / parameters,
before the division by W (expected: fp32 12 with bf16 parameters, 8 for fp32 parameters; bf16 moments
4 + master; 8-bit moments ~2 + master; 8-bit + stochastic rounding, no master, ~2), and
``state_vs_fp32`` and ``step_vs_fp32`` = the bytes and the median step over fp32 moments' at the same
parameter dtype (fp32 or bf16p-fp32), from the same run. Then DCP checkpoints of each
(``opt.sharded_state_dict()``, docs/checkpointing.md): ``dcp_save_ms``, ``dcp_load_ms`` (``dcp.load``
and ``load_sharded_state_dict``; each the second of two), ``dcp_bytes_per_param`` (the checkpoint's
files over the parameters) and the three over fp32's, from the same run.

    fp32            fp32 parameters and moments
    bf16            fp32 parameters, bf16 moments
    int8            fp32 parameters, 8-bit block-wise moments
    bf16p-fp32      bf16 parameters, fp32 masters and moments
    bf16p-bf16      bf16 parameters, fp32 masters, bf16 moments
    bf16p-int8      bf16 parameters, fp32 masters, 8-bit moments
    bf16p-int8-sr   bf16 parameters, no master (stochastic rounding), 8-bit moments
    int8-matrices   fp32 parameters; per param group: 8-bit moments for the matrices, fp32 for the
                    norms and biases (every bucket mixes the two: one state part each)

    pytest bench/test_bench_formats.py --benchmark-json out.json

``FUSED_ZERO_BENCH_FORMATS=fp32,int8`` runs only those formats (and each one's fp32 baseline): the
ranks build and time every format they run, whatever ``-k`` selects.
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch
from test_bench_step import CLOCK, CUDA, PAIR_WORLD, _median, _report, device_name, run_ranks

FORMATS = {  # name: (parameter dtype, options)
    "fp32": (torch.float32, {}),
    "bf16": (torch.float32, {"state_format": "bf16"}),
    "int8": (torch.float32, {"state_format": "8bit"}),
    "bf16p-fp32": (torch.bfloat16, {"master_weights": True}),
    "bf16p-bf16": (torch.bfloat16, {"master_weights": True, "state_format": "bf16"}),
    "bf16p-int8": (torch.bfloat16, {"master_weights": True, "state_format": "8bit"}),
    "bf16p-int8-sr": (torch.bfloat16, {"master_weights": "stochastic", "state_format": "8bit"}),
    "int8-matrices": (torch.float32, {"matrices": "8bit"}),
}
_ONLY = os.environ.get("FUSED_ZERO_BENCH_FORMATS")
if _ONLY:
    _wanted = set(_ONLY.split(","))
    _wanted |= {"fp32" if FORMATS[f][0] == torch.float32 else "bf16p-fp32" for f in _wanted}
    FORMATS = {name: v for name, v in FORMATS.items() if name in _wanted}
MODEL = (256, 4, 8) if not CUDA else (1024, 8, 16)  # n_embd, n_layer, n_head
ITERS = int(os.environ.get("FUSED_ZERO_BENCH_ITERS", 30 if CUDA else 12))
WARMUP = 3
ROUNDS = 2
pytestmark = pytest.mark.benchmark(timer=CLOCK)


def _rank_main(rank: int, world: int, path: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero
    from fused_zero.demo.model import GPT, GPTConfig

    device = torch.device("cuda", rank) if CUDA else torch.device("cpu")
    if not CUDA:
        torch.set_num_threads(1)
    n_embd, n_layer, n_head = MODEL
    systems = {}
    for name, (dtype, options) in FORMATS.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=n_layer, n_head=n_head, n_embd=n_embd))
        model = model.to(device, dtype)
        ddp = DDP(model, bucket_cap_mb=25.0, gradient_as_bucket_view=True,
                  device_ids=[device.index] if CUDA else None)
        options = dict(options)
        matrices = options.pop("matrices", None)
        params = ddp.parameters() if matrices is None else [
            {"params": [p for p in model.parameters() if p.dim() >= 2], "state_format": matrices},
            {"params": [p for p in model.parameters() if p.dim() < 2]}]
        opt = fused_zero.AdamW(params, lr=1e-3, weight_decay=0.1, ddp=ddp, overlap="step", **options)
        systems[name] = (model, ddp, opt)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(65, (4, 64), generator=g).to(device)
    y = torch.randint(65, (4, 64), generator=g).to(device)
    out = {name: [] for name in FORMATS}

    def sync():
        if CUDA:
            torch.cuda.synchronize(device)

    for r in range(ROUNDS):  # blocks per format, the order reversed every other round
        for name in list(FORMATS) if r % 2 == 0 else list(FORMATS)[::-1]:
            model, ddp, opt = systems[name]
            for i in range((WARMUP if r == 0 else 1) + ITERS // ROUNDS):
                _, loss = ddp(x, y)
                loss.backward()
                sync()
                t = time.perf_counter()
                opt.step()
                opt.synchronize()
                sync()
                if i >= (WARMUP if r == 0 else 1):
                    out[name].append(time.perf_counter() - t)
                opt.zero_grad(set_to_none=True)
    for name, (model, _, opt) in systems.items():
        params = sum(p.numel() for p in model.parameters())
        out[name] = {"step": out[name], "state_bytes": int(opt.memory()["state"]), "params": params,
                     **_checkpoint(opt, os.path.join(path, name), sync)}
    return out


def _checkpoint(opt, where: str, sync) -> dict:
    """DCP saves and loads of ``opt`` (every rank), each timed at its second run (the first pays one-off
    costs: DCP's planners, the chunk classes' first dispatch), and the files' bytes."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    def timed(fn) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        sync()
        dist.barrier()
        return time.perf_counter() - t

    def load():
        target = opt.sharded_state_dict()
        dcp.load(target, checkpoint_id=where)
        opt.load_sharded_state_dict(target)

    saved = [timed(lambda: dcp.save(opt.sharded_state_dict(), checkpoint_id=where)) for _ in range(2)][-1]
    loaded = [timed(load) for _ in range(2)][-1]
    files = sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where))
    return {"dcp_save": saved, "dcp_load": loaded, "dcp_bytes": files}


_RESULTS: dict = {}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_format(benchmark, fmt):
    if not _RESULTS:
        _RESULTS["ranks"] = run_ranks(_rank_main, PAIR_WORLD, tempfile.mkdtemp(prefix="fused_zero_bench_dcp_"))
    r0 = _RESULTS["ranks"][0]
    mine = r0[fmt]
    base = r0["fp32" if FORMATS[fmt][0] == torch.float32 else "bf16p-fp32"]
    info = dict(
        bench="formats", format=fmt, param_dtype=str(FORMATS[fmt][0]).removeprefix("torch."),
        options=FORMATS[fmt][1], world=PAIR_WORLD, device=device_name(), torch=torch.__version__,
        model=f"GPT n_embd={MODEL[0]} n_layer={MODEL[1]}", params=mine["params"],
        state_bytes_per_rank=mine["state_bytes"],
        state_bytes_per_param=mine["state_bytes"] * PAIR_WORLD / mine["params"],
        state_vs_fp32=mine["state_bytes"] / base["state_bytes"],
        step_ms_median=_median(mine["step"]) * 1e3,
        step_vs_fp32=_median(mine["step"]) / _median(base["step"]),
        dcp_save_ms=mine["dcp_save"] * 1e3, dcp_load_ms=mine["dcp_load"] * 1e3,
        dcp_bytes_per_param=mine["dcp_bytes"] / mine["params"],
        dcp_save_vs_fp32=mine["dcp_save"] / base["dcp_save"], dcp_load_vs_fp32=mine["dcp_load"] / base["dcp_load"],
        dcp_bytes_vs_fp32=mine["dcp_bytes"] / base["dcp_bytes"],
        load=list(os.getloadavg()))
    _report(benchmark, mine["step"], "formats", info)
