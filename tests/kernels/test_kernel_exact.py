"""The interpreted kernels against their exact reference (kernel_reference.py: plain torch float32 in the
kernels' order of operations): every buffer equal bit for bit after every step, for every variant and
flag, on rows with ragged ends in every space. The comparison with torch.optim itself stays in
test_kernels.py (to 1e-6: torch's vectorised CPU ops fuse some multiply-adds, the kernels never do).

And the comparison is sharp: one ulp more or less in any coefficient of the table (the learning rate
in the step size, a bias correction, a beta, eps, ...) makes it fail.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_reference import adam, sgd

from fused_zero.kernels import (
    ADAM_COEFS,
    SGD_COEFS,
    Segments,
    adam_coefficients,
    adam_step,
    row_table,
    sgd_coefficients,
    sgd_step,
    sr_key,
)

SIZES = (1, 7, 1000, 4099, 33, 2050, 5)
GROUP = (0, 1, 0, 1, 1, 0, 0)
LR, WD = (1e-2, 3e-3), (0.1, 0.0)
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _pieces(shifts=(1, 5, 9), world=2):
    """Rows of every rank's slice, the shard, parameter and gradient spaces each shifted (agreeing
    modulo 4: aligned middles with ragged ends), slices cut mid-parameter."""
    starts = [sum(SIZES[:i]) for i in range(len(SIZES))]
    total = sum(SIZES)
    per = -(-total // world)
    out = []
    for r in range(world):
        lo, hi = r * per, min((r + 1) * per, total)
        for pid, (start, n) in enumerate(zip(starts, SIZES)):
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                out.append((a + shifts[0], b - a, a + shifts[1], a + shifts[2], pid, a - start))
    return out, total + max(shifts) + 8


MOMENT_DTYPES = {"fp32": F32, "bf16": BF16, "int8": torch.uint8}


def _setup(kind, param_dtype, grad_dtype, master, flags, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, n = _pieces()
    param = torch.randn(n, generator=g) * 0.5
    param[::11] = 0.0  # where eps decides the step (gradients there ~1e-8, see run)
    param = param.to(param_dtype)
    dtype = MOMENT_DTYPES[flags.get("moments", "fp32")]
    names = (["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if flags.get("amsgrad") else [])) if kind == "adam" \
        else (["momentum_buffer"] if flags.get("momentum") else [])
    state = {name: torch.zeros(n, dtype=dtype) for name in names}
    if dtype == torch.uint8:  # one scale per row of the table
        n_rows = row_table(rows).shape[0]
        state.update({f"{name}:scale": torch.zeros(n_rows) for name in names})
    if master:
        state["master"] = param.float()
    return rows, n, param, state, g


def _coefs(kind, flags, step, active):
    lrs = [LR[GROUP[i]] * (1 + 0.1 * step) for i in range(len(SIZES))]
    wds = [WD[GROUP[i]] for i in range(len(SIZES))]
    keys = [sr_key(7, step, i) for i in range(len(SIZES))] if flags.get("sr") else 0
    if kind == "adam":
        return adam_coefficients(lr=lrs, beta1=flags.get("beta1", 0.9), beta2=0.999, eps=1e-8, weight_decay=wds,
                                 step=step, decoupled=flags.get("decoupled", True), grad_div=flags.get("div", 1.0),
                                 active=active, sr_key=keys)
    return sgd_coefficients(lr=lrs, momentum=flags.get("momentum", 0.0), dampening=flags.get("dampening", 0.0),
                            weight_decay=wds, first=step == 1, grad_div=flags.get("div", 1.0), active=active,
                            sr_key=keys)


def _launch(fn, kind, rows, coefs, grad, param, state, flags, extra, segments=None):
    scales = {k.split(":")[0]: v for k, v in state.items() if k.endswith(":scale")} or None
    names = dict(master=state.get("master"), maximize=flags.get("maximize", False), scales=scales,
                 stochastic=flags.get("sr", False), **extra)
    if kind == "adam":
        args = dict(exp_avg=state["exp_avg"], exp_avg_sq=state["exp_avg_sq"],
                    max_exp_avg_sq=state.get("max_exp_avg_sq"), **names)
    else:
        args = dict(momentum_buffer=state.get("momentum_buffer"), nesterov=flags.get("nesterov", False), **names)
    fn(segments if segments is not None else row_table(rows), coefs, grad=grad, param=param, **args)


def run(kind, param_dtype, grad_dtype, master, flags, steps=5, perturb=None, device="cpu"):
    """Kernel and reference side by side; the first difference found as text, or None.
    ``perturb``: a coefficient column the kernel gets one ulp larger (the reference does not).
    ``device``: "cuda" runs the compiled kernels against the same reference (tests/gpu)."""
    rows, n, param, state, g = _setup(kind, param_dtype, grad_dtype, master, flags)
    param, state = param.to(device), {k: v.to(device) for k, v in state.items()}
    theirs = (param.clone(), {k: v.clone() for k, v in state.items()})
    segments = Segments.build(rows, device)
    kernel, reference = (adam_step, adam) if kind == "adam" else (sgd_step, sgd)
    for step in range(1, steps + 1):
        grad = torch.randn(n, generator=g) * (1 + step)
        grad[::7] = 0.0  # no gradient at all: the step is zero
        grad[::11] = torch.randn(len(grad[::11]), generator=g) * 1e-8  # sqrt(v) / bc2 ~ eps
        grad = grad.to(grad_dtype).to(device)
        active = [i != 5 or step % 2 == 0 for i in range(len(SIZES))]  # one parameter without a gradient
        coefs = _coefs(kind, flags, step, active).to(device)
        mine = coefs.clone()
        if perturb is not None:
            mine[:, perturb] = torch.nextafter(mine[:, perturb], torch.full_like(mine[:, perturb], float("inf")))
        extra = dict(grad_scale=torch.tensor([1024.0], device=device) if flags.get("scale") else None,
                     clip_coef=torch.tensor([0.37], device=device) if flags.get("clip") else None,
                     found_inf=torch.tensor([float(step == flags.get("found_at"))], device=device)
                     if "found_at" in flags else None)
        _launch(kernel, kind, rows, mine, grad, param, state, flags, extra, segments)
        _launch(reference, kind, rows, coefs, grad, theirs[0], theirs[1], flags, extra)
        for name, a, b in [("param", param, theirs[0]), *((k, state[k], theirs[1][k]) for k in state)]:
            if not torch.equal(a, b):
                where = (a != b).nonzero()[0].item()
                return f"step {step} {name}[{where}]: {a[where].item()!r} vs the reference's {b[where].item()!r}"
    return None


ADAM_VARIANTS = [
    (F32, F32, False, {}),
    (F32, F32, False, {"decoupled": False}),  # Adam: coupled L2 decay
    (F32, F32, False, {"amsgrad": True, "maximize": True, "beta1": 0.3}),  # lerp's other branch
    (F32, BF16, False, {"scale": True, "clip": True, "found_at": 3, "div": 2.0}),
    (BF16, BF16, True, {"amsgrad": True}),
    (BF16, F32, True, {"clip": True}),
    (F16, F16, True, {"scale": True, "found_at": 2}),
    (BF16, BF16, False, {}),
    (F16, F16, False, {"maximize": True}),
    (F32, F32, False, {"moments": "bf16"}),
    (BF16, BF16, True, {"moments": "bf16", "amsgrad": True, "scale": True, "found_at": 3}),
    (F32, F32, False, {"moments": "int8"}),
    (F32, BF16, False, {"moments": "int8", "amsgrad": True, "decoupled": False, "clip": True}),
    (BF16, BF16, True, {"moments": "int8", "found_at": 2}),
    (BF16, BF16, False, {"sr": True}),
    (BF16, BF16, False, {"sr": True, "moments": "int8", "amsgrad": True}),
]
SGD_VARIANTS = [
    (F32, F32, False, {}),
    (F32, F32, False, {"momentum": 0.9}),
    (F32, F32, False, {"momentum": 0.9, "dampening": 0.3, "maximize": True}),
    (F32, F16, False, {"momentum": 0.8, "nesterov": True, "scale": True, "clip": True, "found_at": 2}),
    (BF16, BF16, True, {"momentum": 0.9, "nesterov": True}),
    (F16, F32, False, {"momentum": 0.9, "div": 3.0}),
    (F32, F32, False, {"momentum": 0.9, "moments": "bf16"}),
    (BF16, BF16, True, {"momentum": 0.9, "nesterov": True, "moments": "int8"}),
    (BF16, BF16, False, {"momentum": 0.9, "sr": True, "moments": "int8"}),
    (BF16, BF16, False, {"sr": True, "maximize": True}),
]


@pytest.mark.parametrize("param_dtype,grad_dtype,master,flags", ADAM_VARIANTS, ids=str)
def test_adam_equals_its_reference(param_dtype, grad_dtype, master, flags):
    assert run("adam", param_dtype, grad_dtype, master, flags) is None


@pytest.mark.parametrize("param_dtype,grad_dtype,master,flags", SGD_VARIANTS, ids=str)
def test_sgd_equals_its_reference(param_dtype, grad_dtype, master, flags):
    assert run("sgd", param_dtype, grad_dtype, master, flags) is None


# every coefficient but the flags (active, first) and the rounding key (its own test); l2 only means
# something in coupled Adam
ADAM_SHARP = [(c, {"decoupled": c != "l2"}) for c in ADAM_COEFS if c not in ("active", "sr_key")]
SGD_SHARP = [(c, {"momentum": 0.9, "dampening": 0.2}) for c in SGD_COEFS if c not in ("active", "first", "sr_key")]


@pytest.mark.parametrize("kind,column,flags", [("adam", *x) for x in ADAM_SHARP] + [("sgd", *x) for x in SGD_SHARP],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_one_ulp_in_any_coefficient_fails(kind, column, flags):
    names = ADAM_COEFS if kind == "adam" else SGD_COEFS
    found = run(kind, F32, F32, False, flags, steps=2, perturb=names.index(column))
    assert found is not None, f"{kind}: {column} one ulp off went unnoticed"


def test_the_variants_cover_every_flag():
    seen = set(itertools.chain.from_iterable(f for *_, f in ADAM_VARIANTS + SGD_VARIANTS))
    assert {"amsgrad", "maximize", "decoupled", "scale", "clip", "found_at", "momentum", "dampening",
            "nesterov", "beta1", "div", "moments", "sr"} <= seen
