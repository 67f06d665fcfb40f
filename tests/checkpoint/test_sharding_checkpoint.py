"""Checkpoints move between sharding configurations, at four ranks (replicas x shard size): saved at 2 x 2
(canonical, also gathered to a rank of the second replica with ``to=3``, by rank 0 alone while the
others wait in an all-reduce, and written from global rank 2 as Lightning and Accelerate write it, the
dict the canonical loads below start from; and DCP), loaded at 1 x 4
(flat) and 4 x 1 (every rank a replica), in both forms, and saved at 4 x 1 through DCP (four replicas
writing the same chunks) and loaded at 2 x 2 (as a DeviceMesh). After each load training continues in
parity with torch.optim continuing from its own saved state, every parameter of every rank compared
step by step (bit for bit: gloo's plan at four ranks sums as DDP does)."""

import os

import torch
import torch.distributed as dist
from ckpt_scenarios import assert_same_state, dcp_save, load_and_continue, train_both
from distributed import run_ranks
from scenarios import Case, build

TINY = 0.0001


def case(shard, bucket=TINY):
    return Case(opt="AdamW", bucket_cap_mb=bucket, groups=2, shard=shard)


def save(rank, path, saved: Case, tag: str):
    built = build(saved, rank)
    model, ddp, opt, ref_model, ref_ddp, ref_opt, _ = built
    train_both(saved, built, rank, 4)
    full = opt.state_dict()
    to3 = opt.state_dict(to=3)  # gathered by rank 3's shard group alone (the second replica)
    assert (to3 is None) == (rank != 3)
    if rank == 3:
        assert_same_state(to3["state"], full["state"])
    assert_same_state(full["state"], ref_opt.state_dict()["state"])
    if rank == 0:  # alone, the others already in a collective of their own: its shard group serves it
        assert_same_state(opt.state_dict()["state"], full["state"])
    dist.all_reduce(torch.zeros(1))
    # as Lightning and Accelerate do it, the checkpoint built on every rank and written from global rank 2 (the
    # second replica's first rank): the dict there, torch.optim's entry for entry; {} elsewhere. The
    # loads below continue from what rank 2 wrote.
    written = opt.state_dict_written_by(2)
    if rank != 2:
        assert written == {}, f"rank {rank}: {type(written).__name__} of {len(written)} entries, not {{}}"
    else:
        assert written, "rank 2 writes the checkpoint and got an empty dict"
        _same_dicts(written, ref_opt.state_dict(), "rank 2's written dict against torch.optim's")
        _same_dicts(written, full, "rank 2's written dict against state_dict()")
        torch.save({"model": model.state_dict(), "ours": written, "torch": ref_opt.state_dict()},
                   os.path.join(path, f"{tag}.pt"))
    dcp_save(opt, os.path.join(path, f"{tag}-dcp"))
    opt._engine.close()
    dist.barrier()


def _same_dicts(ours: dict, theirs: dict, where: str) -> None:
    """Two canonical dicts: the same parameters and entries, bit for bit (fused_zero adds nothing for
    fp32 parameters), and the same param groups (but ``foreach``: the oracle is built single-tensor)."""
    assert sorted(ours["state"]) == sorted(theirs["state"]), f"{where}: {sorted(ours['state'])}"
    for i, entry in theirs["state"].items():
        assert list(ours["state"][i]) == list(entry), f"{where}: state[{i}] {list(ours['state'][i])}"
        for key, value in entry.items():
            assert torch.equal(ours["state"][i][key], value), f"{where}: state[{i}][{key!r}] differs"
    def groups(sd):
        return [{k: v for k, v in g.items() if k != "foreach"} for g in sd["param_groups"]]
    assert groups(ours) == groups(theirs), f"{where}: param groups {groups(ours)}, {groups(theirs)}"


def load(rank, path, loaded: Case, tag: str, forms=("canonical", "dcp")):
    saved = torch.load(os.path.join(path, f"{tag}.pt"))
    load_and_continue(loaded, rank, saved, os.path.join(path, f"{tag}-dcp"), forms, settle_reference=True)
    dist.barrier()


def round_trips(rank, world, path):
    save(rank, path, case(2), "2x2")
    load(rank, path, case(None, bucket=25.0), "2x2")   # 1 x 4: one shard group of four
    load(rank, path, case(1, bucket=0.0015), "2x2")    # 4 x 1: four replicas of the whole state
    save(rank, path, case(1), "4x1")
    load(rank, path, case("mesh:2", bucket=0.0015), "4x1", forms=("dcp",))
    return "ok"


def test_round_trips_between_sharding_configurations(tmp_path):
    assert run_ranks(round_trips, 4, str(tmp_path)) == ["ok"] * 4
