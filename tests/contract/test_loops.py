"""The loops users run, as they write them (the contract suite: conftest.py): nanoGPT's (accumulation
with ``require_backward_grad_sync``, a GradScaler, ``unscale_`` and ``clip_grad_norm_``, the lr set at the
top of the iteration), the Hugging Face Trainer's (``no_sync`` accumulation, ``clip_grad_norm_``, the
scheduler after the step, ``model.zero_grad()``), Lightning's (``optimizer.step(closure)``, the backward
inside the closure), a scheduler stepped between the backward and the step, two synced backwards per
step, ``find_unused_parameters`` with a branch some ranks skip and ``static_graph``. Each in every mode
that honors it; the others refuse on every rank, naming the mode that does.
"""

from __future__ import annotations

import contextlib
import math

import torch
from distributed import run_ranks
from harness import optimizer, ours_alone, refused, twin
from test_several_optimizers import HONORS_EDITS, MODES


def _one(kind: str = "AdamW", **options):
    def make(model, ddp, fused, run):
        opts = dict(ddp=ddp, **options) if fused else {}
        if fused and run.scaler is not None:
            opts["grad_scaler"] = run.scaler
        opt = optimizer(kind, list(ddp.parameters()), fused, **opts)
        run.keep["schedule"] = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.3 * s))
        return [opt]
    return make


def nanogpt(run, step):
    """nanoGPT's train.py: lr from get_lr() set first, micro-batches with require_backward_grad_sync,
    the scaler, unscale_ and clip_grad_norm_, then step, update and zero_grad(set_to_none=True)."""
    opt = run.opts[0]
    for g in opt.param_groups:
        g["lr"] = 1e-2 * (0.5 + 0.5 * math.cos(step / 3))
    for micro in range(2):
        run.ddp.require_backward_grad_sync = micro == 1
        run.scaler.scale(run.loss(step, micro) / 2).backward()
    run.scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(run.ddp.parameters(), 0.5)
    run.scaler.step(opt)
    run.scaler.update()
    opt.zero_grad(set_to_none=True)


def nanogpt_without_clip(run, step):
    """nanoGPT with ``grad_clip = 0.0``: no unscale_, no clip."""
    opt = run.opts[0]
    for micro in range(2):
        run.ddp.require_backward_grad_sync = micro == 1
        run.scaler.scale(run.loss(step, micro) / 2).backward()
    run.scaler.step(opt)
    run.scaler.update()
    opt.zero_grad(set_to_none=True)


def trainer(run, step):
    """The Trainer's inner loop: no_sync for all but the last micro-batch, clip_grad_norm_, step,
    lr_scheduler.step(), model.zero_grad()."""
    opt = run.opts[0]
    for micro in range(2):
        with run.ddp.no_sync() if micro == 0 else contextlib.nullcontext():
            (run.loss(step, micro) / 2).backward()
    torch.nn.utils.clip_grad_norm_(run.ddp.parameters(), 0.5)
    opt.step()
    run.keep["schedule"].step()
    run.ddp.zero_grad()


def lightning(run, step):
    """Lightning's automatic optimization: optimizer.step(closure), the closure running the forward
    and the backward."""
    opt = run.opts[0]

    def closure():
        loss = run.loss(step)
        loss.backward()
        return loss
    opt.step(closure)
    opt.zero_grad()
    run.keep["schedule"].step()


def late_scheduler(run, step):
    """The scheduler stepped between the backward and the step: the step uses the new lr."""
    run.loss(step).backward()
    run.keep["schedule"].step()
    run.opts[0].step()
    run.opts[0].zero_grad()


def two_synced_backwards(run, step):
    """Two losses, each with its own synced backward, then one step on their sum."""
    run.loss(step, 0).backward()
    run.loss(step, 1).backward()
    run.opts[0].step()
    run.opts[0].zero_grad()


def unused_branch(run, step):
    """find_unused_parameters: the branch runs on some steps, on one rank only on others."""
    (run.loss(step, use_branch=(step + run.rank) % 3 == 0)).backward()
    run.opts[0].step()
    run.opts[0].zero_grad()
    run.keep["schedule"].step()


def _plain_loop(run, step):
    run.loss(step).backward()
    run.opts[0].step()
    run.opts[0].zero_grad()
    run.keep["schedule"].step()


LOOPS = {  # loop, what it needs of the mode (None: every mode), DDP's options, a scaler
    "nanoGPT": (nanogpt, "edits", {}, True),
    "nanoGPT without clip": (nanogpt_without_clip, None, {}, True),
    "the Trainer": (trainer, "edits", {}, False),
    "Lightning": (lightning, None, {}, False),
    "a late scheduler": (late_scheduler, "late", {}, False),
    "two synced backwards": (two_synced_backwards, "edits", {}, False),
    "find_unused_parameters": (unused_branch, None, {"find_unused_parameters": True}, False),
    "static_graph": (_plain_loop, None, {"static_graph": True}, False),
}

REFUSED = {"edits": "param.grad was changed|second synced backward",
           "late": "param_groups changed between backward and optimizer.step"}


def _honors(mode, needs) -> bool:
    if needs == "edits":
        return mode == HONORS_EDITS
    if needs == "late":
        return mode[0] == "step"
    return True


def _cases(rank, world, names):
    out = []
    for name in names:
        loop, needs, ddp_kw, scaler = LOOPS[name]
        for mode in MODES:
            if scaler and mode[0] == "bucket":
                continue  # a GradScaler needs every gradient before any update: refused at construction
            make = _one(overlap=mode[0], grad_reduce=mode[1])
            if _honors(mode, needs):
                twin(rank, world, loop, make, ddp_kw=ddp_kw, scaler=scaler, steps=5)
                out.append((name, mode, "ok"))
            else:
                message = refused(lambda make=make, loop=loop, scaler=scaler: ours_alone(
                    rank, world, loop, make, scaler=scaler), REFUSED[needs])
                assert "overlap='step'" in message, message
                out.append((name, mode, "refused, naming overlap='step'"))
    return out


def test_the_frameworks_loops():
    for results in run_ranks(_cases, 2, ["nanoGPT", "nanoGPT without clip", "the Trainer", "Lightning"]):
        assert all(r[-1] in ("ok", "refused, naming overlap='step'") for r in results), results


def test_late_hyperparameters_accumulation_and_unused_parameters():
    names = ["a late scheduler", "two synced backwards", "find_unused_parameters", "static_graph"]
    for results in run_ranks(_cases, 2, names):
        assert all(r[-1] in ("ok", "refused, naming overlap='step'") for r in results), results
