r"""Fused SGD (momentum, dampening, nesterov, weight decay, maximize) over a flat shard.

In torch.optim's single-tensor order, with ``g`` the gradient as the optimizer sees it:

    g   = g + weight_decay * p                  (only if weight_decay != 0)
    buf = g                                      (first step of this parameter)
    buf = buf * momentum + (1 - dampening) * g   (later steps)
    g   = g + momentum * buf  if nesterov  else  buf
    p   = p + (-lr) * g

The per-parameter scalars come from `sgd_coefficients`; ``first`` marks parameters whose momentum
buffer does not exist yet (torch creates it from the gradient on their first step).
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

SGD_COEFS = ("active", "grad_div", "weight_decay", "momentum", "one_minus_dampening", "neg_lr", "first", "sr_key")
N_SGD_COEFS = len(SGD_COEFS)


@triton.jit
def _sgd_kernel(
    rows_ptr,            # int64 [n_rows, 8] Segments table
    coef_ptr,            # fp32 [n_params, N_COEF] per-parameter scalars (SGD_COEFS)
    grad_ptr,            # gradient buffer, indexed by grad_off
    master_ptr,          # fp32 master shard, indexed by shard_off (unused without HAS_MASTER)
    param_ptr,           # parameter buffer, indexed by param_off
    momentum_buf_ptr,    # shard in the MOMENTS format (unused without HAS_MOMENTUM)
    momentum_scale_ptr,  # fp32 per row (block): 8-bit momentum's scales (MOMENTS == INT8)
    grad_scale_ptr,      # one-element loss scale (HAS_GRAD_SCALE)
    found_inf_ptr,       # one-element flag; non-zero means write nothing (HAS_FOUND_INF)
    clip_coef_ptr,       # one-element clip factor (HAS_CLIP)
    N_COEF: tl.constexpr,
    HAS_MASTER: tl.constexpr,
    HAS_MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
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
        _sgd_elements(c, n, idx < n, s_off + idx, p_off + idx, g_off + idx, row, idx, grad_ptr, master_ptr,
                      param_ptr, momentum_buf_ptr, momentum_scale_ptr, grad_scale_ptr, clip_coef_ptr, HAS_MASTER,
                      HAS_MOMENTUM, NESTEROV, MAXIMIZE, HAS_GRAD_SCALE, HAS_CLIP, PARAM_BF16, MOMENTS, STOCHASTIC)
    else:
        c, n, s_off, p_off, g_off, row = open_row(rows_ptr, coef_ptr, found_inf_ptr, N_COEF, HAS_FOUND_INF, False,
                                                  VEC)
        lane = tl.arange(0, SCALAR_BLOCK)  # a scalar row fits one block (segments.SCALAR_BLOCK);
        # a name of its own: Triton wants one type per name across the branches
        _sgd_elements(c, n, lane < n, s_off + lane, p_off + lane, g_off + lane, row, lane, grad_ptr, master_ptr,
                      param_ptr, momentum_buf_ptr, momentum_scale_ptr, grad_scale_ptr, clip_coef_ptr, HAS_MASTER,
                      HAS_MOMENTUM, NESTEROV, MAXIMIZE, HAS_GRAD_SCALE, HAS_CLIP, PARAM_BF16, MOMENTS, STOCHASTIC)


@triton.jit
def _sgd_elements(c, n, mask, s_offs, p_offs, g_offs, row, lanes, grad_ptr, master_ptr, param_ptr, momentum_buf_ptr,
                  momentum_scale_ptr, grad_scale_ptr, clip_coef_ptr, HAS_MASTER: tl.constexpr,
                  HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
                  HAS_GRAD_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, PARAM_BF16: tl.constexpr,
                  MOMENTS: tl.constexpr, STOCHASTIC: tl.constexpr):
    grad_div = tl.load(c + 1)
    weight_decay = tl.load(c + 2)
    momentum = tl.load(c + 3)
    one_minus_dampening = tl.load(c + 4)
    neg_lr = tl.load(c + 5)
    first = tl.load(c + 6)

    g = load_grad(grad_ptr, g_offs, mask, grad_div, grad_scale_ptr, clip_coef_ptr,
                  HAS_GRAD_SCALE, HAS_CLIP, MAXIMIZE)
    p = load_weight(master_ptr, param_ptr, s_offs, p_offs, mask, HAS_MASTER)

    g = tl.where(weight_decay != 0.0, g + weight_decay * p, g)
    if HAS_MOMENTUM:
        if MOMENTS == 2:
            block = tl.load(row + 7)  # this row is one 8-bit block: its scale sits at its row number
        else:
            block = 0
        buf = load_moment(momentum_buf_ptr, momentum_scale_ptr, block, s_offs, mask, MOMENTS, True)
        buf = tl.where(first != 0.0, g, buf * momentum + one_minus_dampening * g)
        store_moment(momentum_buf_ptr, momentum_scale_ptr, block, s_offs, buf, mask, n, MOMENTS, True)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    p = p + neg_lr * g
    store_weight(master_ptr, param_ptr, s_offs, p_offs, p, mask, c + 7, row, lanes, HAS_MASTER, PARAM_BF16,
                 STOCHASTIC)


def sgd_coefficients(*, lr, momentum, dampening, weight_decay, first,
                     grad_div=1.0, active=True, sr_key=0) -> torch.Tensor:
    """Per-parameter scalars for `sgd_step`, as a float32 ``[n_params, N_SGD_COEFS]`` CPU tensor.

    Every argument is a scalar or a sequence with one entry per parameter; ``first`` is true where the
    momentum buffer is created by this step; ``sr_key`` as in adam_coefficients.
    """
    lr, momentum, dampening, wd, first, grad_div, active = np.broadcast_arrays(
        *(np.asarray(x, dtype=np.float64) for x in
          (lr, momentum, dampening, weight_decay, first, grad_div, active)))
    cols = np.stack([
        (active != 0).astype(np.float64), grad_div, wd, momentum, 1 - dampening, -lr,
        (first != 0).astype(np.float64), np.zeros_like(lr),
    ], axis=-1).reshape(-1, N_SGD_COEFS).astype(np.float32)
    cols[:, -1] = np.broadcast_to(np.asarray(sr_key, dtype=np.int64) & 0xFFFFFFFF, cols.shape[:1]) \
        .astype(np.uint32).view(np.float32)
    return torch.from_numpy(cols)


def sgd_step(
    segments: Segments,
    coefs: torch.Tensor,
    *,
    grad: torch.Tensor,
    param: torch.Tensor,
    momentum_buffer: torch.Tensor | None = None,
    master: torch.Tensor | None = None,
    scales: dict[str, torch.Tensor] | None = None,
    stochastic: bool = False,
    nesterov: bool = False,
    maximize: bool = False,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    clip_coef: torch.Tensor | None = None,
) -> None:
    """One SGD update of every row of ``segments``, in place, in one launch.

    Without ``momentum_buffer`` the update is plain SGD (torch's ``momentum=0``); ``nesterov`` needs it.
    ``momentum_buffer``'s dtype is its format, ``scales``/``stochastic`` as in adam_step.
    """
    device = param.device
    check_flat("grad", grad, device)
    check_flat("param", param, device)
    check_flat("master", master, device, dtypes=(torch.float32,))
    moments = check_moments({"momentum_buffer": momentum_buffer}, scales, segments, device)
    check_stochastic(stochastic, param, master)
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf), ("clip_coef", clip_coef)):
        check_scalar(name, t, device)
    if nesterov and momentum_buffer is None:
        raise ValueError("nesterov needs a momentum_buffer (torch: momentum > 0)")
    check_coefs(coefs, N_SGD_COEFS, segments, device)
    # Plain SGD without master weights reads no shard at all.
    shards = [t.numel() for t in (momentum_buffer, master) if t is not None]
    segments.check(shard=min(shards) if shards else segments.shard_extent, param=param.numel(),
                   grad=grad.numel(), coefs=coefs.shape[0])
    if segments.n_rows == 0:
        return
    _sgd_kernel[grid(segments)](
        segments.rows, coefs, grad,
        master if master is not None else coefs,
        param,
        momentum_buffer if momentum_buffer is not None else coefs,
        (scales or {}).get("momentum_buffer", coefs),
        grad_scale if grad_scale is not None else coefs,
        found_inf if found_inf is not None else coefs,
        clip_coef if clip_coef is not None else coefs,
        N_COEF=N_SGD_COEFS,
        HAS_MASTER=master is not None,
        HAS_MOMENTUM=momentum_buffer is not None,
        NESTEROV=nesterov,
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
