"""Checkpoint scenarios run on every rank. The oracle is torch.optim: a reference model trained side
by side under plain DDP, or torch.optim continuing from the same saved state. Before a load the live
optimizer is perturbed (trained on other data), so that a load that does nothing fails."""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
import torch.distributed.checkpoint as dcp
from scenarios import _compare, _reference_step, build, loss_of


def train(case, ddp, opt, rank, steps, start=1):
    for step in range(start, start + steps):
        loss_of(ddp, case, step, 0, rank).backward()
        opt.step()
        opt.zero_grad()


def train_ref(case, ref_model, ref_ddp, ref_opt, masters, rank, steps, start=1):
    for step in range(start, start + steps):
        loss_of(ref_ddp, case, step, 0, rank).backward()
        _reference_step(ref_model, ref_opt, masters, case)


def train_both(case, built, rank, steps, start=1, compare=True):
    model, ddp, opt, ref_model, ref_ddp, ref_opt, masters = built
    for step in range(start, start + steps):
        train(case, ddp, opt, rank, 1, step)
        train_ref(case, ref_model, ref_ddp, ref_opt, masters, rank, 1, step)
        if compare:
            _compare(model, ref_model, case, step, rank)


def perturb(case, built, rank):
    """Train the fresh optimizer elsewhere first: its state (and the buckets) then differ from the
    checkpoint's, and the model weights are reloaded afterwards by the caller."""
    train(case, built[1], built[2], rank, 3, start=500)



def load_and_continue(case, rank, saved: dict, dcp_path: str, forms=("canonical", "dcp"),
                      settle_reference: bool = False) -> None:
    """For each form: build ``case`` afresh, perturb it, load ``saved`` (``model``, torch.optim's
    ``torch`` dict into the reference, ``ours`` or the DCP checkpoint at ``dcp_path`` into fused_zero),
    then train both 4 steps, compared step by step. ``settle_reference``: train the reference elsewhere
    first too, so that both DDPs have rebuilt their buckets (at four ranks gloo's sums of differently
    ordered buckets differ in the last bit, and the comparison is exact)."""
    for form in forms:
        built = build(case, rank)
        model, ddp, opt, ref_model, ref_ddp, ref_opt, masters = built
        perturb(case, built, rank)
        if settle_reference:
            train_ref(case, ref_model, ref_ddp, ref_opt, masters, rank, 3, start=500)
        for m in (model, ref_model):
            m.load_state_dict(saved["model"])
        ref_opt.load_state_dict(copy.deepcopy(saved["torch"]))
        if form == "canonical":
            opt.load_state_dict(saved["ours"])
        else:
            dcp_load(opt, dcp_path)
        train_both(case, built, rank, 4, start=5)
        opt._engine.close()


def assert_same_state(ours: dict, theirs: dict) -> None:
    """Two canonical dicts' ``state``: the same parameters, the same entries, the same values."""
    assert ours.keys() == theirs.keys()
    for k, st in theirs.items():
        assert st.keys() == ours[k].keys(), (st.keys(), ours[k].keys())
        for name, value in st.items():
            torch.testing.assert_close(ours[k][name], value, rtol=1e-6, atol=1e-8)


def snapshot(opt, model) -> dict:
    """Everything a refused load must leave byte for byte: parameters, state regions, steps, groups."""
    eng = opt._engine
    eng.synchronize()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "regions": [{n: s.values(n).clone() for n in s.names} for s in eng.shards()],
            "steps": eng.steps.copy(), "groups": copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                                                  for g in opt.param_groups])}


def assert_unchanged(before: dict, opt, model) -> None:
    after = snapshot(opt, model)
    for a, b in zip(before["params"], after["params"]):
        assert torch.equal(a, b), "a refused load changed a parameter"
    for ra, rb in zip(before["regions"], after["regions"]):
        for n in ra:
            assert torch.equal(ra[n], rb[n]), f"a refused load changed state {n}"
    assert (before["steps"] == after["steps"]).all(), "a refused load changed the step counts"
    assert before["groups"] == after["groups"], "a refused load changed param_groups"


@contextlib.contextmanager
def warnings_as_errors():
    """Any warning raises: torch's "Please use DTensor instead and we are deprecating ShardedTensor" on
    every ``dcp.load`` of a ShardedTensor, among others."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def dcp_save(opt, path):
    with warnings_as_errors():
        dcp.save(opt.sharded_state_dict(), checkpoint_id=path)


def dcp_load(opt, path):
    with warnings_as_errors():
        sd = opt.sharded_state_dict()
        dcp.load(sd, checkpoint_id=path)
    opt.load_sharded_state_dict(sd)
