"""fused_zero's twins of torch.optim's elementwise optimizers (every Spec of algorithms/elementwise.py: its
TWINS) and of Adafactor (whole parameters on every rank: pipeline/updating/whole_params.py) against
DDP + torch.optim.<Name>, single-tensor, on the same data (scenarios.py): every parameter of every rank
after every step, two param groups and an lr schedule, in every overlap x grad_reduce mode; at the end
each one's state dict, tensor for tensor. Each optimizer runs with the options that change its update
(the test hyperparameters its Spec declares, scenarios.DEFAULT_HPARAMS: weight decay, RMSprop's
momentum and centering, Adagrad's lr decay and start value, ASGD's averaging from step 3).
Bit for bit at 2 ranks and at 4 with shard groups; at 3 ranks within the parity tests' tolerance, as
AdamW (DDP divides the gradients by 3 before summing them, fused_zero after: scenarios._exact).

Then: bf16 moments against torch.optim with its moments put through bf16 (formats_scenarios.py), the
state each rank holds (1/W of torch's), and what is refused (compact formats where the state is no moment,
LBFGS and SparseAdam). GradScaler over two of them, Muon beside RMSprop and zeroing between the steps
are in the contract suite (tests/contract/test_several_optimizers.py); checkpoints in
tests/checkpoint/test_torch_optimizers_checkpoint.py.

The ranks are shared: every case of a world size runs in one call (tests/distributed.py).
"""

import itertools

import pytest
import torch
from distributed import run_ranks
from formats_scenarios import FormatCase, run_format_cases
from scenarios import DEFAULT_HPARAMS, Case, constructor_kwargs, param_groups, run_cases
from test_parity import MODES, ONE, TINY, TWO, bf16, check
from test_sharding import check_state_per_rank

import fused_zero
from fused_zero.algorithms.elementwise import SPECS
from fused_zero.optimizer import TWINS

MOMENTS = [name for name in TWINS if SPECS[name].moments]  # those a bf16 state_format applies to
ALL = (*TWINS, "Adafactor")


def test_every_optimizer_in_every_mode_two_ranks():
    sizes = itertools.cycle((TINY, TWO, ONE))
    cases = [Case(opt=opt, overlap=o, grad_reduce=r, bucket_cap_mb=next(sizes), groups=2, steps=8)
             for opt in ALL for o, r in MODES]
    results = run_ranks(run_cases, 2, cases)
    check(cases, results)
    for case, (_, out) in zip(cases, results[0]):  # 1/2 of torch.optim's state, plus the tails
        mem = out["memory"]
        if case.opt == "Adafactor":  # its statistics on every rank: torch's bytes, a few per row and column
            assert mem["state"] == mem["reference_state"], mem
            continue
        assert mem["state"] * 2 <= mem["reference_state"] + 2 * 4 * 32 * len(SPECS[case.opt].state) * out["buckets"]


OPTIONS = {
    "bf16 parameters, fp32 masters": dict(dtype=bf16),
    "find_unused: a layer without gradients": dict(graph="find_unused"),
    "no_sync accumulation, no grad views": dict(accumulate=2, as_view=False),
    "nanoGPT accumulation": dict(accumulate=2, nanogpt_accumulate=True),
    "static_graph": dict(graph="static"),
    "maximize": dict(kwargs={"maximize": True}),
    "foreach=True, as torch runs it": dict(kwargs={"foreach": True}),
    "a branch used on some steps and ranks, bf16 params": dict(dtype=bf16, fp32_branch=True),
}


def test_options_two_ranks():
    """Each option with every optimizer once, the modes cycled; and every optimizer with bf16 parameters
    and no masters (``master_weights=False``: the update written into the bf16 parameters, rounded),
    against torch.optim on fp32 copies rounded back to bf16 after every step (scenarios.Case.master)."""
    options = itertools.cycle(OPTIONS.values())
    modes = itertools.cycle(itertools.product(MODES, (TINY, TWO, ONE)))
    cases = []
    for opt in ALL:
        for _ in range(2):
            (o, r), b = next(modes)
            cases.append(Case(opt=opt, overlap=o, grad_reduce=r, bucket_cap_mb=b, steps=6, **next(options)))
    for opt, ((o, r), b) in zip(ALL, itertools.cycle(itertools.product(MODES, (TWO, TINY)))):
        cases.append(Case(opt=opt, overlap=o, grad_reduce=r, bucket_cap_mb=b, steps=6, dtype=bf16, master=False))
    check(cases, run_ranks(run_cases, 2, cases))


def test_clipping_two_ranks():
    """max_grad_norm: the coefficient from the global norm, as clip_grad_norm_ (to its last bit)."""
    cases = [Case(opt=opt, overlap="step", grad_reduce=r, bucket_cap_mb=TWO, max_grad_norm=0.5, steps=6)
             for opt, r in zip(ALL, itertools.cycle(("reduce_scatter", "all_reduce")))]
    check(cases, run_ranks(run_cases, 2, cases))


