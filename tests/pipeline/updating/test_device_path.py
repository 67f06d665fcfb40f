"""torch.optim's twins and Adafactor on their CUDA path, modeled on the CPU: the engine under the
stream-order checker (fused_zero.testing.streamcheck) takes the path it takes where the device runs
later than the host, on which the host reads no flag, count or norm of the device
(algorithms/elementwise.py, algorithms/adafactor.py's ``device_step``, pipeline/updating/whole_params.py).

Each optimizer at 2 gloo ranks in every overlap mode x both reductions, with two param groups and an lr
schedule, a branch only some ranks use on some steps (``find_unused_parameters``: parameters without a
gradient, on one rank or on all), a non-finite loss on rank 0 at step 3 (the step skipped on every
rank: by the GradScaler where the mode takes one, else by ``on_nonfinite="skip"``), and once with bf16
parameters over fp32 masters; Adagrad with ``fused=True`` and with ``foreach=True``. Against DDP +
torch.optim.<Name> on the same data, in the form whose step
counts live on the device as ours do: ``capturable=True`` (Adagrad, which has no capturable path:
``fused=True``); Adafactor against its plain form. Every parameter of every rank after every step, and
the state dict at the end: bit for bit (bf16: the parity harness's ulp bounds); Adafactor within the
non-exact tolerance (its device scalars round twice where torch's round once, algorithms/adafactor.py).

And the checker: no hazard, and no host synchronization of fused_zero's on the step path of any
iteration (before the device path: 14 per iteration for most of the twins, 76 for NAdam and ASGD, 26 to
32 for Adafactor, in these runs' bucket layout; docs/optimizers.md tables them).
"""

from __future__ import annotations

import collections
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from scenarios import (
    VOCAB,
    Case,
    OddNet,
    _compare_low,
    _compare_state,
    batch,
    constructor_kwargs,
    param_groups,
    use_branch,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.optimizer import TWINS
from fused_zero.testing.streamcheck import StreamChecker

DEVICE = torch.device("cpu")  # the checker's device memory (a torch.device; "cpu" the string is the host)
MODES = list(itertools.product(("bucket", "backward", "step"), ("reduce_scatter", "all_reduce")))
ALL = (*TWINS, "Adafactor")
STEPS = 6
INF_STEP = 3


def oracle(name: str) -> dict:
    """torch.optim.<name>'s flags for the form whose step counts stay on the device."""
    if name == "Adafactor":
        return {}
    if name == "Adagrad":
        return {"fused": True}
    return {"capturable": True}


def _train(rank: int, world: int, name: str, overlap: str, reduce: str, dtype: torch.dtype,
           kwargs: dict | None = None) -> dict:
    case = Case(opt=name, groups=2, graph="find_unused", dtype=dtype, kwargs=kwargs or {})
    scaled = overlap != "bucket"
    with StreamChecker("nccl") as checker:
        torch.manual_seed(1234)
        model, ref = OddNet().to(DEVICE, dtype), OddNet().to(DEVICE, dtype)
        ref.load_state_dict(model.state_dict())
        masters = [p.detach().float().requires_grad_(True) for p in ref.parameters()] if dtype != torch.float32 \
            else list(ref.parameters())
        ddp_kw = dict(bucket_cap_mb=0.0001, find_unused_parameters=True)
        ddp, ref_ddp = DDP(model, **ddp_kw), DDP(ref, **ddp_kw)
        scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaled else None for _ in range(2)]
        opt = getattr(fused_zero, name)(param_groups(model, case), **constructor_kwargs(name, case), ddp=ddp,
                                        overlap=overlap, grad_reduce=reduce, grad_scaler=scalers[0])
        ref_groups = param_groups(ref, case)
        index = {id(p): i for i, p in enumerate(ref.parameters())}
        for g in ref_groups:
            g["params"] = [masters[index[id(p)]] for p in g["params"]]
            for flag in ("foreach", "fused"):  # the oracle's form is ``oracle(name)``'s, whatever ours is told
                g.pop(flag, None)
        ref_opt = getattr(torch.optim, name)(ref_groups, **constructor_kwargs(name, case), **oracle(name))
        lr0 = [g["lr"] for g in opt.param_groups]
        try:
            for step in range(1, STEPS + 1):
                checker.phase = f"step {step}"
                for o in (opt, ref_opt):
                    for g, base in zip(o.param_groups, lr0):
                        g["lr"] = base * (1.0 + 0.5 * math.cos(step))
                for d, o, scaler in ((ref_ddp, ref_opt, scalers[1]), (ddp, opt, scalers[0])):
                    x, y = (t.to(DEVICE) for t in batch(step, 0, rank))
                    logits = d(x, use_branch=use_branch(case, step, rank))
                    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
                    if step == INF_STEP and rank == 0:  # the rank whose forward uses the branch then
                        loss = loss * float("inf")
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                    if o is ref_opt:
                        _reference_step(ref, masters, ref_opt, scaler)
                    elif scaler is not None:
                        scaler.step(o)
                        scaler.update()
                    else:
                        o.step()
                    o.zero_grad()
                opt.synchronize()
                for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
                    _same(p.detach().float(), q.detach().float(), f"rank {rank} step {step} {pname}", name, dtype)
            checker.phase = "state dict"  # compared on the host, as a user reads it: not modeled
            with checker.paused():
                _compare_state(opt, ref_opt, rank, exact=name != "Adafactor" and dtype == torch.float32)
            skipped = opt.skipped_steps
        finally:
            opt._engine.close()
    syncs = [s for s in checker.syncs if s[2].startswith("step ") and s[3]]
    return dict(syncs=dict(collections.Counter(s[2] for s in syncs)), first_syncs=syncs[:3],
                hazards=[str(h) for h in checker.hazards()][:3], skipped=skipped,
                scales=[s.get_scale() for s in scalers if s is not None])


