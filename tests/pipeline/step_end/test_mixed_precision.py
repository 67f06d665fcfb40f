"""torch.amp.GradScaler, non-finite gradients, max_grad_norm in backward mode and a user's
clip_grad_norm_, against DDP + torch.optim (see amp_scenarios.py)."""


import pytest
import torch
from amp_scenarios import POSITIONS, AmpCase, run_amp_case, run_amp_cases, run_user_clip
from distributed import run_ranks
from expect import raises
from scenarios import OddNet, batch
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

CASES_2 = [
    AmpCase(overlap="step"),
    AmpCase(overlap="backward"),
    AmpCase(overlap="backward", dtype=BF16, grad_reduce="all_reduce", max_grad_norm=0.05),
    AmpCase(overlap="step", dtype=F32, as_view=False),
    # no scaler: non-finite steps skipped (or raised) on every rank, in every mode
    AmpCase(overlap="step", dtype=F32, scaler=False),
    AmpCase(overlap="backward", dtype=BF16, scaler=False, on_nonfinite="raise"),
    AmpCase(overlap="bucket", dtype=F32, scaler=False, inject_all=True),
    AmpCase(overlap="bucket", dtype=BF16, scaler=False, inject_all=True, on_nonfinite="raise",
            grad_reduce="all_reduce"),
    # clipping in backward mode, no scaler, nothing injected
    AmpCase(overlap="backward", dtype=F32, scaler=False, inject=(), max_grad_norm=0.05),
]


def _check(results, cases):
    for per_rank in zip(*results):
        assert len({repr(r) for r in per_rank}) == 1, per_rank  # every rank: same skips, scales, raises
        (name, r), case = per_rank[0], cases[[c.name() for c in cases].index(per_rank[0][0])]
        assert r["skipped"] == r["ref_skipped"] >= len(case.inject), (name, r)
        assert r["raised"] == (list(case.inject) if case.on_nonfinite == "raise" else []), (name, r)
        assert r["scaler_passes"] == 0, name  # GradScaler's own pass over param.grad was avoided
        if case.scaler and case.inject:  # the scale halved at each injected step
            assert r["scales"][case.inject[0] - 1] == r["scales"][case.inject[0] - 2] / 2, (name, r)


def test_parity_two_ranks():
    _check(run_ranks(run_amp_cases, 2, CASES_2), CASES_2)


# bucket mode checks and skips each bucket on its own: one poisoned bucket (on one rank) at each
# position, the rest of the step goes on (on the CPU the last two buckets are updated in one call)
BUCKET_CASES = [AmpCase(overlap="bucket", dtype=F32, scaler=False, bucket=at, bucket_cap_mb=0.0001)
                for at in POSITIONS]


def test_one_non_finite_bucket_skips_itself_alone():
    _check(run_ranks(run_amp_cases, 2, BUCKET_CASES), BUCKET_CASES)


def _detected(rank, world, case):
    try:
        run_amp_case(case, rank, world)
    except AssertionError as e:
        return str(e).splitlines()[0]
    return None


@pytest.mark.parametrize("how", ["skip", "double"])
def test_bf16_check_catches_a_wrong_step_of_one_parameter(how):
    """The 16-bit comparison is tight enough to see one LayerNorm weight's step skipped (or applied
    twice) at step 8 of 10: near 1, a bf16 ulp is about one Adam step, which rtol=2**-6 let pass."""
    case = AmpCase(overlap="step", dtype=BF16, scaler=False, inject=(), breaks=(how, 8, "norm.weight"))
    found = run_ranks(_detected, 2, case)
    assert all(f is not None and "step 8 norm.weight" in f for f in found), found


CASES_4 = [AmpCase(overlap="backward", inject=(2,), steps=4)]
CASES_1 = [AmpCase(overlap="backward"), AmpCase(overlap="step", dtype=BF16)]


def test_parity_four_ranks():
    _check(run_ranks(run_amp_cases, 4, CASES_4), CASES_4)


def test_user_clip_grad_norm_is_honored_or_refused_on_every_rank():
    results = run_ranks(run_user_clip, 2)
    assert results[0] == results[1]
    r = results[0]
    assert all(r[f"honored-view{v}-scaler{s}"] for v in (0, 1) for s in (0, 1))
    # the error points at max_grad_norm; step mode skipped the step, the others had already updated
    assert r["step-reduce_scatter"] == (True, True)
    assert r["backward-reduce_scatter"] == (True, False)
    assert r["bucket-all_reduce"] == (True, False)
    # a bare scaler.unscale_ (no version counter moves): honored, or refused pointing at max_grad_norm
    assert r["bare-unscale-honored-view1"] and r["bare-unscale-honored-view0"]
    assert r["bare-unscale-step-reduce_scatter"] is True




def scaler_misuse(rank, world):
    out = []

    def build(**kw):
        torch.manual_seed(0)
        model = OddNet()
        model.never.requires_grad_(False)
        ddp = DDP(model)
        return ddp, (lambda: fused_zero.AdamW(ddp.parameters(), ddp=ddp, _backend="torch", **kw))

    scaler = torch.amp.GradScaler("cpu")
    x, _ = batch(0, 0, rank)
    out.append(raises(build(grad_scaler=scaler, overlap="bucket")[1], ValueError,
                      "grad_scaler needs overlap='backward' or overlap='step'"))
    out.append(raises(build(grad_scaler="yes", overlap="step")[1], TypeError, "torch.amp.GradScaler"))
    out.append(raises(build(on_nonfinite="warn")[1], ValueError, "on_nonfinite"))
    build(max_grad_norm=1.0, overlap="backward")[1]()  # accepted now
    ddp, make = build(overlap="step")
    opt = make()
    scaler.scale(ddp(x, use_branch=True).sum()).backward()
    out.append(raises(lambda: scaler.step(opt), RuntimeError, "grad_scaler=scaler"))
    ddp, make = build(overlap="backward", grad_scaler=scaler)
    opt = make()
    scaler.scale(ddp(x, use_branch=True).sum()).backward()
    out.append(raises(opt.step, RuntimeError, r"scaler.step\(optimizer\)"))
    return out, run_amp_cases(rank, world, CASES_1)


def test_scaler_misuse_is_a_clear_error_and_one_rank_parity():
    errors, results = run_ranks(scaler_misuse, 1)[0]
    assert len(errors) == 5
    _check([results], CASES_1)
