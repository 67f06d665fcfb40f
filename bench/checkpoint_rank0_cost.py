"""What a rank-0-only ``optimizer.state_dict()`` costs (fused_zero/checkpoint/serving/peers.py), and what it
costs the c10d store per training iteration when nobody checkpoints: nothing, is the claim.

Run: ``python bench/checkpoint_rank0_cost.py [--worlds 2 4] [--iters 40] [--hidden 512]``. On gloo
ranks, an MLP of ``hidden``-wide layers with AdamW and 1 MB buckets trains; the store handles of the
checkpoint protocol (the mailboxes' two connections) count every call made through them, which is one
request to the store each. Measured per rank, printed as JSON:

- ``store_requests_per_iteration``: over ``iters`` steady iterations without a checkpoint;
- ``rank0_state_dict_s``: rank 0 calls ``state_dict()`` alone after a step while every other rank
  already waits in a loss all-reduce (what nanoGPT's and the Trainer's loops do); the median, min and
  max of ``repeats`` calls, each on a fresh step;
- ``store_requests_per_rank0_checkpoint``: what one of those calls costs the store, summed over ranks;
- ``every_rank_state_dict_s``: every rank calls ``state_dict()`` at once (Lightning, Accelerate);
- ``iteration_s``: the steady iteration's median, for scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.checkpoint.serving.server import server_for
from fused_zero.demo.spawn import run_ranks


class Counted:
    """A store handle counting the calls made through it."""

    def __init__(self, inner):
        self.inner, self.requests = inner, 0

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def counted(*args, **kwargs):
            self.requests += 1
            return method(*args, **kwargs)

        return counted


def _measure(rank, world, iters, hidden, repeats):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(4)])
    ddp = DDP(model, bucket_cap_mb=1)
    opt = fused_zero.AdamW(ddp.parameters(), ddp=ddp, lr=1e-4)
    inbox = server_for(ddp.process_group).inbox
    inbox.store, inbox.listening = Counted(inbox.store), Counted(inbox.listening)
    x = torch.randn(32, hidden, generator=torch.Generator().manual_seed(rank))

    def step():
        F.mse_loss(ddp(x), x).backward()
        opt.step()
        opt.zero_grad()

    def requests():
        return inbox.store.requests + inbox.listening.requests

    def all_ranks_requests():
        t = torch.tensor([float(requests())])
        dist.all_reduce(t)
        return t.item()

    for _ in range(5):  # past DDP's bucket rebuild and the arena packing
        step()
    opt.state_dict()  # every rank once: every pair of ranks connected, as in any later checkpoint
    dist.barrier()
    before, times = requests(), []
    for _ in range(iters):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    per_iteration = (requests() - before) / iters

    rank0, cost = [], []
    for _ in range(repeats):
        step()
        start = all_ranks_requests()
        loss = torch.zeros(1)
        if rank == 0:
            time.sleep(0.05)  # the other ranks are inside the all-reduce below by now
            t = time.perf_counter()
            sd = opt.state_dict()
            rank0.append(time.perf_counter() - t)
            assert len(sd["state"]) == 8
        dist.all_reduce(loss)  # a loss all-reduced for logging: the other ranks wait here for rank 0
        cost.append(all_ranks_requests() - start)

    every = []
    for _ in range(repeats):
        step()
        dist.barrier()
        t = time.perf_counter()
        opt.state_dict()
        every.append(time.perf_counter() - t)
    dist.barrier()
    state_mb = sum(p.numel() for p in model.parameters()) * 8 / 2**20
    out = {"world": world, "rank": rank, "state_mb": round(state_mb, 2), "iteration_s": statistics.median(times),
           "store_requests_per_iteration": per_iteration,
           "every_rank_state_dict_s": {"median": statistics.median(every), "min": min(every), "max": max(every)}}
    if rank == 0:
        out["rank0_state_dict_s"] = {"median": statistics.median(rank0), "min": min(rank0), "max": max(rank0)}
        out["store_requests_per_rank0_checkpoint"] = statistics.median(cost)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    results = []
    for world in args.worlds:
        results += run_ranks(_measure, world, args.iters, args.hidden, args.repeats, backend="gloo")
    print(json.dumps({"torch": torch.__version__, "results": results}, indent=1))


if __name__ == "__main__":
    main()