def test_nccls_reduction_plan_two_ranks():
    """NCCL's plan forced on gloo: each rank's reduce-scatter leaves only its slice reduced (gloo's own
    plan reduces the whole bucket), so Adafactor must gather the slices: bit for bit in every mode."""
    cases = [Case(opt=opt, overlap=o, grad_reduce="reduce_scatter", bucket_cap_mb=b, plan="nccl", steps=4)
             for opt in ("Adafactor", "RMSprop") for o, b in zip(("bucket", "backward", "step"), (TINY, TWO, ONE))]
    check(cases, run_ranks(run_cases, 2, cases))


def test_three_ranks():
    cases = [Case(opt=opt, overlap=o, grad_reduce=r, bucket_cap_mb=b, groups=2, steps=6)
             for opt, ((o, r), b) in zip(ALL, itertools.cycle(itertools.product(MODES, (TINY, ONE))))]
    check(cases, run_ranks(run_cases, 3, cases))


def test_shard_groups_four_ranks():
    """Two shard groups of two: each rank holds 1/2 of the state; bit for bit on gloo's plan."""
    cases = [Case(opt=opt, overlap=o, grad_reduce=r, bucket_cap_mb=TINY, shard=2, groups=2, steps=6)
             for opt, (o, r) in zip(ALL, itertools.cycle(MODES))]
    results = run_ranks(run_cases, 4, cases)
    check(cases, results)
    for rank_results in results:
        for case, (_, out) in zip(cases, rank_results):
            if case.opt != "Adafactor":  # no region-shaped state: its statistics are every rank's
                check_state_per_rank(case, out)


def test_bf16_moments_two_ranks():
    """state_format="bf16": bit for bit against torch.optim whose moments are rounded to bf16 before and
    after each step, as fused_zero stores them (the 0-dim scalars stay fp32, as torch keeps them)."""
    cases = [FormatCase(state_format="bf16", opt=opt, overlap=o, grad_reduce=r)
             for opt, (o, r) in zip(MOMENTS, itertools.cycle(MODES))]
    run_ranks(run_format_cases, 2, cases)


def test_adagrads_accumulator_starts_where_the_scenarios_say():
    """The scenarios give Adagrad ``initial_accumulator_value`` through its constructor, where torch reads it
    (a param group's key of that name is ignored), to torch.optim's and to fused_zero's: both accumulators
    start at 0.1, not at 0."""
    case = Case(opt="Adagrad", groups=2)
    start = DEFAULT_HPARAMS["Adagrad"]["initial_accumulator_value"]
    model = torch.nn.Linear(3, 4)
    assert start == 0.1 and constructor_kwargs("Adagrad", case) == {"initial_accumulator_value": start}
    assert all("initial_accumulator_value" not in g for g in param_groups(model, case))
    theirs = torch.optim.Adagrad(param_groups(model, case), **constructor_kwargs("Adagrad", case))
    ours = fused_zero.Adagrad(param_groups(model, case), **constructor_kwargs("Adagrad", case), ddp=model)
    for sd in (theirs.state_dict(), ours.state_dict()):
        assert len(sd["state"]) == 2 and all(torch.equal(e["sum"], torch.full_like(e["sum"], start))
                                             for e in sd["state"].values()), sd["state"]


@pytest.mark.parametrize("name", ALL)
def test_compact_formats_refused_where_they_do_not_apply(name):
    model = torch.nn.Linear(3, 4)
    for fmt in ("8bit",) + (() if name in MOMENTS else ("bf16",)):
        with pytest.raises(ValueError, match=f"state_format='{fmt}' is not supported for {name}"):
            getattr(fused_zero, name)(model.parameters(), ddp=model, state_format=fmt)
        with pytest.raises(ValueError, match=f"state_format='{fmt}' is not supported for {name}"):
            getattr(fused_zero, name)([{"params": model.parameters(), "state_format": fmt}], ddp=model)
    with pytest.raises(ValueError, match="stochastic_rounding is not supported"):
        getattr(fused_zero, name)(model.bfloat16().parameters(), ddp=model, master_weights="stochastic")


@pytest.mark.parametrize("name", ALL)
def test_torchs_signature_defaults_and_checks(name):
    """The installed torch's: its defaults become the param groups' keys and values, its checks raise
    its errors, an unknown keyword is a TypeError, and the sharding options sit beside them."""
    cls, ours = getattr(torch.optim, name), getattr(fused_zero, name)
    p, q = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    theirs = cls([p])
    mine = ours([q], overlap="step")
    assert {k: v for k, v in mine.param_groups[0].items() if k != "params"} == \
        {k: v for k, v in theirs.param_groups[0].items() if k != "params"}
    with pytest.raises(ValueError) as torch_error:
        cls([p], lr=-1.0)
    with pytest.raises(ValueError) as our_error:
        ours([q], lr=-1.0)
    assert str(our_error.value) == str(torch_error.value)
    with pytest.raises(TypeError, match="not_an_option"):
        ours([q], not_an_option=1)


@pytest.mark.parametrize("name", ["LBFGS", "SparseAdam"])
def test_no_twin_says_why(name):
    with pytest.raises(AttributeError, match=f"fused_zero has no {name}: .*(closure|sparse)"):
        getattr(fused_zero, name)
