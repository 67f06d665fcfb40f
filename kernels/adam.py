r"""Fused Adam / AdamW over a flat shard, in one pass over memory.

For every element of every row of a `Segments` table, with ``g`` the gradient as the optimizer sees
it (divided by ``grad_div``, by the loss scale, times the clip coefficient, negated for maximize) and
``p`` the fp32 master weight (or the parameter itself), in torch.optim's single-tensor order:

    AdamW:  p  = p * (1 - lr * weight_decay)
    Adam:   g  = g + weight_decay * p                       (coupled L2, only if weight_decay != 0)
            m  = lerp(m, g, 1 - beta1)                       (torch's two-branch lerp)
            v  = v * beta2 + (1 - beta2) * g * g
            v̂  = max(v̂, v)                                   (amsgrad)
            d  = sqrt(v or v̂) / sqrt(1 - beta2^t) + eps
            p  = p + (-lr / (1 - beta1^t)) * m / d
            param = round_to_param_dtype(p)                  (when p is a master copy)

Every scalar above is computed on the host in float64 and rounded to float32, exactly as torch
rounds Python scalars when it calls its elementwise kernels; `adam_coefficients` builds them, one row
per parameter, so parameters with different step counts (skipped while unused) or param groups share
one launch, and a learning rate that changes every step is just new table contents: no recompilation,
no host sync.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ._common import (
    BLOCK,
    FP_FUSION,
    NUM_WARPS,
    SCALAR_BLOCK,
    VEC,
    check_coefs,
    check_flat,
    check_moments,
    check_scalar,
    check_stochastic,
    grid,
    load_grad,
    load_weight,
    open_row,
    row_is_vector,
    store_weight,
)
from .codecs import load_moment, store_moment
from .segments import Segments

ADAM_COEFS = ("active", "grad_div", "decay_mul", "l2", "lerp_w", "beta2", "one_minus_beta2",
              "bc2_sqrt", "eps", "neg_step_size", "sr_key")
N_ADAM_COEFS = len(ADAM_COEFS)


@triton.jit
def _adam_kernel(
    rows_ptr,            # int64 [n_rows, 8] Segments table
    coef_ptr,            # fp32 [n_params, N_COEF] per-parameter scalars (ADAM_COEFS)
    grad_ptr,            # gradient buffer (fp32/bf16/fp16), indexed by grad_off
    master_ptr,          # fp32 master shard, indexed by shard_off (unused without HAS_MASTER)
    param_ptr,           # parameter buffer (fp32/bf16/fp16), indexed by param_off
    exp_avg_ptr,         # shard in the MOMENTS format
    exp_avg_sq_ptr,      # shard in the MOMENTS format
    max_exp_avg_sq_ptr,  # shard in the MOMENTS format (unused without AMSGRAD)
    exp_avg_scale_ptr,   # fp32 per row (block) of the table: 8-bit moments' scales (MOMENTS == INT8)
    exp_avg_sq_scale_ptr,
    max_exp_avg_sq_scale_ptr,
    grad_scale_ptr,      # one-element loss scale the gradient is divided by (HAS_GRAD_SCALE)
    found_inf_ptr,       # one-element flag; non-zero means write nothing (HAS_FOUND_INF)
    clip_coef_ptr,       # one-element factor the gradient is multiplied by (HAS_CLIP)
    N_COEF: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    PARAM_BF16: tl.constexpr,
    MOMENTS: tl.constexpr,     # FP32, BF16 or INT8 (codecs.py)
    STOCHASTIC: tl.constexpr,  # bf16 parameter without a master, rounded stochastically
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALAR_BLOCK: tl.constexpr,
):
    # the same elementwise code twice: 16-byte accesses on aligned rows, scalar ones on the rest
    if row_is_vector(rows_ptr):
        c, n, s_off, p_off, g_off, row = open_row(rows_ptr, coef_ptr, found_inf_ptr, N_COEF, HAS_FOUND_INF, True,
                                                  VEC)
        idx = tl.arange(0, BLOCK)
        _adam_elements(c, n, idx < n, s_off + idx, p_off + idx, g_off + idx, row, idx, grad_ptr, master_ptr,
                       param_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, exp_avg_scale_ptr,
                       exp_avg_sq_scale_ptr, max_exp_avg_sq_scale_ptr, grad_scale_ptr, clip_coef_ptr,
                       HAS_MASTER, AMSGRAD, MAXIMIZE, HAS_GRAD_SCALE, HAS_CLIP, PARAM_BF16, MOMENTS, STOCHASTIC)
    else:
        c, n, s_off, p_off, g_off, row = open_row(rows_ptr, coef_ptr, found_inf_ptr, N_COEF, HAS_FOUND_INF, False,
                                                  VEC)
        lane = tl.arange(0, SCALAR_BLOCK)  # a scalar row fits one block (segments.SCALAR_BLOCK);
        # a name of its own: Triton wants one type per name across the branches
        _adam_elements(c, n, lane < n, s_off + lane, p_off + lane, g_off + lane, row, lane, grad_ptr, master_ptr,
                       param_ptr, exp_avg_ptr, exp_avg_sq_ptr, max_exp_avg_sq_ptr, exp_avg_scale_ptr,
                       exp_avg_sq_scale_ptr, max_exp_avg_sq_scale_ptr, grad_scale_ptr, clip_coef_ptr,
                       HAS_MASTER, AMSGRAD, MAXIMIZE, HAS_GRAD_SCALE, HAS_CLIP, PARAM_BF16, MOMENTS, STOCHASTIC)


@triton.jit
def _adam_elements(c, n, mask, s_offs, p_offs, g_offs, row, lanes, grad_ptr, master_ptr, param_ptr, exp_avg_ptr,
                   exp_avg_sq_ptr, max_exp_avg_sq_ptr, exp_avg_scale_ptr, exp_avg_sq_scale_ptr,
                   max_exp_avg_sq_scale_ptr, grad_scale_ptr, clip_coef_ptr,
                   HAS_MASTER: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
                   HAS_GRAD_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, PARAM_BF16: tl.constexpr,
                   MOMENTS: tl.constexpr, STOCHASTIC: tl.constexpr):
    grad_div = tl.load(c + 1)
    decay_mul = tl.load(c + 2)
    l2 = tl.load(c + 3)
    lerp_w = tl.load(c + 4)
    beta2 = tl.load(c + 5)
    one_minus_beta2 = tl.load(c + 6)
    bc2_sqrt = tl.load(c + 7)
    eps = tl.load(c + 8)
    neg_step_size = tl.load(c + 9)
    if MOMENTS == 2:
        block = tl.load(row + 7)  # this row is one 8-bit block: its scales sit at its row number
    else:
        block = 0

    g = load_grad(grad_ptr, g_offs, mask, grad_div, grad_scale_ptr, clip_coef_ptr,
                  HAS_GRAD_SCALE, HAS_CLIP, MAXIMIZE)
    p = load_weight(master_ptr, param_ptr, s_offs, p_offs, mask, HAS_MASTER)
    m = load_moment(exp_avg_ptr, exp_avg_scale_ptr, block, s_offs, mask, MOMENTS, True)
    v = load_moment(exp_avg_sq_ptr, exp_avg_sq_scale_ptr, block, s_offs, mask, MOMENTS, False)

    p = p * decay_mul
    g = tl.where(l2 != 0.0, g + l2 * p, g)
    # torch's lerp: start + w * (end - start) for |w| < 0.5, else end - (end - start) * (1 - w)
    diff = g - m
    m = tl.where(tl.abs(lerp_w) < 0.5, m + lerp_w * diff, g - diff * (1.0 - lerp_w))
    v = v * beta2 + one_minus_beta2 * g * g
    if AMSGRAD:
        vmax = tl.maximum(load_moment(max_exp_avg_sq_ptr, max_exp_avg_sq_scale_ptr, block, s_offs, mask, MOMENTS,
                                      False), v, propagate_nan=tl.PropagateNan.ALL)  # as torch.maximum
        store_moment(max_exp_avg_sq_ptr, max_exp_avg_sq_scale_ptr, block, s_offs, vmax, mask, n, MOMENTS, False)
        denom = tl.div_rn(tl.sqrt_rn(vmax), bc2_sqrt) + eps
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)

    store_moment(exp_avg_ptr, exp_avg_scale_ptr, block, s_offs, m, mask, n, MOMENTS, True)
    store_moment(exp_avg_sq_ptr, exp_avg_sq_scale_ptr, block, s_offs, v, mask, n, MOMENTS, False)
    store_weight(master_ptr, param_ptr, s_offs, p_offs, p, mask, c + 10, row, lanes, HAS_MASTER, PARAM_BF16,
                 STOCHASTIC)


def adam_coefficients(*, lr, beta1, beta2, eps, weight_decay, step, decoupled: bool,
                      grad_div=1.0, active=True, sr_key=0) -> torch.Tensor:
    """Per-parameter scalars for `adam_step`, as a float32 ``[n_params, N_ADAM_COEFS]`` CPU tensor.

    Every argument is a scalar or a sequence with one entry per parameter. ``step`` is the step count
    *after* this update (1 on the first step), as torch.optim's ``state["step"]`` reads once
    incremented. ``active=False`` rows are skipped entirely (a parameter with no gradient).
    ``sr_key``: each parameter's 32-bit stochastic-rounding key of this step (codecs.sr_key), kept as
    the bits of its float32 column.
    """
    lr, beta1, beta2, eps, wd, step, grad_div, active = np.broadcast_arrays(
        *(np.asarray(x, dtype=np.float64) for x in
          (lr, beta1, beta2, eps, weight_decay, step, grad_div, active)))
    if np.any((active != 0) & (step < 1)):
        raise ValueError("step must be >= 1 for active parameters (it counts this update)")
    bias_correction1 = 1 - np.power(beta1, step)
    bias_correction2 = 1 - np.power(beta2, step)
    with np.errstate(divide="ignore", invalid="ignore"):
        step_size = np.where(active != 0, lr / bias_correction1, 0.0)
    cols = np.stack([
        (active != 0).astype(np.float64),
        grad_div,
        np.where(decoupled, 1 - lr * wd, 1.0),
        np.where(decoupled, 0.0, wd),
        1 - beta1,
        beta2,
        1 - beta2,
        np.power(np.where(active != 0, bias_correction2, 1.0), 0.5),
        eps,
        -step_size,
        np.zeros_like(eps),
    ], axis=-1).reshape(-1, N_ADAM_COEFS).astype(np.float32)
    cols[:, -1] = np.broadcast_to(np.asarray(sr_key, dtype=np.int64) & 0xFFFFFFFF, cols.shape[:1]) \
        .astype(np.uint32).view(np.float32)
    return torch.from_numpy(cols)


def adam_step(
    segments: Segments,
    coefs: torch.Tensor,
    *,
    grad: torch.Tensor,
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    master: torch.Tensor | None = None,
    max_exp_avg_sq: torch.Tensor | None = None,
    scales: dict[str, torch.Tensor] | None = None,
    stochastic: bool = False,
    maximize: bool = False,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    clip_coef: torch.Tensor | None = None,
) -> None:
    """One Adam/AdamW update of every row of ``segments``, in place, in one launch.

    ``master`` (fp32, shard-indexed) is read and written when given, and the parameter is written
    from it; without it the parameter itself is read and written. ``max_exp_avg_sq`` turns on
    amsgrad. Coupled vs decoupled weight decay is in ``coefs`` (see `adam_coefficients`).
    The moments' dtype is their format (codecs.py): float32, bfloat16, or uint8 codes with
    ``scales`` (``{"exp_avg": ..., "exp_avg_sq": ..., "max_exp_avg_sq": ...}``, fp32, one per row of
    ``segments``). ``stochastic``: a bf16 ``param`` without ``master``, rounded stochastically with
    the keys of ``coefs``' sr_key column.
    """
    device = exp_avg.device
    check_flat("grad", grad, device)
    check_flat("param", param, device)
    check_flat("master", master, device, dtypes=(torch.float32,))
    moments = check_moments({"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "max_exp_avg_sq": max_exp_avg_sq},
                            scales, segments, device)
    check_stochastic(stochastic, param, master)
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf), ("clip_coef", clip_coef)):
        check_scalar(name, t, device)
    check_coefs(coefs, N_ADAM_COEFS, segments, device)
    shard = min(t.numel() for t in (exp_avg, exp_avg_sq, master, max_exp_avg_sq) if t is not None)
    segments.check(shard=shard, param=param.numel(), grad=grad.numel(), coefs=coefs.shape[0])
    if segments.n_rows == 0:
        return
    scale = (scales or {}).get
    _adam_kernel[grid(segments)](
        segments.rows, coefs, grad,
        master if master is not None else coefs,
        param, exp_avg, exp_avg_sq,
        max_exp_avg_sq if max_exp_avg_sq is not None else exp_avg,
        scale("exp_avg", coefs), scale("exp_avg_sq", coefs), scale("max_exp_avg_sq", coefs),
        grad_scale if grad_scale is not None else coefs,
        found_inf if found_inf is not None else coefs,
        clip_coef if clip_coef is not None else coefs,
        N_COEF=N_ADAM_COEFS,
        HAS_MASTER=master is not None,
        AMSGRAD=max_exp_avg_sq is not None,
        MAXIMIZE=maximize,
        HAS_GRAD_SCALE=grad_scale is not None,
        HAS_FOUND_INF=found_inf is not None,
        HAS_CLIP=clip_coef is not None,
        PARAM_BF16=param.dtype == torch.bfloat16,
        MOMENTS=moments,
        STOCHASTIC=stochastic,
        VEC=VEC,
        BLOCK=BLOCK,
        SCALAR_BLOCK=SCALAR_BLOCK,
        num_warps=NUM_WARPS,
        enable_fp_fusion=FP_FUSION,
    )
