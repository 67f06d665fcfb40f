"""Pinned host memory of the side stream's uploads over many OneCycleLR steps (its ``cycle_momentum``
changes beta1 every step, so Adam's bias table is rewritten every step), on the CPU model of CUDA
streams (the stream-order checker), which allocates pinned buffers as the CUDA path does:

    python bench/pinned_onecycle.py [STEPS] [OUT.json]      # 10,000 steps: about 1.5 minutes on 2 cores

Prints the pinned bytes and upload shapes at a few steps, and the least and most pinned bytes from step
1,024 on (where the table holds ``UPLOAD_ROWS`` rows and a rewrite uploads a fixed shape)."""

import json
import sys
import time

import torch

import fused_zero
from fused_zero.algorithms.step_columns import UPLOAD_ROWS
from fused_zero.testing.streamcheck import StreamChecker


def pinned(engine) -> tuple[int, int]:
    rings = engine.side._staging.rings
    return sum(b.numel() * b.element_size() for ring in rings.values() for b, _ in ring), len(rings)


def main(steps: int, out: str | None) -> None:
    with StreamChecker():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        opt = fused_zero.AdamW(model.parameters(), lr=1e-2, ddp=model)
        schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=steps)
        seen, later, t0 = {}, [], time.time()
        marks = {1, 10, 100, 500, steps} | set(range(1000, steps + 1, 1000))
        for step in range(1, steps + 1):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
            nbytes, shapes = pinned(opt._engine)
            if step >= UPLOAD_ROWS:
                later.append(nbytes)
            if step in marks:
                seen[step] = dict(bytes=nbytes, shapes=shapes, beta1=opt.param_groups[0]["betas"][0])
                print(step, seen[step], f"{time.time() - t0:.0f} s", flush=True)
    summary = dict(steps=steps, torch=torch.__version__, pinned=seen, table_rows=opt._algorithm._bias.length + 1,
                   from_step_1024=dict(min=min(later), max=max(later)) if later else None)
    print("from step 1024 on:", summary["from_step_1024"])
    if out:
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000, sys.argv[2] if len(sys.argv) > 2 else None)
