"""Mixed-precision scenarios run on every rank: fused_zero next to plain DDP + torch.optim, with loss
scaling, non-finite gradients injected on one rank, and clipping.

The reference is what a user runs without fused_zero: DDP + torch.optim on fp32 master copies (for
fp16/bf16 models) and its own GradScaler, which unscales the masters' gradients, skips a step with an
inf and halves its scale; without a scaler it skips a step whose reduced gradients are not finite,
which is fused_zero's default policy.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from scenarios import VOCAB, OddNet, _broken_update, _check_ranks_agree, _compare_low, batch
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero


@dataclass(frozen=True)
class AmpCase:
    overlap: str = "step"
    grad_reduce: str = "reduce_scatter"
    dtype: torch.dtype = torch.float16
    scaler: bool = True
    inject: tuple[int, ...] = (3, 6)  # steps at which the last rank's gradient turns non-finite
    inject_all: bool = False  # every gradient (the loss) instead of one parameter's
    max_grad_norm: float | None = None
    on_nonfinite: str = "skip"
    as_view: bool = True
    steps: int = 10
    bucket_cap_mb: float = 0.002  # a few buckets
    bucket: str | None = None  # poison one parameter of the bucket there: first, middle, second-to-last, last
    breaks: tuple | None = None  # test of the checks: ("skip" | "double", step, parameter name)
    backend: str = "torch"

    def name(self) -> str:
        return (f"{self.overlap}-{self.grad_reduce}-{str(self.dtype)[6:]}-scaler{int(self.scaler)}"
                f"-inject{self.inject}{'all' if self.inject_all else ''}-clip{self.max_grad_norm}"
                f"-{self.on_nonfinite}-view{int(self.as_view)}{f'-bucket{self.bucket}' if self.bucket else ''}"
                f"{f'-breaks{self.breaks}' if self.breaks else ''}")


POSITIONS = ("first", "middle", "second-to-last", "last")


def _bucket_members(opt) -> list[list[int]]:
    """The optimizer's parameter indices of each DDP bucket, in the order DDP reduces them."""
    registry = opt._engine.registry
    return [list(registry.by_index[i].layout.pids) for i in sorted(i for i in registry.by_index if i >= 0)]


def _target(opt, case) -> int | None:
    """The parameter (optimizer index) to poison: the last rank's gradient of it turns non-finite."""
    if case.bucket is None:
        return None
    buckets = _bucket_members(opt)
    assert len(buckets) >= 4, f"{len(buckets)} buckets: too few for every position"
    at = {"first": 0, "middle": len(buckets) // 2, "second-to-last": len(buckets) - 2, "last": len(buckets) - 1}
    return buckets[at[case.bucket]][0]


def _model(dtype):
    torch.manual_seed(1234)
    model = OddNet().to(dtype)
    model.never.requires_grad_(False)
    return model


def _scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)


