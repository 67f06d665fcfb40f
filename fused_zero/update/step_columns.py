"""The coefficient table's columns that depend on a parameter's step count, written on the device from
the device's counts (pipeline/updating/step_counts.py), so that building a table never waits for the device.

They must be torch.optim's bit for bit. torch computes Adam's bias corrections on the host in float64
(``1 - beta1 ** step``, ``(1 - beta2 ** step) ** 0.5``, ``lr / bias_correction1``) and rounds the
results to float32 when its kernels take them. A device ``pow`` is not the host's (CUDA's and the CPU's
vectorized one are within an ulp or two of it, not equal), so the powers are not computed there: the
host tabulates both corrections per param group and step, in float64 with numpy's ``power`` as before,
and the device gathers each parameter's entries by its count, then divides ``lr`` by the first in
float64 (IEEE division, the same everywhere) and rounds to float32.

The tables stay small: ``1 - beta ** t`` is exactly 1.0 in float64 once ``beta ** t`` falls below
2**-54, from step ``saturation(beta)`` on (356 for 0.9, 37,412 for 0.999), and every later step reads
that entry (the counts are clamped to it). Up to it a table covers the host's bound of the counts
(``StepCounts.bound``) and doubles when that passes it, so a ``beta2`` of 0.9999999 costs what its
steps so far need, not 16 bytes times its 3.7e8 steps up front. Betas that change every step (a
scheduler's ``cycle_momentum``) rewrite the same table (``BiasTables``).

The fill is 9 small device ops per table (one table per iteration in the steady state) and the count 5
per table read (one in backward and step modes): docs/performance-cpu.md has their host time.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..kernels import ADAM_COEFS, SGD_COEFS
from .formats import _mix32

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


class BiasTables:
    """Adam's two bias corrections per param group and step, float64 on the device: ``[G * (L + 1), 2]``
    (``1 - beta1 ** t``, ``(1 - beta2 ** t) ** 0.5``; step 0 unused), with each parameter's first row
    (``base``), so that a table's fill gathers both corrections in one op.

    One device table, rewritten in place when a group's betas change (a scheduler with
    ``cycle_momentum``, OneCycleLR's and CyclicLR's default, changes beta1 every step): its address and
    shape stay, so a CUDA graph that reads it keeps replaying (the betas reach the replay through device
    memory, as lr does). Only the columns whose beta changed are computed again, and only the rows that
    changed are uploaded, up to that beta's saturation step (1.0 after it): a step of OneCycleLR costs
    ``saturation(beta1)`` powers on the host (356 at 0.9) and an upload of ``UPLOAD_ROWS`` rows, whose
    pinned staging keeps one shape whatever the table's length. ``L`` only grows: doubled when the counts'
    bound passes it, up to the largest saturation step of the betas seen."""

    def __init__(self):
        self.betas: list[tuple[float, float]] | None = None  # what the host table holds, per group
        self.length = -1  # L
        self.full = 0  # the largest saturation step of the betas held
        self.host: np.ndarray | None = None  # [G, L + 1, 2]
        self.both: torch.Tensor | None = None
        self.base: torch.Tensor | None = None

    def get(self, groups: list[dict], bound: int, group: torch.Tensor, upload, first: int = 32) -> BiasTables:
        """``first``: the length a new table starts at (where a CUDA graph reads it, a growth is a
        recapture: pipeline/step_end/step_graph.py asks for 65,536, which holds 0.999's 37,412 steps)."""
        betas = [tuple(float(b) for b in g["betas"]) for g in groups]
        if betas == self.betas and self.length >= min(self.full, bound):
            return self
        full = self.full if betas == self.betas else max(saturation(b) for pair in betas for b in pair)
        need = min(full, bound)
        if self.host is None or self.host.shape[0] != len(betas) or self.length < need:
            length = min(full, max(need, first if self.host is None else 2 * self.length))
            self.length = max(length, self.length if self.host is not None else -1)
            self.host = np.ones((len(betas), self.length + 1, 2), dtype=np.float64)
            self.betas = [(None, None)] * len(betas)
            self.both = None
        rows = [0] * len(betas)  # per group: the leading rows whose values changed
        for g, (pair, held) in enumerate(zip(betas, self.betas)):
            for c, (beta, was) in enumerate(zip(pair, held)):
                if beta != was:
                    _column(self.host[g, :, c], beta, c)
                    # up to the later of both saturations: the rows between them changed to or from 1.0
                    rows[g] = max(rows[g], saturation(beta) + 1, 0 if was is None else saturation(was) + 1)
        self.betas, self.full = betas, full
        if self.both is None:
            self.both = upload(torch.from_numpy(self.host.reshape(-1, 2)))
            self.base = group * (self.length + 1)
            return self
        for g, n in enumerate(rows):
            # only the changed rows, at least 1,024 and a power of two: a scheduler's new beta1 every
            # step uploads 1,024 rows (16 KiB; saturation(0.97) is 1,209) through one pinned staging
            # shape whatever the table's length, not the whole table (37,413 rows at 0.999)
            if n:
                n = min(max(UPLOAD_ROWS, 1 << (n - 1).bit_length()), self.length + 1)
                at = g * (self.length + 1)
                upload(torch.from_numpy(self.host[g, :n]), out=self.both[at:at + n])
        return self


def _column(out: np.ndarray, beta: float, column: int) -> None:
    """One bias correction over steps ``0 .. len(out) - 1`` into ``out``: ``1 - beta ** t`` (column 0) or
    ``(1 - beta ** t) ** 0.5`` (column 1), computed up to ``saturation(beta)`` and 1.0 from there on (both
    are exactly 1.0 there)."""
    n = min(len(out), saturation(beta) + 1)
    t = np.arange(n, dtype=np.float64)
    value = 1 - np.power(beta, t)
    out[:n] = value if column == 0 else np.power(value, 0.5)
    out[n:] = 1.0


def fill_adam(table: torch.Tensor, after: torch.Tensor, neg_lr: torch.Tensor, both: torch.Tensor, base: torch.Tensor,
              length: int, scratch) -> None:
    """Columns ``bc2_sqrt`` and ``neg_step_size`` of an Adam table (``neg_lr``: ``-lr`` per parameter,
    float64: ``-lr / bc1`` is ``-(lr / bc1)`` in IEEE arithmetic; ``both``, ``base``, ``length``: a
    BiasTables'); the copies into the float32 columns round to nearest, as numpy's ``astype`` did.
    Intermediates in ``scratch`` (pipeline/comm/scratch.py)."""
    n = after.shape[0]
    at = torch.clamp(after, max=length, out=scratch.take("bias_at", (n,), torch.int64)).add_(base)
    both = torch.index_select(both, 0, at, out=scratch.take("bias", (n, 2), torch.float64))
    table[:, ADAM_COEFS.index("neg_step_size")] = torch.div(
        neg_lr, both[:, 0], out=scratch.take("neg_step", (n,), torch.float64))
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
