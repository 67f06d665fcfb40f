"""Sum of squares and non-finite count of a shard's gradients, for global-norm clipping and overflow
detection.

Each program writes its own partial (no atomics), and the partials are summed by torch: the result
is deterministic, so every rank that all-reduces it sees the same clip coefficient. Non-finite values
are counted separately because finite gradients above ~1.8e19 overflow the fp32 sum of squares
without being an overflow of the loss scale.
"""

from __future__ import annotations

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
    check_scalar,
    grid,
    open_row,
    row_is_vector,
)
from .segments import Segments


@triton.jit
def _grad_sumsq_kernel(
    rows_ptr,            # int64 [n_rows, 8] Segments table
    coef_ptr,            # fp32 [n_params, N_COEF]; column 0 active, column 1 grad_div
    grad_ptr,            # gradient buffer, indexed by grad_off
    grad_scale_ptr,      # one-element loss scale (HAS_GRAD_SCALE)
    out_ptr,             # fp32 [n_rows, 2]: sum of squares, non-finite count
    N_COEF: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    SCALAR_BLOCK: tl.constexpr,
):
    # 16-byte loads on aligned rows, scalar ones on the rest (see adam.py)
    if row_is_vector(rows_ptr):
        c, n, _, _, g_off, _ = open_row(rows_ptr, coef_ptr, coef_ptr, N_COEF, False, True, VEC)
        idx = tl.arange(0, BLOCK)
        sumsq, bad = _grad_sumsq_elements(c, idx < n, g_off + idx, grad_ptr, grad_scale_ptr, HAS_GRAD_SCALE)
    else:
        c, n, _, _, g_off, _ = open_row(rows_ptr, coef_ptr, coef_ptr, N_COEF, False, False, VEC)
        lane = tl.arange(0, SCALAR_BLOCK)  # a scalar row fits one block (segments.SCALAR_BLOCK);
        # a name of its own: Triton wants one type per name across the branches
        sumsq, bad = _grad_sumsq_elements(c, lane < n, g_off + lane, grad_ptr, grad_scale_ptr, HAS_GRAD_SCALE)
    row = tl.program_id(0).to(tl.int64)
    tl.store(out_ptr + row * 2, sumsq)
    tl.store(out_ptr + row * 2 + 1, bad)


@triton.jit
def _grad_sumsq_elements(c, mask, g_offs, grad_ptr, grad_scale_ptr, HAS_GRAD_SCALE: tl.constexpr):
    grad_div = tl.load(c + 1)
    g = tl.load(grad_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.div_rn(g, grad_div)
    if HAS_GRAD_SCALE:
        g = tl.div_rn(g, tl.load(grad_scale_ptr).to(tl.float32))
    finite = (g == g) & (tl.abs(g) != float("inf"))
    return tl.sum(tl.where(finite, g * g, 0.0), axis=0), tl.sum(tl.where(mask & ~finite, 1.0, 0.0), axis=0)


def grad_sumsq(
    segments: Segments,
    coefs: torch.Tensor,
    *,
    grad: torch.Tensor,
    grad_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(sum of squares of the finite gradients, number of non-finite ones)``.

    Both are fp32 0-dim tensors on the gradient's device (views of ``out``, a float32 ``[2]``, where
    given); nothing is copied to the host. ``coefs`` is the same per-parameter table the update uses
    (only its ``active`` and ``grad_div`` columns are read), so the norm is that of the gradient the
    update will see. ``partials``: the per-row sums' buffer, float32 ``[max(n_rows, 1), 2]`` (made
    here if not given): with both given, nothing is allocated, as a CUDA graph's capture wants.
    """
    device = grad.device
    check_flat("grad", grad, device)
    check_scalar("grad_scale", grad_scale, device)
    if coefs.dtype != torch.float32 or coefs.dim() != 2 or coefs.shape[1] < 2 or coefs.device != device:
        raise ValueError("coefs must be a float32 [n_params, n_coef] table on the gradient's device")
    check_coefs(coefs, coefs.shape[1], segments, device)
    segments.check(shard=segments.shard_extent, param=segments.param_extent, grad=grad.numel(),
                   coefs=coefs.shape[0])
    shape = (max(segments.n_rows, 1), 2)
    if partials is None:
        partials = torch.zeros(shape, dtype=torch.float32, device=device)
    else:
        if tuple(partials.shape) != shape or partials.dtype != torch.float32 or partials.device != device:
            raise ValueError(f"partials must be a float32 {list(shape)} tensor on the gradient's device")
        partials.zero_()
    if out is not None and (tuple(out.shape) != (2,) or out.dtype != torch.float32 or out.device != device):
        raise ValueError("out must be a float32 [2] tensor on the gradient's device")
    if segments.n_rows:
        _grad_sumsq_kernel[grid(segments)](
            segments.rows, coefs, grad,
            grad_scale if grad_scale is not None else coefs,
            partials,
            N_COEF=coefs.shape[1],
            HAS_GRAD_SCALE=grad_scale is not None,
            VEC=VEC,
            BLOCK=BLOCK,
            SCALAR_BLOCK=SCALAR_BLOCK,
            num_warps=NUM_WARPS,
            enable_fp_fusion=FP_FUSION,
        )
    total = torch.sum(partials, dim=0, out=out)
    return total[0], total[1]
