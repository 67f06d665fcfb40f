"""Adam's bias-correction tables (update/step_columns.py) under betas that change every step: OneCycleLR's
``cycle_momentum`` moves beta1 each step, and the table is rewritten in place (one device tensor, so one
pinned buffer for its uploads and one address for a CUDA graph), not made anew per set of betas. Run on
the CPU model of the side stream (the stream-order checker's pinned memory), 400 steps of OneCycleLR:
the pinned bytes stay those of the table's doublings (it grows with the step counts up to beta2's
saturation step), never one buffer per step."""

from __future__ import annotations

import numpy as np
import torch

import fused_zero
from fused_zero.streamcheck import StreamChecker
from fused_zero.update.step_columns import BiasTables, saturation

STEPS = 400


def _pinned(engine) -> tuple[int, int]:
    """Bytes of pinned host memory the side stream's uploads hold, and how many shapes they have."""
    rings = engine.side._staging.rings
    return sum(b.numel() * b.element_size() for ring in rings.values() for b, _ in ring), len(rings)


def test_onecycle_keeps_the_pinned_memory_of_one_table():
    with StreamChecker():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        opt = fused_zero.AdamW(model.parameters(), lr=1e-2, ddp=model)
        schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS)
        seen = []
        for _ in range(STEPS):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
            seen.append(_pinned(opt._engine))
    table = opt._algorithm._bias
    largest = table.both.numel() * table.both.element_size()
    shapes = seen[-1][1]
    # every table the doublings made, and the few small uploads of every step (tables, -lr, counts)
    assert seen[-1][0] <= 2 * largest + 4096, (seen[-1], largest)
    assert shapes <= int(np.log2(STEPS)) + 6, seen[-1]
    assert seen[-1] == seen[STEPS // 2 + 60], (seen[STEPS // 2 + 60], seen[-1])  # flat between doublings


def test_a_rewritten_table_holds_what_a_new_one_would():
    """The table after betas changed, in place, equals one made for the new betas from nothing."""
    group = torch.zeros(1, dtype=torch.int64)

    def upload(host, out=None):
        return host.clone() if out is None else out.copy_(host)
    kept = BiasTables()
    for betas, bound in (((0.9, 0.999), 40), ((0.85, 0.999), 41), ((0.95, 0.99), 90), ((0.9, 0.999), 2000)):
        kept.get([{"betas": betas}], bound, group, upload)
        fresh = BiasTables().get([{"betas": betas}], bound, group, upload, first=kept.length)
        assert kept.length == fresh.length >= min(bound, max(saturation(b) for b in betas))
        assert torch.equal(kept.both, fresh.both), betas
