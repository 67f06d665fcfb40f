"""One ``sharded_state_dict()`` for ``dcp.save`` and ``dcp.load``, as torch's DCP examples use one state
dict for both (the contract suite: conftest.py): save then load into the same dict, and load then save
from it, in every state format, give the state back bit for bit.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed import run_ranks
from harness import Run, compare_state, models, optimizer


def _trained(fmt: str, steps: int, rank: int):
    (model, ddp), _ = models({"bucket_cap_mb": 0.001})
    opt = optimizer("AdamW", ddp.parameters(), True, ddp=ddp, state_format=fmt)
    for step in range(1, steps + 1):
        run_step(ddp, opt, step, rank)
    return model, ddp, opt


def run_step(ddp, opt, step: int, rank: int) -> None:
    Run(ddp, [opt], None, rank, dist.get_world_size(), True).loss(step).backward()
    opt.step()
    opt.zero_grad()


def _one_dict(rank: int, world: int, fmt: str, where: str) -> str:
    model, ddp, opt = _trained(fmt, 3, rank)
    before = opt.state_dict()
    sd = opt.sharded_state_dict()
    dcp.save(sd, checkpoint_id=f"{where}/a")
    dcp.load(sd, checkpoint_id=f"{where}/a")  # the same dict, saved from, loaded into
    opt.load_sharded_state_dict(sd)
    compare_state(opt.state_dict(), before, f"rank {rank} {fmt}: save then load into the same dict")

    # load into a fresh optimizer's dict, then save that very dict: the checkpoint that was loaded
    fresh_model, fresh_ddp, fresh = _trained(fmt, 0, rank)
    fresh_model.load_state_dict(model.state_dict())
    sd = fresh.sharded_state_dict()
    dcp.load(sd, checkpoint_id=f"{where}/a")
    fresh.load_sharded_state_dict(sd)
    dcp.save(sd, checkpoint_id=f"{where}/b")
    third_model, third_ddp, third = _trained(fmt, 0, rank)
    third_model.load_state_dict(model.state_dict())
    sd = third.sharded_state_dict()
    dcp.load(sd, checkpoint_id=f"{where}/b")
    third.load_sharded_state_dict(sd)
    compare_state(third.state_dict(), before, f"rank {rank} {fmt}: load then save from the same dict")
    for step in (4, 5):  # and it trains on as the saver does
        run_step(ddp, opt, step, rank)
        run_step(third_ddp, third, step, rank)
    for (name, p), q in zip(model.named_parameters(), third_model.parameters()):
        assert torch.equal(p, q), f"rank {rank} {fmt}: {name} differs after the resume"
    for o in (opt, fresh, third):
        o._engine.close()
    return "ok"


def _formats(rank, world, where):
    return [(fmt, _one_dict(rank, world, fmt, f"{where}/{fmt}")) for fmt in ("fp32", "bf16", "8bit")]


@pytest.mark.parametrize("world", [2])
def test_one_dict_saves_and_loads_in_every_state_format(world):
    with tempfile.TemporaryDirectory() as where:
        for results in run_ranks(_formats, world, where):
            assert all(r == "ok" for _, r in results), results

