"""Pieces shared by the update kernels: dtype rules, argument checks, launch settings and jit helpers."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .codecs import BF16, FP32, INT8, round_stochastic_bits, to_bf16_bits
from .segments import BLOCK, BLOCK_INDEX, COLUMNS, SCALAR_BLOCK, VEC, VECTOR, Segments

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# triton.jit decides between compiling and interpreting when the kernels are defined, at import
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
NUM_WARPS = 8
assert SCALAR_BLOCK == 32 * NUM_WARPS  # a scalar row is one element per thread (segments.py)
"""The scalar path's block has a shape of its own (SCALAR_BLOCK, not BLOCK), so Triton lays its tensors
out apart from the vector path's (with one shape, it spread the vector path's 4-per-thread layout to
the scalar loads and converted through shared memory before every store)."""


FP_FUSION = False
"""Passed as ``enable_fp_fusion`` to every launch. Without fusion the GPU rounds every product and sum
as written, which is what the interpreter (IEEE numpy) computes, so the kernels' CI tests check the
GPU's arithmetic; torch's CUDA kernels fuse some multiply-adds, hence a last-bit tolerance against
torch.optim on the GPU (docs/kernels.md). Triton 3.10 changes the implicit default; this is explicit."""


assert len(COLUMNS) == 8 and VECTOR == 6 and BLOCK_INDEX == 7  # the row layout the jit code below reads


@triton.jit
def row_is_vector(rows_ptr):
    """Whether this program's row of a Segments table is on the aligned vector path."""
    return tl.load(rows_ptr + tl.program_id(0).to(tl.int64) * 8 + 6) != 0


@triton.jit
def open_row(rows_ptr, coef_ptr, found_inf_ptr, N_COEF: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
             VECTOR: tl.constexpr, VEC: tl.constexpr):
    """This program's row: its coefficient-row pointer, its element count, its shard/param/grad
    offsets, and a pointer to the row itself (``elem`` at +5, ``block`` at +7, read where needed).

    An inactive parameter (coefficient 0 is zero), or a found inf, shrinks the row to nothing: no
    element is read or written.

    On a ``VECTOR`` row (see segments.py) the three offsets and the length are multiples of ``VEC``.
    Saying so lets Triton prove each thread's run of elements 16-byte aligned and its mask uniform,
    the two conditions of a vector access. ``tl.multiple_of`` marks the op that *defines* a value, not
    its use, so the hinted values are loads of their own, made on the vector path only: hints on shared
    loads would also reach the scalar path's unaligned rows.
    """
    base = rows_ptr + tl.program_id(0).to(tl.int64) * 8
    shard_off = tl.load(base + 0)
    n = tl.load(base + 1)
    param_off = tl.load(base + 2)
    grad_off = tl.load(base + 3)
    c = coef_ptr + tl.load(base + 4) * N_COEF
    n = tl.where(tl.load(c) != 0, n, 0)
    if HAS_FOUND_INF:
        n = tl.where(tl.load(found_inf_ptr) == 0, n, 0)
    if VECTOR:
        shard_off = tl.multiple_of(shard_off, VEC)
        param_off = tl.multiple_of(param_off, VEC)
        grad_off = tl.multiple_of(grad_off, VEC)
        n = tl.multiple_of(n, VEC)
    return c, n, shard_off, param_off, grad_off, base


@triton.jit
def load_weight(master_ptr, param_ptr, s_offs, p_offs, mask, HAS_MASTER: tl.constexpr):
    """The fp32 weight the update works on: the master copy, or the parameter itself."""
    if HAS_MASTER:
        p = tl.load(master_ptr + s_offs, mask=mask, other=0.0)
    else:
        p = tl.load(param_ptr + p_offs, mask=mask, other=0.0).to(tl.float32)
    return p


@triton.jit
def store_weight(master_ptr, param_ptr, s_offs, p_offs, p, mask, key_ptr, row, lanes, HAS_MASTER: tl.constexpr,
                 PARAM_BF16: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Write the updated weight: to the master copy if there is one, and to the parameter (bf16 without
    a master: ``STOCHASTIC`` rounds stochastically, see codecs.py, with the parameter's key of this step
    at ``key_ptr`` in its coefficient row and each element's index from the row's ``elem`` column)."""
    if HAS_MASTER:
        tl.store(master_ptr + s_offs, p, mask=mask)
    if STOCHASTIC:
        key = tl.load(key_ptr).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        elem = tl.load(row + 5) + lanes
        tl.store(param_ptr + p_offs, round_stochastic_bits(p, key, elem).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
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
        tl.store(param_ptr + offs, to_bf16_bits(value).to(tl.bfloat16, bitcast=True), mask=mask)
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


MOMENT_FORMATS = {torch.float32: FP32, torch.bfloat16: BF16, torch.uint8: INT8}
"""A moment tensor's dtype is its storage format (codecs.py): uint8 holds 8-bit codes."""


def check_moments(moments: dict, scales: dict | None, segments: Segments, device: torch.device) -> int:
    """The one storage format of the given moments (None: absent), checked with its 8-bit scales."""
    present = {name: t for name, t in moments.items() if t is not None}
    formats = set()
    for name, t in present.items():
        check_flat(name, t, device, dtypes=tuple(MOMENT_FORMATS))
        formats.add(MOMENT_FORMATS[t.dtype])
    if len(formats) > 1:
        dtypes = sorted(str(t.dtype) for t in present.values())
        raise ValueError(f"the moments must share one storage format, got {dtypes}")
    fmt = formats.pop() if formats else FP32
    if fmt == INT8:
        for name in present:
            scale = (scales or {}).get(name)
            if scale is None:
                raise ValueError(f"8-bit (uint8) {name} needs its scales: scales={{{name!r}: fp32 tensor}}")
            check_flat(f"scales[{name!r}]", scale, device, dtypes=(torch.float32,))
            if scale.numel() < segments.n_rows:
                raise ValueError(f"scales[{name!r}] has {scale.numel()} entries, the table {segments.n_rows} "
                                 "rows (one scale per row: 8-bit blocks are rows)")
    elif scales:
        raise ValueError("scales are for 8-bit (uint8) moments only")
    return fmt


def check_stochastic(stochastic: bool, param: torch.Tensor, master: torch.Tensor | None) -> None:
    if stochastic and (param.dtype != torch.bfloat16 or master is not None):
        raise ValueError("stochastic rounding writes bf16 parameters that have no fp32 master: pass a bf16 "
                         f"param and no master (got {param.dtype}{' and a master' if master is not None else ''})")


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


__all__ = ["BLOCK", "VEC", "FP_FUSION", "NUM_WARPS", "FLOAT_DTYPES", "MOMENT_FORMATS", "SCALAR_BLOCK", "row_is_vector",
           "open_row", "load_weight", "store_weight", "load_grad", "store_param", "check_flat", "check_moments",
           "check_scalar", "check_stochastic", "check_coefs", "grid"]
