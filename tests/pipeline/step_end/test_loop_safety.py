"""Loops that are legal with DDP + torch.optim and that an update run inside the backward cannot follow
as written: torch.optim's result, or a clear error on every rank before a wrong update stays (see
pipeline/step_end/step_policy.py). On 2 ranks, in every overlap mode x both reductions, against DDP + torch.optim:

- gradient accumulation that syncs every micro-batch (two synced backwards per ``step()``, no
  ``no_sync()``): accumulated by overlap="step" with grad_reduce="all_reduce" (with and without
  gradient_as_bucket_view), refused at the second backward's first bucket elsewhere, with nothing
  of that backward applied;
- a learning rate set between backward and ``step()`` (written, or a scheduler stepped late): taken
  by overlap="step", refused by the others (their update read ``param_groups`` in the backward);
- the default ``overlap="auto"``: "bucket" with nothing else, "backward" with ``max_grad_norm`` (at
  parity with ``clip_grad_norm_``) or a GradScaler; an explicit "bucket" with clipping is refused
  at construction.
"""

import itertools

import torch
import torch.nn.functional as F
from distributed import run_ranks
from expect import refusal
from scenarios import VOCAB, OddNet, batch
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero

MODES = list(itertools.product(("bucket", "backward", "step"), ("reduce_scatter", "all_reduce")))
LR = 1e-2


def _pair(as_view=True, **options):
    """Two copies of one model under DDP (3 buckets): ours with a fused_zero AdamW, and torch.optim's."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = OddNet()
        m.never.requires_grad_(False)
        models.append((m, DDP(m, bucket_cap_mb=0.0015, gradient_as_bucket_view=as_view)))
    (model, ddp), (ref_model, ref_ddp) = models
    opt = fused_zero.AdamW(ddp.parameters(), lr=LR, ddp=ddp, _backend="torch", **options)
    ref_opt = torch.optim.AdamW([p for p in ref_model.parameters() if p.requires_grad], lr=LR, foreach=False)
    return (model, ddp, opt), (ref_model, ref_ddp, ref_opt)


def _backward(ddp, step, micro, rank):
    x, y = batch(step, micro, rank)
    F.cross_entropy(ddp(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1)).backward()


def _max_diff(model, ref_model) -> float:
    return max((a.detach() - b.detach()).abs().max().item() for a, b in zip(model.parameters(), ref_model.parameters()))


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def synced_accumulation(rank, overlap, grad_reduce, as_view=True):
    """Two synced backwards per step for 3 steps: the worst parameter difference to torch.optim, or
    the refusal, and whether the refused backward changed any parameter."""
    (model, ddp, opt), (ref_model, ref_ddp, ref_opt) = _pair(as_view, overlap=overlap, grad_reduce=grad_reduce)
    worst = 0.0
    for step in range(3):
        for micro in range(2):
            _backward(ref_ddp, step, micro, rank)
        ref_opt.step()
        ref_opt.zero_grad()
        _backward(ddp, step, 0, rank)
        opt.synchronize()
        before = _params(model)
        verdict = refusal(lambda s=step: _backward(ddp, s, 1, rank), RuntimeError,
                          r"second synced backward before optimizer.step\(\).*ddp.no_sync\(\).*overlap='step' "
                          r"with grad_reduce='all_reduce'.*Nothing of this backward was reduced or applied")
        if not verdict.startswith("no RuntimeError"):
            opt.synchronize()
            untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            opt._engine.close()
            return {"refused": verdict, "untouched": untouched, "step": step}
        opt.step()
        opt.zero_grad()
        worst = max(worst, _max_diff(model, ref_model))
    opt._engine.close()
    return {"max_diff": worst}


def late_hyperparameters(rank, overlap, grad_reduce, late):
    """The learning rate set between backward and step() (``late``: "write" or "scheduler"), 3 steps."""
    (model, ddp, opt), (ref_model, ref_ddp, ref_opt) = _pair(overlap=overlap, grad_reduce=grad_reduce)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    worst = 0.0
    for step in range(3):
        for d, o, s in ((ref_ddp, ref_opt, ref_sched), (ddp, opt, sched)):
            _backward(d, step, 0, rank)
            if late == "write":
                o.param_groups[0]["lr"] = LR * 0.3 ** (step + 1)
            else:
                s.step()
        verdict = refusal(opt.step, RuntimeError, r"param_groups changed between backward and optimizer.step\(\) "
                                                  r"\(param group 0: lr\).*before the backward.*overlap='step'")
        if not verdict.startswith("no RuntimeError"):
            opt._engine.close()
            return {"refused": verdict, "step": step}
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        worst = max(worst, _max_diff(model, ref_model))
    opt._engine.close()
    return {"max_diff": worst}


def default_overlap(rank):
    """overlap='auto': what it resolves to, and max_grad_norm without overlap= at parity with
    clip_grad_norm_ + torch.optim."""
    out = {}
    (model, ddp, opt), (ref_model, ref_ddp, ref_opt) = _pair(max_grad_norm=0.05)
    out["clip"] = opt._engine.overlap
    worst = 0.0
    for step in range(3):
        _backward(ref_ddp, step, 0, rank)
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        _backward(ddp, step, 0, rank)
        opt.step()
        opt.zero_grad()
        worst = max(worst, _max_diff(model, ref_model))
    out["clip_max_diff"] = worst
    opt._engine.close()
    (_, _, opt), _ = _pair()
    out["nothing"] = opt._engine.overlap
    opt._engine.close()
    (_, _, opt), _ = _pair(grad_scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))
    out["scaler"] = opt._engine.overlap
    opt._engine.close()
    torch.manual_seed(0)
    ddp = DDP(OddNet(), bucket_cap_mb=0.0015, find_unused_parameters=True)
    out["bucket_clip_refused"] = refusal(
        lambda: fused_zero.AdamW(ddp.parameters(), ddp=ddp, overlap="bucket", max_grad_norm=1.0), ValueError,
        r"max_grad_norm needs overlap='backward' or overlap='step' \(got overlap='bucket'\).*Leave overlap out")
    return out


def loops(rank, world):
    out = {}
    for o, r in MODES:
        out[f"accumulate-{o}-{r}"] = synced_accumulation(rank, o, r)
    out["accumulate-step-all_reduce-noview"] = synced_accumulation(rank, "step", "all_reduce", as_view=False)
    for (o, r), late in itertools.product(MODES, ("write", "scheduler")):
        out[f"late-{late}-{o}-{r}"] = late_hyperparameters(rank, o, r, late)
    out["default"] = default_overlap(rank)
    return out


def expected(name: str):
    """What each loop must give: torch.optim's parameters (max_diff 0.0, bit-identical on the CPU path)
    where the mode can follow it, else the refusal at the first step, with nothing of it applied."""
    if name.startswith("accumulate-step-all_reduce") or (name.startswith("late-") and "-step-" in name):
        return {"max_diff": 0.0}
    if name.startswith("accumulate-"):
        return {"refused": "ok", "untouched": True, "step": 0}
    return {"refused": "ok", "step": 0}


def test_loops_torch_optim_allows_are_matched_or_refused_on_every_rank():
    results = run_ranks(loops, 2)
    for r in results:
        wrong = {name: got for name, got in r.items() if name != "default" and got != expected(name)}
        assert not wrong, "; ".join(f"{name}: {got}" for name, got in wrong.items())
        d = r["default"]
        assert (d["clip"], d["nothing"], d["scaler"]) == ("backward", "bucket", "backward"), d
        assert d["clip_max_diff"] < 1e-6, d
        assert d["bucket_clip_refused"] == "ok", d
