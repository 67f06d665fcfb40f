"""A checkpoint saved at two ranks (canonical ``state_dict(to=0)`` and torch.distributed.checkpoint)
loads at three ranks and at one, with other buckets, and training continues in parity with
torch.optim continuing from its own saved state. Saving through DCP holds no more than the rank's own
state plus one bucket, warns of nothing (no ShardedTensor), and torch's ``dcp_to_torch_save`` reads the
checkpoint back as whole tensors. A checkpoint of the ShardedTensor form (format 1,
``data/dcp_format1``) loads at three ranks and at one; a format this version does not know is refused,
naming it."""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckpt_scenarios import dcp_load, dcp_save, load_and_continue, train_both
from distributed import run_ranks
from memory import peak_bytes
from scenarios import Case, build
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.checkpoint.checks import StateDictError

SAVED = Case(opt="AdamW", bucket_cap_mb=0.0001, groups=2)
FORMAT1 = os.path.join(os.path.dirname(__file__), "data", "dcp_format1")


def format1_model():
    """The model and param groups data/dcp_format1 was saved from (see its README)."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    return model, [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def load_format1(rank):
    """The ShardedTensor form's checkpoint (2 ranks, torch 2.11) into a fresh optimizer that stepped
    elsewhere first: its state becomes the saved one exactly; then the same with the format marker
    raised to one this version does not read, which is refused."""
    expected = torch.load(os.path.join(FORMAT1, "expected.pt"))
    model, groups = format1_model()
    ddp = DDP(model, bucket_cap_mb=0.0002)
    opt = fused_zero.AdamW(groups, ddp=ddp, lr=3e-2)
    ddp(torch.randn(4, 6)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    model.load_state_dict(expected["model"])
    dcp_load(opt, os.path.join(FORMAT1, "optim"))
    got, want = opt.state_dict(), expected["optimizer"]
    assert got["state"].keys() == want["state"].keys()
    for i, st in want["state"].items():
        for name, v in st.items():
            assert torch.equal(got["state"][i][name], v), (i, name)
    assert [g["lr"] for g in got["param_groups"]] == [1e-2, 1e-2]
    sd = opt.sharded_state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(FORMAT1, "optim"))
    groups, meta = sd["fused_zero"]
    sd["fused_zero"] = (groups, {**meta, "format": 99})
    try:
        opt.load_sharded_state_dict(sd)
        raise AssertionError("a checkpoint of format 99 loaded")
    except StateDictError as e:
        assert "format 99" in str(e), e
    opt._engine.close()


def measure_save_memory(rank, world, path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 64))
    ddp = DDP(model, bucket_cap_mb=0.1)
    opt = fused_zero.AdamW(ddp.parameters(), ddp=ddp, lr=1e-3)
    for _ in range(3):  # past DDP's bucket rebuild
        ddp(torch.randn(8, 256)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    eng = opt._engine
    own = sum(s.state_bytes() for s in eng.shards())
    bucket = max(s.layout.numel for s in eng.shards()) * 4
    full = sum(p.numel() for p in model.parameters()) * 4 * len(eng.members[0].algo.state_names())
    peak = peak_bytes(lambda: dcp.save(opt.sharded_state_dict(), checkpoint_id=path))
    # the measurement must see the copies of the rank's own state, else it could not catch a full gather
    assert own / 2 < peak < own + bucket < full, (peak, own, bucket, full)
    if rank != 0:  # state_dict(to=0) costs the other ranks at most one bucket
        gathered = peak_bytes(lambda: opt.state_dict(to=0))
        assert gathered <= bucket, (gathered, bucket)
    else:
        assert opt.state_dict(to=0) is not None
    return {"peak": peak, "own": own, "bucket": bucket, "full": full}


def save_at_two(rank, world, path):
    built = build(SAVED, rank)
    model, ddp, opt, ref_model, ref_ddp, ref_opt, _ = built
    train_both(SAVED, built, rank, 4)
    assert opt._engine.layout_changes > 0
    canonical = opt.state_dict(to=0)
    assert (canonical is None) == (rank != 0)
    full = opt.state_dict()
    if rank == 0:
        for k, st in full["state"].items():
            for name, v in st.items():
                assert torch.equal(canonical["state"][k][name], v)
        torch.save({"model": model.state_dict(), "ours": canonical, "torch": ref_opt.state_dict()},
                   os.path.join(path, "ckpt.pt"))
    dcp_save(opt, os.path.join(path, "dcp"))
    memory = measure_save_memory(rank, world, os.path.join(path, "mem"))
    return memory


def load_elsewhere(rank, world, path, bucket_cap_mb):
    """At another world size and bucket size: ours loads (canonical, then DCP), torch.optim loads its
    own saved state, and both continue equal step by step."""
    saved = torch.load(os.path.join(path, "ckpt.pt"))
    load_and_continue(Case(opt="AdamW", bucket_cap_mb=bucket_cap_mb, groups=2), rank, saved,
                      os.path.join(path, "dcp"))
    load_format1(rank)
    dist.barrier()
    return "ok"


def test_saved_at_two_loads_at_three_and_one(tmp_path):
    path = str(tmp_path)
    memory = run_ranks(save_at_two, 2, path)
    print("dcp.save peak bytes per rank:", memory)
    # torch's own offline reader: every state tensor whole, as the canonical dict holds it, flattened
    dcp_to_torch_save(os.path.join(path, "dcp"), os.path.join(path, "whole.pt"))
    whole, canonical = torch.load(os.path.join(path, "whole.pt")), torch.load(os.path.join(path, "ckpt.pt"))["ours"]
    assert whole["fused_zero"][1]["format"] == 3
    assert whole["state"].keys() == {str(i) for i in canonical["state"]}  # DCP's keys are strings
    for i, st in canonical["state"].items():
        for name, v in st.items():
            assert torch.equal(whole["state"][str(i)][name], v.flatten() if name != "step" else v), (i, name)
    assert run_ranks(load_elsewhere, 3, path, 25.0) == ["ok"] * 3
    assert run_ranks(load_elsewhere, 1, path, 0.0005) == ["ok"]