def run_amp_case(case: AmpCase, rank: int, world: int) -> dict:
    ddp_kw = dict(bucket_cap_mb=case.bucket_cap_mb, gradient_as_bucket_view=case.as_view)
    model, ref_model = _model(case.dtype), _model(case.dtype)
    ddp, ref_ddp = DDP(model, **ddp_kw), DDP(ref_model, **ddp_kw)
    scaler, ref_scaler = (_scaler(), _scaler()) if case.scaler else (None, None)
    passes = []
    if scaler is not None:  # the scaler's own pass over param.grad must not run
        check = scaler._check_inf_per_device
        scaler._check_inf_per_device = lambda opt: (passes.append(1), check(opt))[1]
    hp = dict(lr=1e-2, weight_decay=0.1)
    opt = fused_zero.AdamW(ddp.parameters(), **hp, ddp=ddp, overlap=case.overlap, grad_reduce=case.grad_reduce,
                           max_grad_norm=case.max_grad_norm, grad_scaler=scaler, on_nonfinite=case.on_nonfinite,
                           _backend="torch")
    ref_params = [p for p in ref_model.parameters() if p.requires_grad]
    masters = ref_params if case.dtype == torch.float32 else \
        [p.detach().float().requires_grad_(True) for p in ref_params]
    ref_opt = torch.optim.AdamW(masters, **hp, foreach=False)

    poison = [False, None]  # poisoning now; the optimizer index of the parameter (None: l1.weight)
    for m in (model, ref_model):
        for pid, p in enumerate(q for q in m.parameters() if q.requires_grad):
            chosen = (lambda pid=pid: pid == poison[1]) if case.bucket else (lambda p=p, m=m: p is m.l1.weight)
            p.register_hook(lambda g, chosen=chosen: g * float("inf") if poison[0] and not case.inject_all
                            and chosen() else g)

    raised, ref_skipped, scales, step = [], 0, [], 0
    broken = _broken_update(case, opt, model, lambda: step) if case.breaks else contextlib.nullcontext()
    broken.__enter__()
    for step in range(1, case.steps + 1):
        poison[0] = step in case.inject and rank == world - 1
        if poison[0]:
            poison[1] = _target(opt, case)
        for which, d in enumerate((ref_ddp, ddp)):
            x, y = batch(step, 0, rank)
            loss = F.cross_entropy(d(x, use_branch=True).float().reshape(-1, VOCAB), y.reshape(-1))
            if poison[0] and case.inject_all:
                loss = loss * float("inf")
            (loss if scaler is None else (ref_scaler, scaler)[which].scale(loss)).backward()
            if which == 0:
                buckets = _bucket_members(opt) if case.overlap == "bucket" and case.scaler is False else None
                ref_skipped += _reference_step(case, ref_params, masters, ref_opt, ref_scaler, buckets)
                continue
            try:
                if scaler is None:
                    opt.step()
                else:
                    scaler.step(opt)
                    scaler.update()
            except FloatingPointError:
                raised.append(step)
            opt.zero_grad()
        _compare(model, ref_model, case, step, rank)
        _check_finite_and_agree(model, opt, step)
        if scaler is not None:
            assert scaler.get_scale() == ref_scaler.get_scale(), (step, scaler.get_scale(), ref_scaler.get_scale())
            scales.append(scaler.get_scale())
    broken.__exit__(None, None, None)
    opt._engine.close()
    return {"skipped": opt.skipped_steps, "ref_skipped": ref_skipped, "raised": raised, "scales": scales,
            "scaler_passes": len(passes)}


def _reference_step(case, params, masters, opt, scaler, buckets=None) -> int:
    """torch.optim's step as users write it; returns 1 when the step was skipped. ``buckets``
    (overlap="bucket", no scaler): a bucket holding a non-finite gradient is skipped alone, as torch.optim
    skips parameters without a gradient (no update, no step counted); the rest steps."""
    if masters is not params:
        for p, m in zip(params, masters):
            m.grad = None if p.grad is None else p.grad.float()
    skipped = 0
    if buckets is not None:
        bad = [b for b in buckets if not all(bool(torch.isfinite(masters[i].grad).all()) for i in b
                                             if masters[i].grad is not None)]
        for b in bad:
            for i in b:
                masters[i].grad = None
        skipped = int(bool(bad))
    if scaler is not None:
        if case.max_grad_norm is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(masters, case.max_grad_norm)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped = int(scaler.get_scale() < before)
    elif all(bool(torch.isfinite(m.grad).all()) for m in masters if m.grad is not None):
        if case.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(masters, case.max_grad_norm)
        opt.step()
    else:
        skipped = 1
    with torch.no_grad():
        if masters is not params:
            for p, m in zip(params, masters):
                p.copy_(m)
    for t in list(params) + list(masters):
        t.grad = None
    return skipped


def _compare(model, ref_model, case, step, rank) -> None:
    """fp32: 2e-5 relative; 16-bit: a few ulps per element and few elements differing at all
    (scenarios._compare_low: a relative tolerance lets a skipped step on values near 1 pass)."""
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        msg = f"{case.name()} rank {rank} step {step} {name}"
        if case.dtype == torch.float32:
            torch.testing.assert_close(p.detach().float(), q.detach().float(), rtol=2e-5, atol=2e-6,
                                       msg=lambda m, msg=msg: f"{msg}: {m}")
        else:
            _compare_low(p.detach().float(), q.detach().float(), msg, case.dtype)


def _check_finite_and_agree(model, opt, step) -> None:
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    assert torch.isfinite(flat).all(), f"step {step}: a non-finite parameter"
    for shard in opt._engine.shards():
        for name in shard.names:
            assert torch.isfinite(shard.values(name)).all(), f"step {step}: non-finite {name}"
    _check_ranks_agree(model, step)


def run_amp_cases(rank: int, world: int, cases: list[AmpCase]) -> list[tuple[str, dict]]:
    return [(c.name(), run_amp_case(c, rank, world)) for c in cases]


