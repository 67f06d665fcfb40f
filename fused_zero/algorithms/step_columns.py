"""The coefficient table's columns that depend on a parameter's step count, written on the device from
the device's counts (pipeline/updating/step_counts.py), so that building a table never waits for the device.

They must be torch.optim's bit for bit. torch computes Adam's bias corrections on the host in float64
(``1 - beta1 ** step``, ``(1 - beta2 ** step) ** 0.5``, ``lr / bias_correction1``) and rounds the
results to float32 when its kernels take them. A device ``pow`` is not the host's (CUDA's and the CPU's
vectorized one are within an ulp or two of it, not equal), so the powers are not computed there: the
host tabulates both corrections per param group and step, in float64 with numpy's ``power`` as before,
and the device gathers each parameter's entries by its count, then divides ``lr`` by the first in
float64 (IEEE division, the same everywhere) and rounds to float32. A tensor lr or tensor betas make
torch compute these in the tensor's dtype, with 0-dim tensor ops (``bias_keys``): the host tabulates
what those ops give, so that the device's float64 division or multiplication rounds to torch's step
size (float32 or float64 tensors; a bfloat16 one rounds it to bfloat16: the table holds it whole,
``folds_lr``). A CUDA tensor is read to the host for it.

The tables stay small: ``1 - beta ** t`` is exactly 1.0 in float64 once ``beta ** t`` falls below
2**-54, from step ``saturation(beta)`` on (356 for 0.9, 37,412 for 0.999), and every later step reads
that entry (the counts are clamped to it). Up to it a table covers the host's bound of the counts
(``StepCounts.bound``) and doubles when that passes it, so a ``beta2`` of 0.9999999 costs what its
steps so far need, not 24 bytes times its 3.7e8 steps up front. Betas that change every step (a
scheduler's ``cycle_momentum``) rewrite the same table (``BiasTables``).

The fill is 10 small device ops per table (one table per iteration in the steady state) and the count 5
per table read (one in backward and step modes): docs/performance-cpu.md has their host time.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..kernels import ADAM_COEFS, SGD_COEFS
from .codecs import _mix32

UPLOAD_ROWS = 1024
"""The fewest rows a rewrite of a table uploads (a power of two): betas that change every step rewrite
up to saturation(beta1) rows (226 to 730 for OneCycleLR's 0.85 to 0.95), and one upload shape keeps one
pinned staging buffer."""


def saturation(beta: float) -> int:
    """The first step from which ``1 - beta ** step`` is 1.0 in float64 (it stays 1.0 after)."""
    if beta <= 0.0:
        return 1
    t = max(1, math.ceil(54 * math.log(2) / -math.log(beta)))
    while t > 1 and 1 - np.power(beta, float(t - 1)) == 1.0:
        t -= 1
    while 1 - np.power(beta, float(t)) != 1.0:
        t += 1
    return t


def bias_keys(group: dict) -> tuple[tuple, tuple]:
    """What a param group's bias-correction columns are made from: ``(beta1, lr's dtype, beta1's dtype)``
    and ``(beta2, beta2's dtype)``, a dtype None for a Python number. torch's single-tensor Adam computes
    with a tensor lr or beta in the tensor's dtype: ``1 - beta ** step`` a 0-dim tensor op, ``lr /
    bias_correction1`` a division in the tensors' dtype (a float over a tensor: the tensor's reciprocal
    times the float, Tensor.__rtruediv__); ``_column`` tabulates what it computes."""
    lr, (beta1, beta2) = group.get("lr"), group["betas"]
    first = (float(beta1), _dtype(lr), _dtype(beta1))
    return (first if not folds_lr(group) else (*first, float(lr))), (float(beta2), _dtype(beta2))


def _dtype(value) -> torch.dtype | None:
    return value.dtype if isinstance(value, torch.Tensor) else None


def folds_lr(group: dict) -> bool:
    """Whether the table holds the group's whole step size, lr in it, tabulated again when lr changes:
    where torch computes it in a dtype other than float32 or float64 (a bfloat16 tensor lr or beta1),
    whose rounding the device's float64 division, rounded to float32, does not give."""
    exact = (None, torch.float32, torch.float64)
    return _dtype(group.get("lr")) not in exact or _dtype(group["betas"][0]) not in exact


class BiasTables:
    """Adam's bias corrections per param group and step, float64 on the device: ``[G * (L + 1), 3]`` (a
    divisor and a multiplier of ``lr``, ``(1 - beta2 ** t) ** 0.5``; step 0 unused), with each parameter's
    first row (``base``), so that a table's fill gathers them in one op. With Python numbers the divisor
    is ``1 - beta1 ** t`` and the multiplier 1; with tensors, what torch's tensor arithmetic divides or
    multiplies by (``_column``).

    One device table, rewritten in place when a group's betas change (a scheduler with
    ``cycle_momentum``, OneCycleLR's and CyclicLR's default, changes beta1 every step): its address and
    shape stay, so a CUDA graph that reads it keeps replaying (the betas reach the replay through device
    memory, as lr does). Only the columns whose beta changed are computed again, and only the rows that
    changed are uploaded, up to that beta's saturation step (1.0 after it): a step of OneCycleLR costs
    ``saturation(beta1)`` powers on the host (356 at 0.9) and an upload of ``UPLOAD_ROWS`` rows, whose
    pinned staging keeps one shape whatever the table's length. ``L`` only grows: doubled when the counts'
    bound passes it, up to the largest saturation step of the betas seen. A tensor beta's column is
    torch's 0-dim ops, one per step and op (37,412 steps of a float32 0.999: about 0.3 s, once)."""

    def __init__(self):
        self.betas: list[tuple[tuple, tuple]] | None = None  # what the host table holds, per group (bias_keys)
        self.length = -1  # L
        self.full = 0  # the largest saturation step of the betas held
        self.host: np.ndarray | None = None  # [G, L + 1, 3]
        self.both: torch.Tensor | None = None
        self.base: torch.Tensor | None = None

    def get(self, groups: list[dict], bound: int, group: torch.Tensor, upload, first: int = 32) -> BiasTables:
        """``first``: the length a new table starts at (where a CUDA graph reads it, a growth is a
        recapture: pipeline/step_end/step_graph.py asks for 65,536, which holds 0.999's 37,412 steps)."""
        betas = [bias_keys(g) for g in groups]
        if betas == self.betas and self.length >= min(self.full, bound):
            return self
        full = self.full if betas == self.betas else max(saturation(key[0]) for pair in betas for key in pair)
        need = min(full, bound)
        if self.host is None or self.host.shape[0] != len(betas) or self.length < need:
            length = min(full, max(need, first if self.host is None else 2 * self.length))
            self.length = max(length, self.length if self.host is not None else -1)
            self.host = np.ones((len(betas), self.length + 1, 3), dtype=np.float64)
            self.betas = [(None, None)] * len(betas)
            self.both = None
        rows = [0] * len(betas)  # per group: the leading rows whose values changed
        for g, (pair, held) in enumerate(zip(betas, self.betas)):
            for c, (key, was) in enumerate(zip(pair, held)):
                if key != was:
                    _column(self.host[g], key, c)
                    # up to the later of both saturations: the rows between them changed to or from 1.0;
                    # every row where the step size is held whole (its last value stays: folds_lr)
                    rows[g] = max(rows[g], saturation(key[0]) + 1, 0 if was is None else saturation(was[0]) + 1,
                                  self.length + 1 if len(key) == 4 or (was and len(was) == 4) else 0)
        self.betas, self.full = betas, full
        if self.both is None:
            self.both = upload(torch.from_numpy(self.host.reshape(-1, 3)))
            self.base = group * (self.length + 1)
            return self
        for g, n in enumerate(rows):
            # only the changed rows, at least 1,024 and a power of two: a scheduler's new beta1 every
            # step uploads 1,024 rows (24 KiB; saturation(0.97) is 1,209) through one pinned staging
            # shape whatever the table's length, not the whole table (37,413 rows at 0.999)
            if n:
                n = min(max(UPLOAD_ROWS, 1 << (n - 1).bit_length()), self.length + 1)
                at = g * (self.length + 1)
                upload(torch.from_numpy(self.host[g, :n]), out=self.both[at:at + n])
        return self


def _column(out: np.ndarray, key: tuple, which: int) -> None:
    """One group's columns over steps ``0 .. len(out) - 1`` into ``out`` (``[L + 1, 3]``), computed up to
    ``saturation(beta)`` and 1.0 from there on (every value is exactly 1.0 there). ``which`` 0: the
    divisor and the multiplier of lr (columns 0 and 2) from ``(beta1, lr's dtype, beta1's dtype)``, or
    the whole step size as the multiplier from ``(..., lr)`` (folds_lr: its value at saturation from
    there on); 1: ``(1 - beta2 ** t) ** 0.5`` (column 1) from ``(beta2, its dtype)`` (bias_keys)."""
    n = min(len(out), saturation(key[0]) + 1)
    t = np.arange(n, dtype=np.float64)
    cols = (0, 2) if which == 0 else (1,)
    out[n:, cols] = 1.0
    if which == 1:
        beta, dtype = key
        if dtype is None:
            out[:n, 1] = np.power(1 - np.power(beta, t), 0.5)
        else:
            b = torch.tensor(beta, dtype=dtype)
            out[:n, 1] = torch.stack([(1 - b ** s) ** 0.5 for s in t.tolist()]).double().numpy()
        return
    if len(key) == 4:  # folds_lr: the step size itself, as a multiplier of -1 (adam.step_lr)
        beta, lr_dtype, dtype, lr = key
        lr = lr if lr_dtype is None else torch.tensor(lr, dtype=lr_dtype)
        b = beta if dtype is None else torch.tensor(beta, dtype=dtype)
        out[:, 0] = 1.0
        out[:, 2] = [float(lr / (1 - b ** s)) for s in t.tolist()] + [float(lr / (1 - b ** float(n)))] * (len(out) - n)
        return
    beta, lr_dtype, dtype = key
    out[:n, 2] = 1.0
    if dtype is None:  # a float beta1: 1 - beta1 ** t in float64, rounded to a tensor lr's dtype
        value = 1 - np.power(beta, t)
        out[:n, 0] = value if lr_dtype is None else torch.from_numpy(value).to(lr_dtype).double().numpy()
        return
    b = torch.tensor(beta, dtype=dtype)
    correction = torch.stack([1 - b ** s for s in t.tolist()])
    if lr_dtype is None:  # a float lr: lr / correction is correction.reciprocal() * lr
        out[:n, 0], out[:n, 2] = 1.0, correction.reciprocal().double().numpy()
    else:  # a tensor lr: the division in both tensors' dtype
        out[:n, 0] = correction.to(torch.promote_types(lr_dtype, dtype)).double().numpy()


def fill_adam(table: torch.Tensor, after: torch.Tensor, neg_lr: torch.Tensor, both: torch.Tensor, base: torch.Tensor,
              length: int, scratch) -> None:
    """Columns ``bc2_sqrt`` and ``neg_step_size`` of an Adam table (``neg_lr``: ``-lr`` per parameter,
    float64 (adam.step_lr); ``both``, ``base``, ``length``: a BiasTables'): ``-lr * multiplier /
    divisor``, the one IEEE operation torch's step size is (``-lr / bc1`` is ``-(lr / bc1)``; the
    multiplication by 1 and the division by 1 are exact, and a float32 product is exact in float64);
    the copies into the float32 columns round to nearest, as numpy's ``astype`` did, and as torch's
    float32 arithmetic rounds a float32 quotient or product. Intermediates in ``scratch``
    (pipeline/comm/scratch.py)."""
    n = after.shape[0]
    at = torch.clamp(after, max=length, out=scratch.take("bias_at", (n,), torch.int64)).add_(base)
    both = torch.index_select(both, 0, at, out=scratch.take("bias", (n, 3), torch.float64))
    neg_step = torch.mul(neg_lr, both[:, 2], out=scratch.take("neg_step", (n,), torch.float64))
    table[:, ADAM_COEFS.index("neg_step_size")] = neg_step.div_(both[:, 0])
    table[:, ADAM_COEFS.index("bc2_sqrt")] = both[:, 1]


def fill_sgd(table: torch.Tensor, after: torch.Tensor, scratch) -> None:
    """Column ``first`` of an SGD table: torch makes the momentum buffer from the gradient on a
    parameter's first step; a group without momentum "makes" it every step (plain SGD)."""
    n = after.shape[0]
    first = torch.le(after, 1, out=scratch.take("first", (n,), torch.bool))
    no_momentum = torch.eq(table[:, SGD_COEFS.index("momentum")], 0, out=scratch.take("plain", (n,), torch.bool))
    table[:, SGD_COEFS.index("first")] = first.logical_or_(no_momentum)


def fill_sr_keys(table: torch.Tensor, after: torch.Tensor, seed: int) -> None:
    """The last column (``sr_key`` of both tables): each parameter's stochastic-rounding key of this step,
    kernels.sr_key's hash of (seed, step, parameter index), its 32 bits kept as the float32 column's."""
    pid = torch.arange(table.shape[0], dtype=torch.int64, device=table.device)
    step = after & 0xFFFFFFFF
    keys = _mix32((seed & 0xFFFFFFFF) ^ _mix32(pid ^ _mix32(step)))
    table.view(torch.int32)[:, -1] = (keys - ((keys >> 31) << 32)).to(torch.int32)
