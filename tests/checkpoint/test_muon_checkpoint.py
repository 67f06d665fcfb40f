"""Muon's checkpoints beside AdamW's: torch.optim.Muon's format, both ways, from rank 0 alone, and
through DCP across world sizes. The oracle is torch.optim.Muon + torch.optim.AdamW trained side by
side under plain DDP (scenarios.py, ``opt="Muon"``)."""

import copy
import os

import torch
import torch.distributed as dist
from ckpt_scenarios import dcp_save, load_and_continue, train_both
from distributed import run_ranks
from scenarios import Case, build

SAVED = Case(opt="Muon", bucket_cap_mb=0.0001, groups=2)


def assert_equal_state(ours: dict, theirs: dict) -> None:
    """Two canonical dicts: the same parameters and entries, bit for bit, and the same group values."""
    assert ours["state"].keys() == theirs["state"].keys()
    for k, st in theirs["state"].items():
        assert st.keys() == ours["state"][k].keys(), (st.keys(), ours["state"][k].keys())
        for name, value in st.items():
            assert torch.equal(ours["state"][k][name], value), (k, name)
    for g, ref in zip(ours["param_groups"], theirs["param_groups"], strict=True):
        assert {k: v for k, v in g.items() if k in ref} == ref, (g, ref)


def save_at_two(rank, world, path):
    built = build(SAVED, rank)
    model, ddp, opt, ref_model, ref_ddp, ref_opt, _ = built
    train_both(SAVED, built, rank, 4)
    muon, ref_muon = opt.opts[0], ref_opt.opts[0]
    every = muon.state_dict()  # every rank, all at once
    theirs = copy.deepcopy(ref_muon.state_dict())
    assert_equal_state(every, theirs)
    assert all(set(st) == {"momentum_buffer"} for st in every["state"].values())  # torch keeps no step
    alone = muon.state_dict() if rank == 0 else None  # rank 0 alone: the others serve it unasked
    train_both(SAVED, built, rank, 1, start=5)  # the others go on; rank 0's dict is the step-4 state
    if rank == 0:
        assert_equal_state(alone, every)
        # into torch.optim.Muon: a fresh one over the reference's parameters holds torch's own state then
        fresh = torch.optim.Muon([{"params": list(g["params"])} for g in ref_muon.param_groups], lr=1.0)
        fresh.load_state_dict(every)
        assert_equal_state(fresh.state_dict(), theirs)
        torch.save({"model": model.state_dict(), "torch": ref_opt.state_dict()}, os.path.join(path, "ckpt.pt"))
    dcp_save(opt, os.path.join(path, "dcp"))
    dist.barrier()
    return "ok"


def load_elsewhere(rank, world, path, bucket_cap_mb):
    """torch's dicts into ours (canonical), then the DCP checkpoint saved at two ranks, at another
    world size and bucket size: each continues equal to torch.optim continuing from its own dict."""
    saved = torch.load(os.path.join(path, "ckpt.pt"))
    load_and_continue(Case(opt="Muon", bucket_cap_mb=bucket_cap_mb, groups=2), rank,
                      {**saved, "ours": saved["torch"]}, os.path.join(path, "dcp"), settle_reference=world == 4)
    dist.barrier()
    return "ok"


def test_muon_checkpoints_round_trip(tmp_path):
    path = str(tmp_path)
    assert run_ranks(save_at_two, 2, path) == ["ok"] * 2
    for world, cap in ((1, 25.0), (2, 0.0005), (4, 0.0001)):
        assert run_ranks(load_elsewhere, world, path, cap) == ["ok"] * world
