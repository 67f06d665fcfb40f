"""Canonical state dicts: ours loads into torch.optim and theirs into ours; bf16 resumes are
bit-identical (the fp32 masters travel); torch.distributed.checkpoint's helpers work; refused loads
change nothing. The oracle is torch.optim, and every load replaces a perturbed state."""

import copy
import io

import pytest
import torch
from ckpt_scenarios import assert_same_state, assert_unchanged, perturb, snapshot, train, train_both, train_ref
from distributed import run_ranks
from scenarios import Case, _compare, build
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from fused_zero.checkpoint.checks import StateDictError

SWAP_CASES = [
    Case(opt="AdamW", bucket_cap_mb=0.0001, groups=2, kwargs={"amsgrad": True}),
    Case(opt="SGD", overlap="step", graph="find_unused", groups=2),
    Case(opt="Adam", grad_reduce="all_reduce", graph="static"),
]


def swap_with_torch(rank, world):
    """Ours and torch.optim train side by side and agree; both are then perturbed (trained on other
    data, weights restored), load each other's dict, and must continue equal: a no-op load fails."""
    for case in SWAP_CASES:
        built = build(case, rank)
        model, ddp, opt, ref_model, ref_ddp, ref_opt, _ = built
        train_both(case, built, rank, 5)
        ours, theirs = opt.state_dict(), copy.deepcopy(ref_opt.state_dict())
        assert_same_state(ours["state"], theirs["state"])
        for g_ours, g_theirs in zip(ours["param_groups"], theirs["param_groups"]):
            keys = set(g_theirs) - {"foreach"}  # the reference pins foreach=False
            assert {k: g_ours[k] for k in keys} == {k: g_theirs[k] for k in keys}
        weights = copy.deepcopy(model.state_dict())
        train(case, ddp, opt, rank, 3, start=500)
        train_ref(case, ref_model, ref_ddp, ref_opt, None, rank, 3, start=500)
        for m in (model, ref_model):
            m.load_state_dict(weights)
        ref_opt.load_state_dict(ours)
        opt.load_state_dict(theirs)
        train_both(case, built, rank, 5, start=6)
        opt._engine.close()
    return "ok"


def test_state_dict_swaps_with_torch_optim():
    assert run_ranks(swap_with_torch, 2) == ["ok", "ok"]


def bf16_resume(rank, world, path):
    """A bf16 run saved at step 5 and resumed (state_dict, then DCP at the same world size) ends
    bit-identical to the uninterrupted run; torch.optim over fp32 copies continues from the same dict
    (its fp32_master entries as the weights) in parity."""
    import torch.distributed.checkpoint as dcp
    case = Case(opt="AdamW", bucket_cap_mb=0.0001, dtype=torch.bfloat16)
    model, ddp, opt, *_ = build(case, rank)
    train(case, ddp, opt, rank, 5)
    weights, sd = copy.deepcopy(model.state_dict()), opt.state_dict()
    assert all("fp32_master" in e for e in sd["state"].values())
    dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
    train(case, ddp, opt, rank, 5, start=6)
    final = [p.detach().clone() for p in model.parameters()]
    opt._engine.close()
    for form in ("state_dict", "dcp"):
        built = build(case, rank)
        model2, ddp2, opt2, ref_model, ref_ddp, ref_opt, masters = built
        perturb(case, built, rank)
        model2.load_state_dict(weights)
        if form == "state_dict":
            opt2.load_state_dict(sd)
        else:
            loaded = opt2.sharded_state_dict()
            dcp.load(loaded, checkpoint_id=path)
            opt2.load_sharded_state_dict(loaded)
        train(case, ddp2, opt2, rank, 5, start=6)
        for a, b in zip(model2.parameters(), final):
            assert torch.equal(a.detach(), b), f"{form}: the resumed bf16 run differs from the uninterrupted one"
        if form == "state_dict":
            # a master that does not round to its parameter (the weights were not loaded first, or the
            # dict comes from an optimizer that never updates the entry) is refused, and changes nothing
            stale = copy.deepcopy(sd)
            first = next(iter(stale["state"]))
            stale["state"][first]["fp32_master"] = stale["state"][first]["fp32_master"] + 0.25
            before = snapshot(opt2, model2)
            with pytest.raises(StateDictError, match="does not round to the parameter"):
                opt2.load_state_dict(stale)
            assert_unchanged(before, opt2, model2)
        opt2._engine.close()
    # torch.optim continues from our dict: fp32 masters as its weights, our moments as its state
    ref_model.load_state_dict(weights)
    index = {id(p): i for i, p in enumerate(ref_model.parameters())}
    with torch.no_grad():
        for p, m in zip(ref_model.parameters(), masters):
            entry = sd["state"].get(index[id(p)], {})  # a frozen parameter has no state
            m.copy_(entry["fp32_master"] if "fp32_master" in entry else p.float())
    ref_opt.load_state_dict(sd)  # fp32_master: an unknown key to torch.optim, carried along
    train_ref(case, ref_model, ref_ddp, ref_opt, masters, rank, 5, start=6)
    final_model = copy.deepcopy(ref_model)
    with torch.no_grad():
        for p, f in zip(final_model.parameters(), final):
            p.copy_(f)
    _compare(final_model, ref_model, case, 10, rank)
    return "ok"


