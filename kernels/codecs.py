r"""How the kernels store what they keep: optimizer moments in fp32, bf16 or 8 bits, and bf16 weights
rounded to nearest or stochastically. Every recipe here is integer bit arithmetic on the fp32 result,
so the interpreter (numpy) and the GPU compute the same bits, and a plain-torch reference can too
(tests/kernels/kernel_reference.py; the CPU path, fused_zero/algorithms/codecs.py).

**bf16 moments**: the fp32 value rounded to nearest even, as ``tensor.to(torch.bfloat16)`` rounds.

**8-bit moments, block-wise**: one fp32 scale per block, the block's largest magnitude ``s`` (written
by the update that produced the block), and one byte per element: the element divided by ``s`` (so
in [-1, 1]) in a floating-point code of its own, exact to decode, rounded to nearest even to encode:

    signed (exp_avg, momentum):   sign | 4-bit exponent e | 3-bit fraction f   value = +-2^(e-15) (1 + f/8)
    unsigned (exp_avg_sq):        5-bit exponent e | 3-bit fraction f            value = 2^(e-31) (1 + f/8)

with e = 0 meaning 0, at 6.3% relative precision (half a step of the fraction). The second moment
grows as the gradient squared, so it gets twice the binades: 15 below the block's maximum for the
first moment, 31 for the second, the same span of gradient magnitudes (2^15) for both; with 4
exponent bits for the second moment, an element 2^8 times smaller than its block's largest gradient
would sit on the floor, its step shrunk. A value under the smallest binade is 0 when signed, and the smallest code when
unsigned: a second moment never becomes 0 unless it is, so its square root never leaves ``eps`` alone
under a first moment that is not 0 (a step that would blow up). bitsandbytes and torchao use a
"dynamic tree" map looked up in a 256-entry table, with a search to encode; this code needs neither,
so encoding and decoding are a few integer operations per element on any device, the same bits on
every one.

A block is one row of the kernels' table (segments.py): up to ``BLOCK`` = 2048 elements of one
parameter (bitsandbytes' block size), cut at multiples of ``BLOCK`` counted from the parameter's first
element; torchao's 256 would quarter a program and multiply the scale traffic by 8. The program that
updates a block reduces its new maximum and writes its scale: no block crosses two programs, and the
scale is known before the codes are written.

**Stochastic rounding of bf16 weights** (no fp32 master): 16 random bits are added to the fp32 value's
bits below bf16's last one, and the sum is truncated: the value rounds up with probability equal to
the fraction it lies above the lower bf16 neighbour, so the rounding is unbiased. The bits are a hash
(``mix32``, the "lowbias32" integer hash) of a per-parameter, per-step key (seed, step count,
parameter index: computed on the host) and of the element's index in its parameter: a run is
reproducible, and independent of the world size and the bucket layout.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP32, BF16, INT8 = 0, 1, 2
"""``MOMENTS`` of the update kernels: how their moments (exp_avg, exp_avg_sq, max_exp_avg_sq,
momentum_buffer) are stored."""

GOLDEN = 0x9E3779B9
"""Spreads consecutive element indices over the hash's input."""


@triton.jit
def to_bf16_bits(value):
    """fp32 -> bf16 bits, rounded to nearest even (NaN stays NaN): what the GPU's conversion gives,
    done by hand because the interpreter truncates."""
    bits = value.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(value != value, 0x7FC0, rounded).to(tl.uint16)


@triton.jit
def decode8(code, SIGNED: tl.constexpr):
    """An 8-bit code (module docstring) as the fp32 value it stands for, before the block's scale."""
    c = code.to(tl.int32)
    if SIGNED:
        e = (c >> 3) & 15
        bits = tl.where(e == 0, 0, ((e + 112) << 23) | ((c & 7) << 20)) | ((c >> 7) << 31)
    else:
        e = c >> 3
        bits = tl.where(e == 0, 0, ((e + 96) << 23) | ((c & 7) << 20))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def encode8(y, SIGNED: tl.constexpr):
    """``y`` in [-1, 1] as its 8-bit code, rounded to nearest even."""
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    if SIGNED:
        r = mag + 0x7FFFF + ((mag >> 20) & 1)
        e = (r >> 23) - 112
        code = tl.where(e >= 1, (e << 3) | ((r >> 20) & 7), 0)
        code = tl.where(code != 0, code | (((bits >> 31) & 1) << 7), 0)
    else:
        r = mag + 0x7FFFF + ((mag >> 20) & 1)
        e = (r >> 23) - 96
        code = tl.where(e >= 1, (e << 3) | ((r >> 20) & 7), tl.where(mag != 0, 8, 0))
    return code.to(tl.uint8)


@triton.jit
def load_moment(ptr, scale_ptr, block, offs, mask, MOMENTS: tl.constexpr, SIGNED: tl.constexpr):
    """A moment in fp32, from its storage format."""
    if MOMENTS == 0:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    elif MOMENTS == 1:
        x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        x = decode8(tl.load(ptr + offs, mask=mask, other=0), SIGNED) * tl.load(scale_ptr + block)
    return x


@triton.jit
def store_moment(ptr, scale_ptr, block, offs, x, mask, n, MOMENTS: tl.constexpr, SIGNED: tl.constexpr):
    """Store a moment in its format; 8-bit: the block's new scale too (only if the row has elements)."""
    if MOMENTS == 0:
        tl.store(ptr + offs, x, mask=mask)
    elif MOMENTS == 1:
        tl.store(ptr + offs, to_bf16_bits(x).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        s = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0)
        y = tl.where(s > 0, tl.div_rn(x, tl.where(s > 0, s, 1.0)), 0.0)
        tl.store(ptr + offs, encode8(y, SIGNED), mask=mask)
        tl.store(scale_ptr + block, s, mask=n > 0)


@triton.jit
def mix32(x):
    """The lowbias32 integer hash of 32-bit values held in int64 (products masked back to 32 bits)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def round_stochastic_bits(value, key, elem):
    """fp32 -> bf16 bits, rounded stochastically (module docstring); ``key`` the parameter's key of this
    step, ``elem`` each element's index in its parameter (int64)."""
    h = mix32(key ^ ((elem * 0x9E3779B9) & 0xFFFFFFFF))  # GOLDEN
    bits = value.to(tl.uint32, bitcast=True).to(tl.int64)
    rounded = (bits + (h >> 16)) >> 16
    return tl.where(value != value, 0x7FC0, rounded).to(tl.uint16)


def sr_key(seed: int, step: int, pid: int) -> int:
    """The 32-bit key of one parameter's stochastic rounding at one step (host side)."""
    return _mix32((seed & 0xFFFFFFFF) ^ _mix32((pid & 0xFFFFFFFF) ^ _mix32(step & 0xFFFFFFFF)))


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


__all__ = ["BF16", "FP32", "GOLDEN", "INT8", "decode8", "encode8", "load_moment", "mix32", "round_stochastic_bits",
           "sr_key", "store_moment", "to_bf16_bits"]
