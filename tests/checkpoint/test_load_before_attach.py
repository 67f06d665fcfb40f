"""A state loaded into an optimizer before ``attach`` (as frameworks load it right after wrapping the
model) is kept, and laid out at attach: the run then continues exactly as torch.optim continues from
the same dict. What can be checked at load is refused there; what does not fit at attach is refused on
every rank at attach, leaving the optimizer unattached with its state still kept, and the DDP module
without a comm hook."""

import copy

import torch
import torch.nn.functional as F
from ckpt_scenarios import assert_same_state, train, train_ref
from distributed import run_ranks
from expect import raises
from scenarios import VOCAB, Case, OddNet, _compare, batch, build, param_groups
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.checkpoint.checks import StateDictError

CASE = Case(opt="AdamW", bucket_cap_mb=0.0001, groups=2, overlap="step")


def _fresh(case, weights):
    """The model rebuilt from ``weights`` and an optimizer built before its DDP (with another lr, which
    the load must replace)."""
    model = OddNet().to(case.dtype)
    model.load_state_dict(weights)
    model.never.requires_grad_(False)
    groups = param_groups(model, case)
    for g in groups:
        g["lr"] = 0.5
    return model, fused_zero.AdamW(groups)


def loads_before_attach(rank, world):
    out = {}
    built = build(CASE, rank)
    model, ddp, opt, ref_model, ref_ddp, ref_opt, _ = built
    sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    train(CASE, ddp, opt, rank, 3)
    train_ref(CASE, ref_model, ref_ddp, ref_opt, None, rank, 3)
    sched.step()  # the saved groups' lr differs from construction
    for g, r in zip(opt.param_groups, ref_opt.param_groups):
        g["lr"] = r["lr"]
    ours, theirs = opt.state_dict(), copy.deepcopy(ref_opt.state_dict())
    weights = copy.deepcopy(ref_model.state_dict())

    for name, sd in (("ours", ours), ("torch.optim's", theirs)):
        model2, opt2 = _fresh(CASE, weights)
        opt2.load_state_dict(sd)  # no DDP yet
        kept = opt2.state_dict()
        assert_same_state(kept["state"], sd["state"])
        assert [g["lr"] for g in kept["param_groups"]] == [g["lr"] for g in sd["param_groups"]], name
        ddp2 = DDP(model2, bucket_cap_mb=CASE.bucket_cap_mb)
        opt2.attach(ddp2)
        ref2 = copy.deepcopy(ref_model)
        ref2_opt = torch.optim.AdamW(param_groups(ref2, CASE), foreach=False)
        ref2_opt.load_state_dict(copy.deepcopy(theirs))
        ref2_ddp = DDP(ref2, bucket_cap_mb=CASE.bucket_cap_mb)
        for step in range(4, 8):
            train(CASE, ddp2, opt2, rank, 1, start=step)
            train_ref(CASE, ref2, ref2_ddp, ref2_opt, None, rank, 1, start=step)
            _compare(model2, ref2, CASE, step, rank)
        out[name] = "continued bit-identically"
        opt2._engine.close()

    # refused at load, nothing changed: still unattached, groups and (empty) state as they were
    model3, opt3 = _fresh(CASE, weights)
    broken = copy.deepcopy(theirs)
    del broken["state"][0]["exp_avg"]
    out["at_load"] = raises(lambda: opt3.load_state_dict(broken), StateDictError, "lacks 'exp_avg'")
    assert opt3.state_dict()["state"] == {} and opt3.param_groups[0]["lr"] == 0.5

    # refused at attach, on every rank: only rank 0 loaded
    if rank == 0:
        opt3.load_state_dict(theirs)
    ddp3 = DDP(model3, bucket_cap_mb=CASE.bucket_cap_mb)
    out["one_rank"] = raises(lambda: opt3.attach(ddp3), StateDictError, "some ranks loaded an optimizer state "
                                                                        "before attach and others did not")
    assert not opt3.attached and not getattr(ddp3, "_comm_hooks", None)
    opt3.load_state_dict(theirs)
    opt3.attach(ddp3)  # every rank has it now: it fits
    out["then_attached"] = opt3.attached
    opt3._engine.close()
    return out


def refused_at_attach(rank, world):
    """bf16: the dict's fp32 masters must round to the weights. Changed between load and attach, they
    no longer do: attach refuses on every rank, changes nothing, and works once the weights are back."""
    case = Case(opt="AdamW", bucket_cap_mb=0.0001, dtype=torch.bfloat16)
    model, ddp, opt, *_ = build(case, rank)
    train(case, ddp, opt, rank, 3)
    sd, weights = opt.state_dict(), copy.deepcopy(model.state_dict())
    model2, opt2 = _fresh(case, weights)
    opt2.load_state_dict(sd)
    with torch.no_grad():
        model2.l1.weight.add_(1.0)  # the weights moved after the load
    before = [p.detach().clone() for p in model2.parameters()]
    ddp2 = DDP(model2, bucket_cap_mb=case.bucket_cap_mb)
    verdict = raises(lambda: opt2.attach(ddp2), StateDictError,
                     "the state loaded before attach does not fit: .*does not round to the parameter")
    assert not opt2.attached and not getattr(ddp2, "_comm_hooks", None)
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model2.parameters()))
    assert opt2.state_dict()["state"].keys() == sd["state"].keys()  # still kept
    with torch.no_grad():
        model2.l1.weight.copy_(weights["l1.weight"])
    opt2.attach(ddp2)
    x, y = batch(9, 0, rank)
    F.cross_entropy(ddp2(x, use_branch=True).float().reshape(-1, VOCAB), y.reshape(-1)).backward()
    opt2.step()
    return verdict


def test_a_state_loaded_before_attach_is_kept_and_applied():
    for out in run_ranks(loads_before_attach, 2):
        assert out["ours"] == out["torch.optim's"] == "continued bit-identically"
        assert out["then_attached"] is True


def test_what_does_not_fit_is_refused_at_attach_on_every_rank():
    assert run_ranks(refused_at_attach, 2) == ["ok: the state loaded before attach does not fit: .*does not "
                                               "round to the parameter"] * 2