def test_bf16_resume_is_bit_identical(tmp_path):
    assert run_ranks(bf16_resume, 2, str(tmp_path / "dcp")) == ["ok", "ok"]


def refused_and_helpers(rank, world, path):
    """Refused loads change nothing (every rank refuses together); opt.state tells one story; torch's
    get_/set_optimizer_state_dict round trip in parity with torch.optim's own."""
    case = Case(opt="AdamW", bucket_cap_mb=0.0001, groups=2)
    built = build(case, rank)
    model, ddp, opt, ref_model, ref_ddp, ref_opt, _ = built
    assert not opt.state and len(opt.state) == 0 and list(opt.state) == []
    p0 = next(iter(model.parameters()))
    assert p0 not in opt.state and opt.state[p0] == {}
    train_both(case, built, rank, 3)
    # opt.state: the parameters torch.optim has state for, each entry this rank's share
    assert len(opt.state) == len(ref_opt.state) and bool(opt.state)
    assert [p in opt.state for p in model.parameters()] == [p in ref_opt.state for p in ref_model.parameters()]
    shares = torch.tensor([sum(opt.state[p]["exp_avg"].numel() for p in opt.state)])
    torch.distributed.all_reduce(shares)
    assert shares.item() >= sum(p.numel() for p in ref_opt.state)
    assert float(opt.state[p0]["step"]) == 3.0
    with pytest.raises(TypeError):
        opt.state[p0] = {}

    good = opt.state_dict()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd.state.update({p: {"momentum_buffer": torch.zeros_like(p)} for p in model.parameters()})

    def edited(f):
        sd = copy.deepcopy(good)
        f(sd)
        return sd

    first = next(iter(good["state"]))
    bad = {
        "shape": (edited(lambda sd: sd["state"][first].update(exp_avg=torch.zeros(3))), "has shape"),
        "count": (edited(lambda sd: sd["param_groups"][0]["params"].pop()), "parameters, the state dict"),
        "groups": (edited(lambda sd: sd["param_groups"].pop()), "param groups"),
        "sgd": (sgd.state_dict(), "SGD"),
        "missing": (edited(lambda sd: sd["state"][first].pop("exp_avg_sq")), "lacks 'exp_avg_sq'"),
        "nan": (edited(lambda sd: sd["state"][first]["exp_avg"].view(-1).__setitem__(0, float("nan"))),
                "non-finite"),
        # a group's values are taken as torch.optim takes them (a negative lr too), but a beta of 1, whose bias
        # correction is 0, is refused
        "hparam": (edited(lambda sd: sd["param_groups"][1].update(betas=(1.0, 0.999))), "beta"),
        "garbage": ({"state": [1, 2], "param_groups": []}, "not an optimizer state dict"),
        # one rank's copy is corrupt: both refuse
        "one_rank": (edited(lambda sd: sd["state"][first]["exp_avg"].view(-1).__setitem__(0, float("inf")))
                     if rank == 1 else good, "non-finite"),
    }
    # a dict cut short: its last entry's tensors hold half their elements
    last = list(good["state"])[-1]
    bad["truncated"] = (edited(lambda sd: sd["state"][last].update(
        {k: v.reshape(-1)[: v.numel() // 2] for k, v in sd["state"][last].items() if k != "step"})), "has shape")
    # a file cut short does not even reach the optimizer: torch.load refuses it
    buf = io.BytesIO()
    torch.save(good, buf)
    with pytest.raises(Exception):  # noqa: B017 -- whichever error the unpickler trips over
        torch.load(io.BytesIO(buf.getvalue()[: len(buf.getvalue()) // 2]))
    before = snapshot(opt, model)
    for name, (sd, fragment) in bad.items():
        with pytest.raises(StateDictError, match=None) as info:
            opt.load_state_dict(sd)
        assert fragment in str(info.value), (name, str(info.value))
        assert_unchanged(before, opt, model)
    # a refused sharded load: one rank's chunk is non-finite
    import torch.distributed.checkpoint as dcp
    dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
    sharded = opt.sharded_state_dict()
    dcp.load(sharded, checkpoint_id=path)
    runs = [t for t in sharded["state"][first]["exp_avg"].to_local().local_shards() if t.numel()]  # this rank's
    if rank == 1 and runs:
        runs[0][0] = float("nan")
    for tamper, fragment in ((None, "non-finite"), ("kind", "SGD")):
        if tamper == "kind":
            groups, described = sharded["fused_zero"]
            sharded["fused_zero"] = (groups, {**described, "kind": "sgd"})
        with pytest.raises(StateDictError) as info:
            opt.load_sharded_state_dict(sharded)
        assert fragment in str(info.value) or rank == 0, str(info.value)
        assert_unchanged(before, opt, model)
    opt.load_state_dict(good)  # and a good one loads
    train_both(case, built, rank, 2, start=4)

    # torch's helpers, default options and full_state_dict: compared with the same helpers on torch.optim
    for options in (None, StateDictOptions(full_state_dict=True)):
        osd = get_optimizer_state_dict(ddp, opt, options=options)
        ref_osd = get_optimizer_state_dict(ref_ddp, ref_opt, options=options)
        if options is None or rank == 0:
            assert osd["state"].keys() == ref_osd["state"].keys()
            for fqn, st in ref_osd["state"].items():
                for k, v in st.items():
                    torch.testing.assert_close(osd["state"][fqn][k], v, rtol=1e-6, atol=1e-8)
        osd = get_optimizer_state_dict(ddp, opt)  # every rank loads it
        weights = copy.deepcopy(model.state_dict())
        fresh = build(case, rank)
        assert not fresh[2].state  # set_optimizer_state_dict's dummy step on an empty state
        fresh[0].load_state_dict(weights)
        set_optimizer_state_dict(fresh[1], fresh[2], osd, options=options)
        assert all(p.grad is None for p in fresh[0].parameters())
        for p, q in zip(fresh[0].parameters(), model.parameters()):
            assert torch.equal(p, q), "the state initialization step changed a parameter"
        train_both(case, (fresh[0], fresh[1], fresh[2], ref_model, ref_ddp, ref_opt, None), rank, 2, start=6)
        # the original optimizer follows the reference too, so that the next round starts equal
        with torch.no_grad():
            for p, q in zip(model.parameters(), fresh[0].parameters()):
                p.copy_(q)
        opt.load_state_dict(fresh[2].state_dict())
        fresh[2]._engine.close()
    return "ok"


def test_refused_loads_and_torch_helpers(tmp_path):
    assert run_ranks(refused_and_helpers, 2, str(tmp_path / "dcp")) == ["ok", "ok"]
