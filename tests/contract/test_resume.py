"""Resuming under DDP past step 32 (the contract suite: conftest.py): torch.optim's state dict loaded into a
fresh fused_zero optimizer over a fresh DDP module at step 34, where Adam's bias tables (sized by the step
counts: update/step_columns.py) must cover the loaded counts, continues bit for bit with DDP + torch.optim
trained without a break; so does a DCP checkpoint; and Muon beside an AdamW with 8-bit moments, through
DCP, continues as the optimizers that saved it do.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed import run_ranks
from harness import Run, models, optimizer, same, split
from test_several_optimizers import MATRICES

SAVED_AT = 34


def _step(ddp, opts, step, rank):
    Run(ddp, opts, None, rank, dist.get_world_size(), True).loss(step).backward()
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad()


def _past_32(rank, world, path, how):
    """fused_zero.Adam and torch.optim.Adam side by side to step 34; then a fresh fused_zero.Adam over a
    fresh DDP module of the same weights takes the state (``how``: torch's dict, fused_zero's own
    ``state_dict()``, or DCP) and both go on to step 40."""
    kw = {"bucket_cap_mb": 0.0001}
    (model, ddp), (ref, ref_ddp) = models(kw)
    hp = {"hp": {"betas": (0.9, 0.999)}}
    opt = optimizer("Adam", list(ddp.parameters()), True, ddp=ddp, **hp)
    ref_opt = optimizer("Adam", list(ref_ddp.parameters()), False, **hp)
    for step in range(1, SAVED_AT + 1):
        _step(ddp, [opt], step, rank)
        _step(ref_ddp, [ref_opt], step, rank)
    (fresh, fresh_ddp), _ = models(kw)
    fresh.load_state_dict(model.state_dict())
    resumed = optimizer("Adam", list(fresh_ddp.parameters()), True, ddp=fresh_ddp, **hp)
    if how == "torch":
        resumed.load_state_dict(ref_opt.state_dict())
    elif how == "ours":
        resumed.load_state_dict(opt.state_dict())
    else:
        dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
        sd = resumed.sharded_state_dict()
        dcp.load(sd, checkpoint_id=path)
        resumed.load_sharded_state_dict(sd)
    opt._engine.close()
    for step in range(SAVED_AT + 1, SAVED_AT + 7):
        _step(fresh_ddp, [resumed], step, rank)
        _step(ref_ddp, [ref_opt], step, rank)
        for (name, p), q in zip(fresh.named_parameters(), ref.parameters()):
            same(p.detach(), q.detach(), f"rank {rank} step {step} {name} ({how})")
    resumed._engine.close()
    return "ok"


def _every_way(rank, world, path):
    return [(how, _past_32(rank, world, os.path.join(path, how), how)) for how in ("torch", "ours", "dcp")]


def test_a_resume_past_step_32_under_ddp(tmp_path):
    for results in run_ranks(_every_way, 2, str(tmp_path)):
        assert all(r == "ok" for _, r in results), results


def _muon_beside_8bit(rank, world, path):
    """Muon over the matrices beside AdamW with 8-bit moments over the rest: saved through DCP at step 4,
    loaded by a fresh pair over a fresh DDP module; the fresh pair and the savers then step alike."""
    kw = {"bucket_cap_mb": 0.0001}

    def pair(model, ddp):
        mats, rest = split(model, MATRICES)
        return [optimizer("Muon", mats, True, ddp=ddp), optimizer("AdamW", rest, True, ddp=ddp, state_format="8bit")]
    (model, ddp), _ = models(kw)
    opts = pair(model, ddp)
    for step in range(1, 5):
        _step(ddp, opts, step, rank)
    dcp.save({str(i): o.sharded_state_dict() for i, o in enumerate(opts)}, checkpoint_id=path)
    (fresh, fresh_ddp), _ = models(kw)
    fresh.load_state_dict(model.state_dict())
    resumed = pair(fresh, fresh_ddp)
    sd = {str(i): o.sharded_state_dict() for i, o in enumerate(resumed)}
    dcp.load(sd, checkpoint_id=path)
    for i, o in enumerate(resumed):
        o.load_sharded_state_dict(sd[str(i)])
    for a, b in zip(opts, resumed):
        theirs = b.state_dict()["state"]
        for i, entry in a.state_dict()["state"].items():
            for key, value in entry.items():
                same(theirs[i][key], value, f"rank {rank} {type(a).__name__} state[{i}][{key}]")
    for step in range(5, 8):
        _step(ddp, opts, step, rank)
        _step(fresh_ddp, resumed, step, rank)
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            assert torch.equal(p, q), f"rank {rank} step {step} {name}: the resumed pair differs"
    for o in opts + resumed:
        o._engine.close()
    return "ok"


def test_muon_beside_an_8bit_adamw_through_dcp(tmp_path):
    assert run_ranks(_muon_beside_8bit, 2, str(tmp_path)) == ["ok", "ok"]
