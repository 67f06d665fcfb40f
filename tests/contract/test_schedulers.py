"""Schedulers that change betas every step (the contract suite: conftest.py): OneCycleLR and CyclicLR with
their default ``cycle_momentum=True`` on Adam and AdamW cycle beta1 with the lr, each step, and so may
user code that sets ``group["betas"]``. Every mode, against DDP + torch.optim with the same scheduler."""

from __future__ import annotations

import torch
from distributed import run_ranks
from harness import optimizer, twin
from test_several_optimizers import MODES, _plain_loop

SCHEDULES = ("OneCycleLR", "CyclicLR", "by hand")


def _scheduled(kind: str, schedule: str, **options):
    def make(model, ddp, fused, run):
        opt = optimizer(kind, ddp.parameters(), fused, **(dict(ddp=ddp, **options) if fused else {}))
        if schedule == "OneCycleLR":
            run.keep["schedule"] = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=20)
        elif schedule == "CyclicLR":
            run.keep["schedule"] = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=1e-2, step_size_up=2)
        return [opt]
    return make


def _loop(run, step):
    _plain_loop(run, step)
    if "schedule" in run.keep:
        run.keep["schedule"].step()
    else:  # user code setting betas itself
        for g in run.opts[0].param_groups:
            g["betas"] = (0.9 - 0.01 * (step % 5), 0.99 + 0.001 * (step % 3))


def _cases(rank, world):
    out = []
    for i, (mode, schedule) in enumerate((m, s) for m in MODES for s in SCHEDULES):
        kind = ("Adam", "AdamW")[i % 2]
        twin(rank, world, _loop, _scheduled(kind, schedule, overlap=mode[0], grad_reduce=mode[1]), steps=6)
        out.append((mode, schedule, "ok"))
    return out


def test_betas_that_change_every_step():
    for results in run_ranks(_cases, 2):
        assert all(r[-1] == "ok" for r in results), results
