"""fused_zero's iteration against ZeroRedundancyOptimizer's and against the floor its communication sets,
side by side in one run: 2 gloo ranks (CUDA: NCCL, up to 2 GPUs), an 8.4M-parameter MLP (two 2048 x 2048
layers), fp32, DDP's default 25 MiB buckets, batch 16 per rank.

Systems (every one built on the same model, seed and batches; run in blocks, rounds alternating the
order, as test_bench_step.py does, with its block runner and in-rank timing; six rounds on CPU, see
ROUNDS):

    ddp+zero              ZeroRedundancyOptimizer(AdamW, foreach=False): torch.optim's single-tensor
                          AdamW, the implementation fused_zero's CPU update reproduces bit for bit, so
                          that the ratio measures communication and orchestration; plain step on gloo
                          (local step, then a broadcast of every rank's parameters).
    ddp+zero-fused        the same with torch's fused CPU AdamW (one pass over memory): listed, not
                          the ratio's denominator (fused_zero's CPU path does ~8 passes for parity).
    fused_zero-<mode>     fused_zero.AdamW(overlap=<mode>), grad_reduce="reduce_scatter" (the
                          default; on gloo one in-place all-reduce of each bucket, see collectives.py).
    floor                 what any sharded optimizer must do here, back to back with no orchestration:
                          plain DDP's forward and backward (its all-reduce of every bucket: the
                          reduction fused_zero runs on gloo), one single-tensor AdamW step over a flat
                          tensor of this rank's 1/W of the parameters (the same update, in one call),
                          and every bucket's slices gathered into a flat buffer of the bucket's size
                          (the parameters' way back; buckets of the sizes DDP reports, in its order).
                          ``opt.step`` = update + gathers. The way back is the cheapest this backend
                          has: on gloo one in-place broadcast per rank of its slice (as
                          ZeroRedundancyOptimizer returns parameters there), since gloo's
                          all_gather_into_tensor stages the whole output in a scratch tensor and
                          copies it out (55-62 ms against 13-19 ms for the broadcasts at 8.4M fp32
                          elements on 2 ranks); on NCCL the all-gather. ``floor_gather`` in
                          extra_info says which ran.

Ratios (``extra_info`` of every fused_zero benchmark, medians of the same run): ``vs_zero`` =
iteration / ddp+zero's, ``vs_floor`` = iteration / floor's, ``vs_zero_fused`` likewise.

    pytest bench/test_bench_floor.py --benchmark-json out.json
    python bench/report.py out.json --out report/   # the "Against the floor" section
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from test_bench_step import (  # CLOCK: the benchmark timer of this module too
    BACKEND,
    CLOCK,
    CPU_COUNT,
    CUDA,
    PAIR_WORLD,
    REWARM,
    WARMUP,
    _Marks,
    _median,
    _report,
    _run_block,
    device_name,
    run_ranks,
)

ITERS = int(os.environ.get("FUSED_ZERO_BENCH_ITERS", 20 if CUDA else 24))
ROUNDS = 2 if CUDA else 6
"""On CPU six rounds of 4 iterations per system, not two of 6: on a shared 2-core machine another
process's burst of a few seconds lands on the one or two blocks running then, and with two mirrored
rounds the blocks in the middle of the run (the last system's two) are adjacent in time."""
WIDTH, BATCH, BUCKET_CAP_MB, LR, WEIGHT_DECAY = 2048, 16, 25.0, 1e-3, 0.1
SYSTEMS = ["ddp+zero", "ddp+zero-fused", "fused_zero-bucket", "fused_zero-backward", "fused_zero-step", "floor"]
pytestmark = pytest.mark.benchmark(timer=CLOCK)


class MLP(torch.nn.Module):
    """Two 2048 x 2048 layers: 8.4M parameters. ``forward(x, y)`` returns ``(out, loss)`` like the GPT
    of test_bench_step.py, whose block runner this benchmark uses."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, y):
        out = self.l2(torch.nn.functional.gelu(self.l1(x)))
        return out, torch.nn.functional.mse_loss(out, y)


FLOOR_GATHER = "broadcast" if BACKEND == "gloo" else "all_gather"


class _Floor:
    """The floor's step: one single-tensor AdamW over this rank's flat 1/W, then every bucket's slices
    gathered (buckets of the sizes DDP reports, in its order; FLOOR_GATHER says how)."""

    def __init__(self, ddp, params: int, device):
        world, rank = dist.get_world_size(), dist.get_rank()
        self.flat = torch.nn.Parameter(torch.zeros(params // world, dtype=torch.float32, device=device))
        self.flat.grad = torch.full_like(self.flat, 1e-3)
        self.opt = torch.optim.AdamW([self.flat], lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
        self.ddp, self.params, self.device = ddp, params, device
        self.sizes: list[int] | None = None
        self.steps = 0
        self.buffers: list[torch.Tensor] = []
        self.rank, self.world = rank, world

    def _bucket_sizes(self) -> list[int]:
        """DDP's bucket sizes in elements (its logging data, bytes of fp32), known once a backward has
        run; before that, bucket_cap_mb's split."""
        sizes = self.ddp._get_ddp_logging_data().get("bucket_sizes")
        if sizes:
            return [int(b) // 4 for b in str(sizes).split(",")]
        cap = int(BUCKET_CAP_MB * 2 ** 20) // 4
        return [min(cap, self.params - i) for i in range(0, self.params, cap)]

    def step(self):
        self.opt.step()
        self.steps += 1
        if self.steps <= max(WARMUP, 1):  # DDP knows its buckets after a backward, rebuilds them after its first
            sizes = self._bucket_sizes()
            if sizes != self.sizes:
                self.sizes = sizes
                self.buffers = [torch.zeros(n // self.world * self.world, dtype=torch.float32, device=self.device)
                                for n in sizes]
        for buf in self.buffers:
            n = buf.numel() // self.world
            if FLOOR_GATHER == "all_gather":
                dist.all_gather_into_tensor(buf, buf[self.rank * n:(self.rank + 1) * n])
                continue
            works = [dist.broadcast(buf[r * n:(r + 1) * n], src=r, async_op=True) for r in range(self.world)]
            for w in works:
                w.wait()


class _System:
    def __init__(self, name: str, device):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        import fused_zero

        torch.manual_seed(0)
        self.name, self.model = name, MLP().to(device)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.ddp = DDP(self.model, bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=True,
                       device_ids=[device.index] if device.type == "cuda" else None)
        hp = dict(lr=LR, weight_decay=WEIGHT_DECAY)
        self.sync, self.floor = (lambda: None), None
        if name.startswith("ddp+zero"):
            impl = {"fused": True} if name.endswith("fused") else {"foreach": False}
            self.opt = ZeroRedundancyOptimizer(self.ddp.parameters(), optimizer_class=torch.optim.AdamW, **hp, **impl)
            self.step, self.impl = self.opt.step, f"{impl}, plain step"
        elif name == "floor":
            self.floor = _Floor(self.ddp, self.params, device)
            self.step, self.impl = self.floor.step, f"single-tensor AdamW over 1/W + {FLOOR_GATHER}s"
        else:
            self.opt = fused_zero.AdamW(self.ddp.parameters(), ddp=self.ddp, overlap=name.split("-", 1)[1], **hp)
            self.step, self.sync, self.impl = self.opt.step, self.opt.synchronize, f"backend {self.opt._engine.backend}"

    def zero_grad(self):
        if self.floor is None:
            self.opt.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        if self.name.startswith("fused_zero"):
            return int(self.opt.memory()["state"])
        if self.floor is not None:
            return 8 * self.floor.flat.numel()
        return sum(t.numel() * t.element_size() for st in self.opt.optim.state.values() for t in st.values()
                   if torch.is_tensor(t))


def _rank_main(rank: int, world: int) -> dict:
    device = torch.device("cuda", rank) if CUDA else torch.device("cpu")
    if not CUDA:
        torch.set_num_threads(1)
    g = torch.Generator(device="cpu").manual_seed(rank)
    need = WARMUP + REWARM * (ROUNDS - 1) + ITERS
    data = [(torch.randn(BATCH, WIDTH, generator=g).to(device), torch.randn(BATCH, WIDTH, generator=g).to(device))
            for _ in range(need)]
    marks = _Marks(device.type == "cuda")
    systems = {name: _System(name, device) for name in SYSTEMS}
    out = {name: {k: [] for k in ("fwd", "bwd", "step", "zero_grad", "iter")} for name in SYSTEMS}
    pos = dict.fromkeys(SYSTEMS, 0)
    per_round = [ITERS // ROUNDS + (r < ITERS % ROUNDS) for r in range(ROUNDS)]
    for r, iters in enumerate(per_round):
        for name in SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]:
            pos[name] = _run_block(systems[name], data, pos[name], WARMUP if r == 0 else REWARM, iters, marks,
                                   device, None, out[name])
    for name, s in systems.items():
        out[name].update(state_bytes=s.state_bytes(), params=s.params, impl=s.impl,
                         bucket_sizes=s.floor.sizes if s.floor is not None else None)
    return out


_RESULTS: dict = {}


def _results() -> list[dict]:
    if not _RESULTS:  # the load after includes this benchmark's own ranks
        _RESULTS["load"] = os.getloadavg()
        _RESULTS["ranks"] = run_ranks(_rank_main, PAIR_WORLD)
        _RESULTS["load_after"] = os.getloadavg()
    return _RESULTS["ranks"]


@pytest.mark.parametrize("system", SYSTEMS)
def test_floor(benchmark, system):
    ranks = _results()
    r0 = ranks[0][system]
    med = {name: _median(ranks[0][name]["iter"]) for name in SYSTEMS}
    info = dict(
        bench="floor", system=system, world=PAIR_WORLD, backend=BACKEND, device=device_name(),
        torch=torch.__version__, model=f"MLP 2 x Linear({WIDTH}, {WIDTH})", params=r0["params"],
        batch_per_rank=BATCH, bucket_cap_mb=BUCKET_CAP_MB, optimizer_impl=r0["impl"], warmup=WARMUP,
        iters=len(r0["iter"]), rounds=ROUNDS, threads_per_rank=None if CUDA else 1, timer="in-rank, rank 0",
        cpu_count=CPU_COUNT, load_before=list(_RESULTS["load"]), load_after=list(_RESULTS["load_after"]),
        iter_ms_median=med[system] * 1e3,
        fwd_ms_median=_median(r0["fwd"]) * 1e3, bwd_ms_median=_median(r0["bwd"]) * 1e3,
        step_ms_median=_median(r0["step"]) * 1e3, state_bytes=r0["state_bytes"],
        iter_ms_ranks=[_median(r[system]["iter"]) * 1e3 for r in ranks],
        vs_zero=med[system] / med["ddp+zero"], vs_zero_fused=med[system] / med["ddp+zero-fused"],
        vs_floor=med[system] / med["floor"], floor_gather=FLOOR_GATHER,
        floor_bucket_elements=ranks[0]["floor"]["bucket_sizes"])
    _report(benchmark, r0["iter"], "floor", info)
