"""Pieces shared by the update kernels: dtype rules, argument checks and two jit helpers."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .segments import BLOCK, Segments

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# triton.jit decides between compiling and interpreting when the kernels are defined, at import
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
NUM_WARPS = 8


@triton.jit
def load_row(rows_ptr, row):
    """One row of a Segments table: (shard_off, length, param_off, grad_off, pid)."""
    base = rows_ptr + row * 5
    return (
        tl.load(base + 0),
        tl.load(base + 1),
        tl.load(base + 2),
        tl.load(base + 3),
        tl.load(base + 4),
    )


@triton.jit
def open_row(rows_ptr, coef_ptr, found_inf_ptr, N_COEF: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
             BLOCK: tl.constexpr):
    """This program's row: its coefficient-row pointer, element mask and shard/param/grad offsets.

    An inactive parameter (coefficient 0 is zero), or a found inf, shrinks the row to nothing: no
    element is read or written.
    """
    row = tl.program_id(0).to(tl.int64)
    shard_off, n, param_off, grad_off, pid = load_row(rows_ptr, row)
    c = coef_ptr + pid * N_COEF
    n = tl.where(tl.load(c) != 0, n, 0)
    if HAS_FOUND_INF:
        n = tl.where(tl.load(found_inf_ptr) == 0, n, 0)
    idx = tl.arange(0, BLOCK)
    return c, idx < n, shard_off + idx, param_off + idx, grad_off + idx


@triton.jit
def load_weight(master_ptr, param_ptr, s_offs, p_offs, mask, HAS_MASTER: tl.constexpr):
    """The fp32 weight the update works on: the master copy, or the parameter itself."""
    if HAS_MASTER:
        p = tl.load(master_ptr + s_offs, mask=mask, other=0.0)
    else:
        p = tl.load(param_ptr + p_offs, mask=mask, other=0.0).to(tl.float32)
    return p


@triton.jit
def store_weight(master_ptr, param_ptr, s_offs, p_offs, p, mask, HAS_MASTER: tl.constexpr,
                 PARAM_BF16: tl.constexpr):
    """Write the updated weight: to the master copy if there is one, and to the parameter."""
    if HAS_MASTER:
        tl.store(master_ptr + s_offs, p, mask=mask)
    store_param(param_ptr, p_offs, p, mask, PARAM_BF16)


@triton.jit
def load_grad(grad_ptr, offs, mask, grad_div, grad_scale_ptr, clip_coef_ptr,
              HAS_GRAD_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, MAXIMIZE: tl.constexpr):
    """The gradient as the optimizer sees it: averaged, unscaled, clipped, negated for maximize.

    Divisions use round-to-nearest (``div_rn``) to match torch; on the GPU Triton's ``/`` is approximate.
    """
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.div_rn(g, grad_div)
    if HAS_GRAD_SCALE:
        g = tl.div_rn(g, tl.load(grad_scale_ptr).to(tl.float32))
    if HAS_CLIP:
        g = g * tl.load(clip_coef_ptr).to(tl.float32)
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def store_param(param_ptr, offs, value, mask, PARAM_BF16: tl.constexpr):
    """Store fp32 ``value`` in the parameter's dtype, rounding to nearest even like torch.

    bf16 is rounded by hand: the Triton interpreter truncates fp32 -> bf16, and the same integer
    recipe on the GPU is what the hardware's round-to-nearest-even produces.
    """
    if PARAM_BF16:
        bits = value.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(value != value, 0x7FC0, rounded)
        out = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        tl.store(param_ptr + offs, out, mask=mask)
    else:
        tl.store(param_ptr + offs, value.to(param_ptr.dtype.element_ty), mask=mask)


def check_flat(name: str, t: torch.Tensor | None, device: torch.device, dtypes=FLOAT_DTYPES) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the other buffers on {device}; move it")
    if t.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {names}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")


def check_scalar(name: str, t: torch.Tensor | None, device: torch.device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.device != device:
        raise ValueError(f"{name} must be a one-element tensor on {device}")


def check_coefs(coefs: torch.Tensor, n_coef: int, segments: Segments, device: torch.device) -> None:
    if device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("the Triton kernels run on CPU tensors only through Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before fused_zero.kernels is first imported")
    if not isinstance(coefs, torch.Tensor) or coefs.dtype != torch.float32 or coefs.dim() != 2 \
            or coefs.shape[1] != n_coef or not coefs.is_contiguous():
        got = (coefs.dtype, tuple(coefs.shape)) if isinstance(coefs, torch.Tensor) else type(coefs)
        raise ValueError(f"coefs must be a contiguous float32 [n_params, {n_coef}] tensor, got {got}")
    if coefs.device != device:
        raise ValueError(f"coefs is on {coefs.device}, the buffers on {device}; move it")
    if segments.rows.device != device:
        raise ValueError(f"segments live on {segments.rows.device}, the buffers on {device}; rebuild them")


def grid(segments: Segments) -> tuple[int]:
    return (segments.n_rows,)


__all__ = ["BLOCK", "NUM_WARPS", "FLOAT_DTYPES", "load_row", "open_row", "load_weight", "store_weight",
           "load_grad", "store_param", "check_flat", "check_scalar", "check_coefs", "grid"]
