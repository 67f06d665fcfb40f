"""The overflow / norm pass before an update (updates.py): one pass over this rank's reduced slices of the
launches, each member's non-finite values counted apart and the sum of squares for ``max_grad_norm``,
all-reduced with each member's edit flag in one collective; each member's skip flag and the clip
coefficient stay on the device."""

from __future__ import annotations

import torch

from ...update.algorithms import clip_coefficient, grad_sumsq
from ..comm import collectives
from .launches import Unit


def check(engine, it, units: list[Unit], scales: dict, clip: float | None, edited: dict, group,
          covers_all: bool) -> torch.Tensor:
    """One pass over this rank's reduced slices of ``units`` (each unscaled by its member's loss
    scale): the sum of squares and each member's count of non-finite values, all-reduced with this
    rank's edit flags in one collective. Returns each member's skip flag, float32 ``[members]`` (a
    device tensor: no host sync), and, with ``clip`` (a ``max_grad_norm``), writes the iteration's clip
    coefficient into ``it.clip``. ``group``: the collective's (updates.py: DDP's, or its twin).
    ``covers_all``: the pass reads every member's gradients (the sum of squares is then the global
    norm's, which ``engine.grad_sumsq`` holds)."""
    e = engine
    n = len(e.members)
    scratch = e.scratch.under("check", *sorted(edited))
    stats = scratch.take("stats", (1 + 2 * n,), torch.float32).zero_()
    for j, unit in enumerate(units):
        if not unit.norm_rows:
            continue
        segments = unit.norm_segments  # the Triton kernel's per-row sums: kept too
        partials = scratch.take(("rows", j), (max(segments.n_rows, 1), 2), torch.float32) \
            if segments is not None else None
        norm = scratch.take(("norm", j), (2,), torch.float32)
        grad_sumsq(e.backend, unit.norm_rows, segments, unit.table, unit.grad, scales[unit.member], out=norm,
                   partials=partials)
        stats[:1] += norm[:1]
        stats[1 + unit.member:2 + unit.member] += norm[1:]
    for m, flag in edited.items():
        if flag:
            stats[1 + n + m:2 + n + m].fill_(1.0)
    if e.world > 1:  # waited for by the side stream on CUDA, like the reductions
        collectives.all_reduce(stats, group).wait()
    if covers_all:
        e.grad_sumsq = stats[0]
    # any non-finite count or edit flag (non-negative whole numbers): 1.0, else 0.0
    found = torch.maximum(stats[1:1 + n], stats[1 + n:], out=scratch.take("found", (n,), torch.float32))
    found.clamp_(max=1.0)
    if clip is not None:
        clip_coefficient(stats[0], clip, it.clip)
    return found
