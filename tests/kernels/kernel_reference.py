"""The update kernels' arithmetic written in plain torch float32, in the kernels' own order of operations:
every product, sum, division and square root a separate, correctly rounded operation, as the kernels
compute them with ``enable_fp_fusion=False``, ``div_rn`` and ``sqrt_rn``. The interpreted kernels must
equal it bit for bit (``torch.equal``); compiled for a GPU, so must they (tests/gpu).

It reads the same Segments rows and coefficient table as the kernels and updates the same flat
buffers in place; elements of no row are never touched. The storage formats (kernels/codecs.py) are
written here from their definition, with float arithmetic (frexp, ldexp, round half to even), not
with the kernels' integer recipes: two formulations of one format, which must agree bit for bit.

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


def _index(rows):
    """Per element of every row of the table (``kernels.row_table``): its shard, parameter and gradient
    index, parameter id, index in its parameter, and row (block) number."""
    cols = [[] for _ in range(6)]
    for so, n, po, go, i, elem, _, block in rows.tolist():
        for col, start in zip(cols, (so, po, go, None, elem, None)):
            col.append(torch.arange(start, start + n) if start is not None else None)
        cols[3][-1] = torch.full((n,), i, dtype=torch.int64)
        cols[5][-1] = torch.full((n,), block, dtype=torch.int64)
    return [torch.cat(c) if c else torch.zeros(0, dtype=torch.int64) for c in cols]


# ---------------------------------------------------------------------- formats, from their definition

def decode8(code: torch.Tensor, signed: bool) -> torch.Tensor:
    c = code.to(torch.int64)
    e = (c >> 3) & 15 if signed else c >> 3
    f = (c & 7) / 8.0
    value = torch.ldexp(1.0 + f.to(torch.float32), (e - (15 if signed else 31)).to(torch.int32))
    value = torch.where(e == 0, torch.zeros_like(value), value)
    return torch.where((c >> 7) == 1, -value, value) if signed else value


def encode8(y: torch.Tensor, signed: bool) -> torch.Tensor:
    """Nearest code (ties to even), for ``y`` in [-1, 1]: 1 + fraction rounded to 3 bits."""
    bits = 3
    m, ex = torch.frexp(y.abs())  # |y| = m 2^ex, m in [0.5, 1)
    frac = torch.round((2 * m.double() - 1) * 2 ** bits)  # half to even
    carry = frac == 2 ** bits
    e = ex.to(torch.int64) - 1 + (15 if signed else 31) + carry.to(torch.int64)
    frac = torch.where(carry, torch.zeros_like(frac), frac).to(torch.int64)
    under = (e < 1) | (y == 0)
    code = (e << bits) | frac
    if signed:
        code = torch.where(under, torch.zeros_like(code), code | ((y < 0).to(torch.int64) << 7))
    else:
        code = torch.where(under, torch.where(y != 0, torch.full_like(code, 8), torch.zeros_like(code)), code)
    return code.to(torch.uint8)


def _load_moment(t, scales, si, block, signed):
    if t.dtype == torch.float32:
        return t[si]
    if t.dtype == torch.bfloat16:
        return t[si].float()
    return decode8(t[si], signed) * scales[block]


def _store_moment(t, scales, si, block, x, signed):
    if t.dtype == torch.float32:
        t[si] = x
    elif t.dtype == torch.bfloat16:
        t[si] = x.to(torch.bfloat16)  # round to nearest even
    else:
        s = torch.zeros(scales.numel(), device=x.device).scatter_reduce_(0, block, x.abs(), "amax",
                                                                         include_self=False)
        touched = torch.zeros(scales.numel(), dtype=torch.bool, device=x.device)
        touched[block] = True
        scales[touched] = s[touched]
        per = s[block]
        y = torch.where(per > 0, x / torch.where(per > 0, per, torch.ones_like(per)), torch.zeros_like(x))
        t[si] = encode8(y, signed)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def round_stochastic(p: torch.Tensor, key: torch.Tensor, elem: torch.Tensor) -> torch.Tensor:
    """bf16 by stochastic rounding: the fp32 value plus 16 hashed random bits under bf16's last bit,
    truncated."""
    noise = _mix32(key ^ ((elem * 0x9E3779B9) & 0xFFFFFFFF)) >> 16
    bits = p.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = ((bits + noise) >> 16).to(torch.int32).to(torch.int16)
    out = torch.where(p != p, torch.full_like(out, 0x7FC0), out)
    return out.view(torch.bfloat16)


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
    """The rows' elements that the kernel updates (active parameters; none when found_inf is set) and
    their parameter id, index in the parameter and block."""
    if found_inf is not None and float(found_inf.reshape(-1)[0]) != 0:
        return None
    si, pi, gi, pid, elem, block = (t.to(coefs.device) for t in _index(rows))
    keep = coefs[pid, 0] != 0
    return si[keep], pi[keep], gi[keep], coefs[pid[keep]], elem[keep], block[keep]


def _store_weight(p, param, pi, master, si, stochastic=False, key=None, elem=None):
    if master is not None:
        master[si] = p
    if stochastic:
        param[pi] = round_stochastic(p, key, elem)
    else:
        param[pi] = p.to(param.dtype)  # round to nearest even, as the kernels' store


def _key(c, col):
    return c[:, col].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def adam(rows, coefs, *, grad, param, exp_avg, exp_avg_sq, master=None, max_exp_avg_sq=None, scales=None,
         stochastic=False, maximize=False, grad_scale=None, found_inf=None, clip_coef=None) -> None:
    picked = _select(rows, coefs, found_inf)
    if picked is None:
        return
    si, pi, gi, c, elem, block = picked
    sc = (scales or {}).get
    col = lambda name: c[:, _A[name]]  # noqa: E731
    g = _grad(c, _A, grad, gi, grad_scale, clip_coef, maximize)
    p = master[si] if master is not None else param[pi].to(torch.float32)
    m = _load_moment(exp_avg, sc("exp_avg"), si, block, True)
    v = _load_moment(exp_avg_sq, sc("exp_avg_sq"), si, block, False)
    p = p * col("decay_mul")
    l2 = col("l2")
    g = torch.where(l2 != 0, g + l2 * p, g)
    w = col("lerp_w")
    diff = g - m
    m = torch.where(w.abs() < 0.5, m + w * diff, g - diff * (1.0 - w))
    v = v * col("beta2") + col("one_minus_beta2") * g * g
    if max_exp_avg_sq is not None:
        vmax = torch.maximum(_load_moment(max_exp_avg_sq, sc("max_exp_avg_sq"), si, block, False), v)
        _store_moment(max_exp_avg_sq, sc("max_exp_avg_sq"), si, block, vmax, False)
        denom = _sqrt(vmax) / col("bc2_sqrt") + col("eps")
    else:
        denom = _sqrt(v) / col("bc2_sqrt") + col("eps")
    p = p + (col("neg_step_size") * m) / denom
    _store_moment(exp_avg, sc("exp_avg"), si, block, m, True)
    _store_moment(exp_avg_sq, sc("exp_avg_sq"), si, block, v, False)
    _store_weight(p, param, pi, master, si, stochastic, _key(c, _A["sr_key"]), elem)


def sgd(rows, coefs, *, grad, param, momentum_buffer=None, master=None, scales=None, stochastic=False,
        nesterov=False, maximize=False, grad_scale=None, found_inf=None, clip_coef=None) -> None:
    picked = _select(rows, coefs, found_inf)
    if picked is None:
        return
    si, pi, gi, c, elem, block = picked
    col = lambda name: c[:, _S[name]]  # noqa: E731
    g = _grad(c, _S, grad, gi, grad_scale, clip_coef, maximize)
    p = master[si] if master is not None else param[pi].to(torch.float32)
    wd = col("weight_decay")
    g = torch.where(wd != 0, g + wd * p, g)
    if momentum_buffer is not None:
        scale = (scales or {}).get("momentum_buffer")
        old = _load_moment(momentum_buffer, scale, si, block, True)
        buf = torch.where(col("first") != 0, g, old * col("momentum") + col("one_minus_dampening") * g)
        _store_moment(momentum_buffer, scale, si, block, buf, True)
        g = g + col("momentum") * buf if nesterov else buf
    p = p + col("neg_lr") * g
    _store_weight(p, param, pi, master, si, stochastic, _key(c, _S["sr_key"]), elem)
