"""Resuming under DDP past step 32 (the contract suite: conftest.py): torch.optim's state dict loaded into a
fresh fused_zero optimizer over a fresh DDP module at step 34, where Adam's bias tables (sized by the step
counts: algorithms/step_columns.py) must cover the loaded counts, continues bit for bit with DDP + torch.optim
trained without a break; so does a DCP checkpoint; and Muon beside an AdamW with 8-bit moments, through
DCP, attached in either order, is saved as each keeps its state (the 8-bit moments as uint8 codes with
their blocks' scales) and continues as the optimizers that saved it do.
"""

from __future__ import annotations

import os

import pytest
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


def _muon_beside_8bit(rank, world, path, order):
    """Muon over the matrices beside AdamW with 8-bit moments over the rest, attached in ``order``: saved
    through DCP at step 4, as stored (the 8-bit moments as uint8 codes with their blocks' scales, Muon's
    momentum in fp32, whichever attached first), loaded by a fresh pair over a fresh DDP module; the
    fresh pair and the savers then step alike."""
    kw = {"bucket_cap_mb": 0.0001}

    def pair(model, ddp):
        mats, rest = split(model, MATRICES)
        made = {"Muon": lambda: optimizer("Muon", mats, True, ddp=ddp),
                "AdamW": lambda: optimizer("AdamW", rest, True, ddp=ddp, state_format="8bit")}
        return [made[kind]() for kind in order]
    (model, ddp), _ = models(kw)
    opts = pair(model, ddp)
    for step in range(1, 5):
        _step(ddp, opts, step, rank)
    sds = {str(i): o.sharded_state_dict() for i, o in enumerate(opts)}
    dcp.save(sds, checkpoint_id=path)
    _saved_as_stored(sds, path, order, rank)
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


def _saved_as_stored(sds: dict, path: str, order: tuple, rank: int) -> None:
    """What DCP wrote of each optimizer: the 8-bit AdamW's moments as uint8 codes (this rank's chunks and the
    checkpoint's metadata), named "8bit" with every block's scale in its ``fused_zero`` entry; Muon's
    momentum in fp32. Its first- or second-attached place changes nothing of it."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for k, kind in enumerate(order):
        state, (_, described) = sds[str(k)]["state"], sds[str(k)]["fused_zero"]
        names = ("exp_avg", "exp_avg_sq") if kind == "AdamW" else ("momentum_buffer",)
        want = torch.uint8 if kind == "AdamW" else torch.float32
        for i, entry in state.items():
            for name in names:
                where = f"rank {rank} {order}: {kind} (optimizer {k}) state[{i}][{name!r}]"
                chunks = entry[name]._local_tensor.local_shards()
                assert all(c.dtype == want for c in chunks), f"{where}: held as {[c.dtype for c in chunks]}"
                disk = saved[f"{k}.state.{i}.{name}"].properties.dtype
                assert disk == want, f"{where}: saved as {disk}, not {want}"
                if kind == "AdamW":
                    assert described["stored"][i][name] == "8bit", f"{where}: {described['stored'].get(i)}"
                    starts, scales = described["blocks"][(i, name)]
                    assert len(starts) == len(scales) > 0 and scales.dtype == torch.float32, where
        if kind == "Muon":
            assert not described["stored"] and not described["blocks"], described


@pytest.mark.parametrize("order", [("Muon", "AdamW"), ("AdamW", "Muon")])
def test_muon_beside_an_8bit_adamw_through_dcp(tmp_path, order):
    assert run_ranks(_muon_beside_8bit, 2, str(tmp_path), order) == ["ok", "ok"]
