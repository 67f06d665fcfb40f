"""One update launch per step and dtype in overlap modes "backward" and "step" (arena.py), one per
bucket in "bucket" mode, with parity against DDP + torch.optim through both backends, every step:
before the buckets are stable (one launch per bucket), across the move into the arenas, and after."""

import pytest
import torch
from distributed import run_ranks
from scenarios import Case, _compare, _reference_step, build, loss_of

from fused_zero.pipeline.buckets.arena import BucketGrads

TINY = 0.0001  # one bucket per parameter or so


def _launches_per_step(case: Case, rank: int, world: int) -> dict:
    model, ddp, opt, ref_model, ref_ddp, ref_opt, masters = build(case, rank)
    engine = opt._engine
    calls = []
    algo = engine.members[0].algo
    update = algo.apply

    def counted(*args, **kwargs):
        calls[-1] += 1
        return update(*args, **kwargs)

    algo.apply = counted
    worst = 0.0
    buckets = []
    for step in range(1, case.steps + 1):
        loss_of(ref_ddp, case, step, 0, rank).backward()
        _reference_step(ref_model, ref_opt, masters, case)
        calls.append(0)
        loss_of(ddp, case, step, 0, rank).backward()
        buckets.append(engine.iteration.invoked)
        opt.step()
        opt.zero_grad()
        worst = max(worst, _compare(model, ref_model, case, step, rank))
    engine.close()
    return {"launches": calls, "buckets": buckets, "worst": worst,
            "dtypes": len({p.dtype for p in model.parameters() if p.requires_grad}),
            "arenas": len(engine.single_launch.arenas) if engine.single_launch else 0}


def _cases(rank: int, world: int, cases: list[Case]) -> list[dict]:
    return [_launches_per_step(c, rank, world) for c in cases]


def _check(results: list[list[dict]], cases: list[Case]) -> None:
    for rank_results in results:
        for case, r in zip(cases, rank_results):
            name = case.name()
            assert r["buckets"][-1] > 2, name  # many buckets: one launch per step is a real merge
            if case.overlap == "bucket":
                assert r["launches"][-1] == r["buckets"][-1] and r["arenas"] == 0, name
            else:
                assert r["launches"][0] == r["buckets"][0], name  # before the arenas: per bucket
                assert r["launches"][-3:] == [r["dtypes"]] * 3 and r["arenas"] == r["dtypes"], (name, r)


def test_one_launch_per_step_torch_backend():
    cases = [Case(overlap=o, grad_reduce=r, bucket_cap_mb=TINY, steps=10, groups=2)
             for o, r in (("step", "reduce_scatter"), ("backward", "all_reduce"), ("bucket", "reduce_scatter"))]
    cases += [Case(overlap="step", dtype=torch.bfloat16, fp32_branch=True, bucket_cap_mb=TINY, steps=10,
                   max_grad_norm=0.05),
              Case(overlap="backward", graph="find_unused", bucket_cap_mb=TINY, steps=10, opt="SGD")]
    _check(run_ranks(_cases, 2, cases), cases)


def test_one_launch_per_step_triton_backend():
    cases = [Case(backend="triton", overlap="step", bucket_cap_mb=TINY, steps=7, groups=2, max_grad_norm=0.05),
             Case(backend="triton", overlap="backward", dtype=torch.bfloat16, fp32_branch=True,
                  graph="find_unused", bucket_cap_mb=TINY, steps=7, opt="Adam", kwargs={"amsgrad": True})]
    _check(run_ranks(_cases, 2, cases), cases)


def test_bucket_grads_never_cross_a_bucket():
    a, b = torch.arange(4.0), torch.arange(10.0, 13.0)
    grads = BucketGrads([a, b], [0, 5])
    assert torch.equal(grads[1:3], a[1:3]) and torch.equal(grads[5:8], b)
    with pytest.raises(IndexError):
        grads[3:6]
