"""Build first, attach later: an optimizer built without ddp= refuses to train until attach(ddp), attach
raises what construction raises, and a late attach trains exactly as ddp= at construction does."""

import functools
import gc

import torch
import torch.nn.functional as F
from distributed import run_ranks
from expect import raises
from scenarios import VOCAB, OddNet, batch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.checkpoint.checks import StateDictError

PLAIN_IN_GROUP = "plain .*OddNet while a process group of 2 ranks .*DistributedDataParallel\\(model\\)"


def _model():
    torch.manual_seed(0)
    model = OddNet()
    model.never.requires_grad_(False)
    return model




def _loss(module, step, rank):
    x, y = batch(step, 0, rank)
    return F.cross_entropy(module(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1))


class _Holder(nn.Module):
    """Some other wrapper around a DDP module."""

    def __init__(self, inner):
        super().__init__()
        self.module = inner


def unattached_and_attach_errors(rank, world):
    out = []
    model = _model()
    opt = fused_zero.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # before attach: must work
    out.append(str(opt.attached))
    out.append(raises(opt.step, RuntimeError, r"step\(\) needs this AdamW attached .* opt.attach\(ddp\)"))
    out.append(raises(opt.synchronize, RuntimeError, "attach"))
    out.append(raises(lambda: _loss(model, 0, rank).backward(), RuntimeError, "a backward through its parameters"))
    opt.zero_grad()
    sd = opt.state_dict()  # what Accelerate's prepare round-trips: a fresh optimizer's dict
    out.append(repr((sd["state"], sd["param_groups"][0]["lr"])))
    opt.load_state_dict(sd)
    with_state = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": sd["param_groups"]}
    # checked at load, before attach (a valid one is kept until attach: tests/checkpoint/test_load_before_attach.py)
    out.append(raises(lambda: opt.load_state_dict(with_state), StateDictError, "lacks 'exp_avg'"))
    out.append(raises(lambda: opt.attach(model), TypeError, PLAIN_IN_GROUP))
    lone = _model()
    lone_opt = fused_zero.AdamW(lone.parameters())
    plain_ddp = DDP(lone)  # a DDP the optimizer was never given: its backward must not train silently
    out.append(raises(lambda: _loss(plain_ddp, 0, rank).backward(), RuntimeError, "attach"))
    del lone_opt
    wrong = DDP(_model())
    out.append(raises(lambda: opt.attach(wrong), ValueError, "not a parameter that the DDP module reduces"))
    out.append(raises(lambda: opt.attach(_Holder(wrong)), TypeError, "wraps a DistributedDataParallel"))
    out.append(raises(lambda: opt.attach(DDP(model), overlap="bucket", max_grad_norm=1.0), ValueError,
                      "max_grad_norm needs"))
    ddp = DDP(model)
    opt.attach(ddp)  # the failed attaches left it unattached and usable
    out.append(str(opt.attached))
    out.append(raises(lambda: opt.attach(ddp), RuntimeError, "already attached"))
    other = fused_zero.AdamW(model.parameters())
    out.append(raises(functools.partial(other.attach, ddp), ValueError, "is already updated by the AdamW"))
    del other  # unattached, it would refuse the backward below: its parameters are the model's
    gc.collect()
    _loss(ddp, 0, rank).backward()
    opt.step()
    sched.step()
    out.append(repr(opt.param_groups[0]["lr"]))

    built = fused_zero.AdamW(_model().parameters(), overlap="step")
    out.append(raises(lambda: built.attach(DDP(_model()), overlap="bucket"), ValueError, "give it once"))
    out.append(raises(lambda: fused_zero.AdamW(model.parameters(), overlap="eager"), ValueError, "overlap='eager'"))
    out.append(raises(lambda: fused_zero.AdamW(model.parameters(), sharding=1), TypeError, "sharding.*options are"))
    out.append(raises(lambda: fused_zero.SGD(model.parameters(), ddp=_Holder(ddp)), TypeError, "pass that DDP"))
    return out


def test_unattached_optimizer_refuses_and_attach_checks_like_construction():
    results = run_ranks(unattached_and_attach_errors, 2)
    assert results[0] == results[1], results
    assert results[0][0] == "False" and "True" in results[0], results[0]
    assert results[0][4] == "({}, 0.1)"
    assert results[0][-5] == repr(0.05)  # the scheduler built before attach stepped the lr


def attached_late_matches_torch(rank, world):
    """Optimizer and scheduler built before the DDP; parity with DDP + torch.optim.AdamW, bit for bit."""
    model, ref_model = _model(), _model()
    opt = fused_zero.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    ddp = DDP(model)
    opt.attach(ddp)
    ref_ddp = DDP(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.02, weight_decay=0.1, foreach=False)
    ref_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=5)
    differing = []
    for step in range(6):
        _loss(ddp, step, rank).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        _loss(ref_ddp, step, rank).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        differing += [(step, n) for (n, p), q in zip(model.named_parameters(), ref_model.parameters())
                      if not torch.equal(p, q)]
    return differing


def test_attached_late_trains_bit_identically():
    for differing in run_ranks(attached_late_matches_torch, 2):
        assert differing == []