def _reference_step(ref, masters, ref_opt, scaler) -> None:
    """DDP + torch.optim's step: on fp32 masters of bf16 parameters; a step whose gradients are not finite
    skipped, as fused_zero's ``on_nonfinite="skip"`` does without a scaler (the scaler skips it itself)."""
    params = list(ref.parameters())
    if masters is not params:
        for p, m in zip(params, masters):
            m.grad = None if p.grad is None else p.grad.float()
    if scaler is not None:
        scaler.step(ref_opt)
        scaler.update()
    elif all(bool(torch.isfinite(m.grad).all()) for m in masters if m.grad is not None):
        ref_opt.step()
    if masters is not params:
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        for p, m in zip(params, masters):
            p.grad = m.grad = None


def _same(a: torch.Tensor, b: torch.Tensor, where: str, name: str, dtype: torch.dtype) -> None:
    if dtype != torch.float32:
        _compare_low(a, b, where, dtype)
    elif name == "Adafactor":
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=lambda m: f"{where}: {m}")
    else:
        assert torch.equal(a, b), f"{where}: not bit-identical, largest difference {(a - b).abs().max():.3e}"


def _cases():
    out = [(name, o, r, torch.float32) for name in ALL for o, r in MODES]
    bf16_modes = itertools.cycle(MODES)
    out += [(name, *next(bf16_modes), torch.bfloat16) for name in ALL]
    # torch's fused Adagrad takes device counts, which the twin hands it whatever the group says (before: the
    # host's counts, which the CUDA kernel reads as device pointers)
    return out + [("Adagrad", "step", "reduce_scatter", torch.float32, {"fused": True}),
                  ("Adagrad", "bucket", "all_reduce", torch.float32, {"foreach": True})]


def _run_all(rank: int, world: int, cases) -> list:
    return [_train(rank, world, *case) for case in cases]


@pytest.fixture(scope="module")
def results():
    cases = _cases()
    return cases, run_ranks(_run_all, 2, cases)


def test_every_optimizer_in_every_mode_matches_torch_optim_on_the_device_path(results):
    """Bit for bit against torch.optim's device-count form (Adafactor: within 2e-5), the skip included:
    one skipped step, on every rank, and the scalers halved alike."""
    cases, ranks = results
    for case, rank0, rank1 in zip(cases, *ranks):
        for seen in (rank0, rank1):
            assert seen["skipped"] == 1, (case, seen)
            ours, ref = seen["scales"] or (None, None)
            assert ours == ref, (case, seen["scales"])


def test_no_host_synchronization_and_no_hazard_on_the_device_path(results):
    cases, ranks = results
    for case, *seen in zip(cases, *ranks):
        for rank, s in enumerate(seen):
            assert not s["syncs"], (case, rank, s["syncs"], s["first_syncs"])
            assert not s["hazards"], (case, rank, s["hazards"])
