"""What the rank-0-only state_dict() handshake (fused_zero/checkpoint/rank0.py) costs per iteration.

Run: ``python bench/checkpoint_sync_cost.py [--world 2] [--iters 400]``. Trains a small model on gloo
ranks with the handshake on and off, alternating blocks of iterations, and reports per rank the time
spent in the handshake itself and the iteration time with and without it."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.demo.spawn import run_ranks


def _measure(rank, world, iters, hidden):
    torch.manual_seed(0)
    results = {}
    runs = {}
    for handshake in (True, False):
        model = nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 64))
        ddp = DDP(model, bucket_cap_mb=0.05)
        opt = fused_zero.AdamW(ddp.parameters(), ddp=ddp, checkpoint_handshake=handshake)
        spent = [0.0]
        sync = opt._checkpoint_sync
        inner = sync.at_iteration_start

        def timed(serve, inner=inner, spent=spent):
            t = time.perf_counter()
            inner(serve)
            spent[0] += time.perf_counter() - t

        sync.at_iteration_start = timed
        runs[handshake] = (ddp, opt, spent, [])
    x = torch.randn(32, 64)
    block = 50
    for _ in range(0, iters, block):
        for ddp, opt, _spent, times in runs.values():
            torch.distributed.barrier()
            t = time.perf_counter()
            for _ in range(block):
                F.mse_loss(ddp(x), x).backward()
                opt.step()
                opt.zero_grad()
            times.append(time.perf_counter() - t)
    for handshake, (_ddp, _opt, spent, times) in runs.items():
        steady = times[1:]  # the first block holds the bucket rebuild
        results["on" if handshake else "off"] = {
            "iteration_us": 1e6 * min(steady) / block,
            "handshake_us": 1e6 * spent[0] / (block * len(times)),
        }
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    for rank, res in enumerate(run_ranks(_measure, args.world, args.iters, args.hidden, backend="gloo")):
        on, off = res["on"], res["off"]
        print(f"rank {rank}: handshake {on['handshake_us']:.0f} us/iteration; iteration {on['iteration_us']:.0f} us "
              f"with it, {off['iteration_us']:.0f} us without (best block of 50)")


if __name__ == "__main__":
    main()