def _clip_loop(model, ddp, opt, scaler, rank, steps, ref=None, clip=True):
    """nanoGPT's loop: backward, clip_grad_norm_ (after scaler.unscale_ with a scaler), step.
    ``clip=False`` leaves a bare ``scaler.unscale_``: its fused op divides param.grad in place but
    leaves the version counters as they were."""
    for step in range(1, steps + 1):
        x, y = batch(step, 0, rank)
        loss = F.cross_entropy(ddp(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1))
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        if ref is not None:
            ref(step)


def run_user_clip(rank: int, world: int) -> dict:
    """A user's clip_grad_norm_ between backward and step(): honored where the update reads param.grad
    at step() (overlap="step", grad_reduce="all_reduce"), a clear error on every rank elsewhere."""
    out = {}
    for as_view in (True, False):
        for with_scaler in (False, True):
            model, ref_model = _model(torch.float32), _model(torch.float32)
            ddp = DDP(model, bucket_cap_mb=0.002, gradient_as_bucket_view=as_view)
            ref_ddp = DDP(ref_model, bucket_cap_mb=0.002, gradient_as_bucket_view=as_view)
            scaler, ref_scaler = (_scaler(), _scaler()) if with_scaler else (None, None)
            opt = fused_zero.AdamW(ddp.parameters(), lr=1e-2, ddp=ddp, overlap="step", grad_reduce="all_reduce",
                                   grad_scaler=scaler, _backend="torch")
            ref_opt = torch.optim.AdamW([p for p in ref_model.parameters() if p.requires_grad], lr=1e-2,
                                        foreach=False)
            _clip_loop(ref_model, ref_ddp, ref_opt, ref_scaler, rank, 4)
            _clip_loop(model, ddp, opt, scaler, rank, 4)
            case = AmpCase(dtype=torch.float32)
            _compare(model, ref_model, case, 4, rank)
            _check_finite_and_agree(model, opt, 4)
            opt._engine.close()
            out[f"honored-view{int(as_view)}-scaler{int(with_scaler)}"] = True
    # a bare scaler.unscale_ (SGD: a gradient still carrying the scale would move 1024x too far)
    for as_view in (True, False):
        model, ref_model = _model(torch.float32), _model(torch.float32)
        ddp = DDP(model, bucket_cap_mb=0.002, gradient_as_bucket_view=as_view)
        ref_ddp = DDP(ref_model, bucket_cap_mb=0.002, gradient_as_bucket_view=as_view)
        opt = fused_zero.SGD(ddp.parameters(), lr=0.05, momentum=0.9, ddp=ddp, overlap="step",
                             grad_reduce="all_reduce", grad_scaler=(scaler := _scaler()), _backend="torch")
        ref_opt = torch.optim.SGD([p for p in ref_model.parameters() if p.requires_grad], lr=0.05, momentum=0.9,
                                  foreach=False)
        _clip_loop(ref_model, ref_ddp, ref_opt, _scaler(), rank, 4, clip=False)
        _clip_loop(model, ddp, opt, scaler, rank, 4, clip=False)
        _compare(model, ref_model, AmpCase(dtype=torch.float32), 4, rank)
        opt._engine.close()
        out[f"bare-unscale-honored-view{int(as_view)}"] = True
    model = _model(torch.float32)
    ddp = DDP(model, bucket_cap_mb=0.002)
    opt = fused_zero.SGD(ddp.parameters(), lr=0.05, momentum=0.9, ddp=ddp, overlap="step", grad_scaler=_scaler(),
                         _backend="torch")
    try:
        _clip_loop(model, ddp, opt, opt._engine.scaler.scaler, rank, 1, clip=False)
        out["bare-unscale-step-reduce_scatter"] = "no error"
    except RuntimeError as e:
        out["bare-unscale-step-reduce_scatter"] = "max_grad_norm" in str(e)
    opt._engine.close()
    for overlap, grad_reduce in (("step", "reduce_scatter"), ("backward", "reduce_scatter"),
                                 ("bucket", "all_reduce")):
        model = _model(torch.float32)
        ddp = DDP(model, bucket_cap_mb=0.002)
        opt = fused_zero.AdamW(ddp.parameters(), lr=1e-2, ddp=ddp, overlap=overlap, grad_reduce=grad_reduce,
                               _backend="torch")
        before = [p.detach().clone() for p in model.parameters()]
        try:
            _clip_loop(model, ddp, opt, None, rank, 1)
            out[f"{overlap}-{grad_reduce}"] = "no error"
        except RuntimeError as e:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            out[f"{overlap}-{grad_reduce}"] = ("max_grad_norm" in str(e), unchanged)
        opt._engine.close()
    return out
