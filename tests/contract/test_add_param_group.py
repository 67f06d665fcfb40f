"""``opt.add_param_group`` after construction, as torch.optim and ZeroRedundancyOptimizer allow it (the
contract suite: conftest.py): progressive unfreezing, where the optimizer starts with part of the module
and takes the rest later. The rest is reduced by DDP from the start (it requires grad) and updated by
nothing until it joins; then it trains with the new group's hyperparameters, its state starting as
torch.optim's does. Against DDP + torch.optim doing the same, every parameter after every step and the
state dict at the end; in every mode at 2 ranks and in two at 3, before the first step and after it;
AdamW, Muon (matrices joining a Muon), RMSprop (a group with momentum joining groups without: a state
the optimizer did not keep before), NAdam (kept scalars); the new group through ``state_dict()`` and
DCP. Before: ``RuntimeError: ... add_param_group afterwards is not supported``.
"""

from __future__ import annotations

import itertools
import tempfile

import pytest
import torch.distributed.checkpoint as dcp
from distributed import run_ranks
from harness import Run, compare_state, models, optimizer, twin

MODES = list(itertools.product(("bucket", "backward", "step"), ("reduce_scatter", "all_reduce")))
FIRST = ("emb", "l1")  # what the optimizer starts with
MATRICES = ("l1.weight", "l2.weight", "branch.weight")


def _split(model, kind: str):
    """The parameters the optimizer starts with, and those that join it later."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kind == "Muon":
        return [p for n, p in named if n == "l1.weight"], [p for n, p in named if n in MATRICES[1:]]
    return [p for n, p in named if n.startswith(FIRST)], [p for n, p in named if not n.startswith(FIRST)]


NEW_GROUP = {"AdamW": {"lr": 5e-3, "weight_decay": 0.0}, "Muon": {"lr": 1e-2},
             "RMSprop": {"lr": 2e-3, "momentum": 0.9}, "NAdam": {"lr": 4e-3}}
"""Each optimizer's added group's own hyperparameters (the rest: the optimizer's defaults)."""


def _grow(rank, world, kind, overlap, reduce, at, where=None):
    """``kind`` over the first part of the module; at step ``at`` (before its forward) the rest joins."""
    hp = {"RMSprop": {"momentum": 0.0}}.get(kind, {})  # RMSprop starts without momentum

    def make(model, ddp, fused, run):
        first, _ = _split(model, kind)
        options = dict(ddp=ddp, overlap=overlap, grad_reduce=reduce) if fused else {}
        return [optimizer(kind, first, fused, hp=hp, **options)]

    def loop(run: Run, step: int):
        if step == at:
            _, rest = _split(run.ddp.module, kind)
            run.opts[0].add_param_group({"params": rest, **NEW_GROUP[kind]})
        run.loss(step).backward()
        run.opts[0].step()
        run.opts[0].zero_grad()
        if where is not None and step == at + 1 and run.fused:  # the new group through DCP, both ways
            sd = run.opts[0].sharded_state_dict()
            dcp.save(sd, checkpoint_id=f"{where}/{kind}")
            before = run.opts[0].state_dict()
            assert len(before["param_groups"]) == 2, before["param_groups"]
            sd = run.opts[0].sharded_state_dict()
            dcp.load(sd, checkpoint_id=f"{where}/{kind}")
            run.opts[0].load_sharded_state_dict(sd)
            compare_state(run.opts[0].state_dict(), before, f"rank {run.rank}: after DCP", bits=True)
    twin(rank, world, loop, make, steps=at + 3)
    return "ok"


@pytest.mark.parametrize("overlap, reduce", MODES)
def test_adamw_grows_in_every_mode(overlap, reduce):
    assert run_ranks(_grow, 2, "AdamW", overlap, reduce, 3) == ["ok"] * 2


@pytest.mark.parametrize("kind", ["Muon", "RMSprop", "NAdam"])
def test_muon_and_the_twins_grow(kind):
    with tempfile.TemporaryDirectory() as where:
        assert run_ranks(_grow, 2, kind, "bucket", "reduce_scatter", 2, where) == ["ok"] * 2


def test_a_group_added_before_the_first_step_and_at_three_ranks():
    assert run_ranks(_grow, 2, "AdamW", "step", "all_reduce", 1) == ["ok"] * 2
    for overlap, reduce in (("bucket", "reduce_scatter"), ("step", "all_reduce")):
        assert run_ranks(_grow, 3, "AdamW", overlap, reduce, 2) == ["ok"] * 3


def _refused(rank, world):
    (model, ddp), _ = models({"bucket_cap_mb": 0.0001})
    first, rest = _split(model, "AdamW")
    opt = optimizer("AdamW", first, True, ddp=ddp)
    other = optimizer("AdamW", rest[:1], True, ddp=ddp)  # owns one of the rest
    Run(ddp, [opt, other], None, rank, world, True).loss(1).backward()  # the layout settles at the forward
    for o in (opt, other):
        o.step()
        o.zero_grad()
    out = []
    for group in ({"params": rest[:2]}, {"params": [model.never.weight]}):
        try:
            opt.add_param_group(group)
            out.append("not refused")
        except ValueError as e:
            out.append(str(e).split(":")[1][:40])
        assert len(opt.param_groups) == 1  # the optimizer keeps its groups as they were
    for o in (opt, other):
        if o._engine is not None:
            o._engine.close()
    return out


def test_a_group_that_cannot_join_is_refused_and_changes_nothing():
    """A parameter another fused_zero optimizer updates, one DDP does not reduce (frozen when DDP was built)."""
    for out in run_ranks(_refused, 2):
        assert "not refused" not in out and all(o.startswith(" add_param_group() got a parameter") for o in out), out
