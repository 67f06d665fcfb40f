"""The update kernels' arithmetic written in plain torch float32, in the kernels' own order of operations:
every product, sum, division and square root a separate, correctly rounded operation, as the kernels
compute them with ``enable_fp_fusion=False``, ``div_rn`` and ``sqrt_rn``. The interpreted kernels must
equal it bit for bit (``torch.equal``); compiled for a GPU, so must they (tests/gpu).

It reads the same Segments rows and coefficient table as the kernels and updates the same flat
buffers in place; elements of no row are never touched.

Square roots are taken in float64 and rounded to float32, which is the correctly rounded float32
square root (53 bits >= 2 x 24 + 2: the double rounding is innocuous): torch's own CPU float32
``sqrt`` is not correctly rounded (694 of 100,000 random values in [0, 1e-3) come out one ulp off,
from its vectorised path), where ``tl.sqrt_rn`` and numpy's are. torch's float32 products, sums and
quotients are IEEE-correct, one rounding each.
"""

from __future__ import annotations

import torch
from fused_zero.kernels import ADAM_COEFS, SGD_COEFS

_A = {name: i for i, name in enumerate(ADAM_COEFS)}
_S = {name: i for i, name in enumerate(SGD_COEFS)}


def _index(rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per element of every row: its shard, parameter and gradient index and its parameter id."""
    s, p, g, pid = [], [], [], []
    for so, n, po, go, i in rows:
        s.append(torch.arange(so, so + n))
        p.append(torch.arange(po, po + n))
        g.append(torch.arange(go, go + n))
        pid.append(torch.full((n,), i, dtype=torch.int64))
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64)  # noqa: E731
    return cat(s), cat(p), cat(g), cat(pid)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(x.double()).float()


def _grad(c, cols, grad, gi, grad_scale, clip_coef, maximize):
    g = grad[gi].to(torch.float32)
    g = g / c[:, cols["grad_div"]]
    if grad_scale is not None:
        g = g / grad_scale.to(torch.float32)
    if clip_coef is not None:
        g = g * clip_coef.to(torch.float32)
    return -g if maximize else g


def _select(rows, coefs, found_inf):
    """The rows' elements that the kernel updates: active parameters, and none when found_inf is set."""
    if found_inf is not None and float(found_inf.reshape(-1)[0]) != 0:
        return None
    si, pi, gi, pid = (t.to(coefs.device) for t in _index(rows))
    keep = coefs[pid, 0] != 0
    return si[keep], pi[keep], gi[keep], coefs[pid[keep]]


def _store_weight(p, param, pi, master, si):
    if master is not None:
        master[si] = p
    param[pi] = p.to(param.dtype)  # round to nearest even, as the kernels' store


def adam(rows, coefs, *, grad, param, exp_avg, exp_avg_sq, master=None, max_exp_avg_sq=None, maximize=False,
         grad_scale=None, found_inf=None, clip_coef=None) -> None:
    picked = _select(rows, coefs, found_inf)
    if picked is None:
        return
    si, pi, gi, c = picked
    col = lambda name: c[:, _A[name]]  # noqa: E731
    g = _grad(c, _A, grad, gi, grad_scale, clip_coef, maximize)
    p = master[si] if master is not None else param[pi].to(torch.float32)
    m, v = exp_avg[si], exp_avg_sq[si]
    p = p * col("decay_mul")
    l2 = col("l2")
    g = torch.where(l2 != 0, g + l2 * p, g)
    w = col("lerp_w")
    diff = g - m
    m = torch.where(w.abs() < 0.5, m + w * diff, g - diff * (1.0 - w))
    v = v * col("beta2") + col("one_minus_beta2") * g * g
    if max_exp_avg_sq is not None:
        vmax = torch.maximum(max_exp_avg_sq[si], v)
        max_exp_avg_sq[si] = vmax
        denom = _sqrt(vmax) / col("bc2_sqrt") + col("eps")
    else:
        denom = _sqrt(v) / col("bc2_sqrt") + col("eps")
    p = p + (col("neg_step_size") * m) / denom
    exp_avg[si] = m
    exp_avg_sq[si] = v
    _store_weight(p, param, pi, master, si)


def sgd(rows, coefs, *, grad, param, momentum_buffer=None, master=None, nesterov=False, maximize=False,
        grad_scale=None, found_inf=None, clip_coef=None) -> None:
    picked = _select(rows, coefs, found_inf)
    if picked is None:
        return
    si, pi, gi, c = picked
    col = lambda name: c[:, _S[name]]  # noqa: E731
    g = _grad(c, _S, grad, gi, grad_scale, clip_coef, maximize)
    p = master[si] if master is not None else param[pi].to(torch.float32)
    wd = col("weight_decay")
    g = torch.where(wd != 0, g + wd * p, g)
    if momentum_buffer is not None:
        buf = torch.where(col("first") != 0, g, momentum_buffer[si] * col("momentum") + col("one_minus_dampening") * g)
        momentum_buffer[si] = buf
        g = g + col("momentum") * buf if nesterov else buf
    p = p + col("neg_lr") * g
    _store_weight(p, param, pi, master, si)
