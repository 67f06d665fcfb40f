"""state_dict() in torch.optim's canonical form: ours loads into torch.optim and theirs into ours, and
a state saved at one world size loads at another."""

import pytest
import torch
from distributed import run_ranks
from scenarios import Case, _compare, _reference_step, build, loss_of


def _train(case, ddp, opt, rank, steps, start=1):
    for step in range(start, start + steps):
        loss_of(ddp, case, step, 0, rank).backward()
        opt.step()
        opt.zero_grad()


def swap_with_torch(rank, world, case):
    """Train ours and torch side by side, swap their state dicts, keep training, stay equal."""
    model, ddp, opt, ref_model, ref_ddp, ref_opt, _ = build(case, rank)
    for step in range(1, 6):
        for d, o in ((ddp, opt), (ref_ddp, ref_opt)):
            loss_of(d, case, step, 0, rank).backward()
            o.step() if o is opt else _reference_step(ref_model, ref_opt, None, case)
            o.zero_grad()
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    assert ours["state"].keys() == theirs["state"].keys()
    for k, st in theirs["state"].items():
        assert st.keys() == ours["state"][k].keys(), (st.keys(), ours["state"][k].keys())
        for name, value in st.items():
            torch.testing.assert_close(ours["state"][k][name], value, rtol=1e-6, atol=1e-8)
    for g_ours, g_theirs in zip(ours["param_groups"], theirs["param_groups"]):
        assert g_ours["params"] == g_theirs["params"]
        keys = set(g_theirs) - {"params", "foreach"}  # the reference pins foreach=False
        assert {k: g_ours[k] for k in keys} == {k: g_theirs[k] for k in keys}
    # swap: torch continues from ours, ours continues from torch's
    ref_opt.load_state_dict(ours)
    opt.load_state_dict(theirs)
    for step in range(6, 11):
        for d, o in ((ddp, opt), (ref_ddp, ref_opt)):
            loss_of(d, case, step, 0, rank).backward()
            o.step() if o is opt else _reference_step(ref_model, ref_opt, None, case)
            o.zero_grad()
        opt.synchronize()
        _compare(model, ref_model, case, step, rank)
    return "ok"


@pytest.mark.parametrize("case", [
    Case(opt="AdamW", bucket_cap_mb=0.0001, groups=2, kwargs={"amsgrad": True}),
    Case(opt="SGD", overlap="step", graph="find_unused", groups=2),
    Case(opt="Adam", grad_reduce="all_reduce", graph="static"),
], ids=["adamw", "sgd", "adam"])
def test_state_dict_swaps_with_torch_optim(case):
    assert run_ranks(swap_with_torch, 2, case) == ["ok", "ok"]


def save(rank, world, case, path):
    model, ddp, opt, *_ = build(case, rank)
    _train(case, ddp, opt, rank, steps=4)
    sd = opt.state_dict()
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": sd}, path)
    return sorted(sd["state"])


def load_and_resave(rank, world, case, path):
    model, ddp, opt, *_ = build(case, rank)
    saved = torch.load(path)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    again = opt.state_dict()
    for k, st in saved["opt"]["state"].items():
        for name, value in st.items():
            assert torch.equal(again["state"][k][name], value), (k, name)
    _train(case, ddp, opt, rank, steps=2, start=5)  # and it keeps training
    return "ok"


def test_state_saved_at_two_ranks_loads_at_three(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    case = Case(opt="AdamW", bucket_cap_mb=0.0001, dtype=torch.bfloat16)
    run_ranks(save, 2, case, path)
    other = Case(opt="AdamW", bucket_cap_mb=25.0, dtype=torch.bfloat16)  # other buckets too
    assert run_ranks(load_and_resave, 3, other, path) == ["ok"] * 3
