"""The overflow / norm pass before an update (updates.py): one pass over this rank's reduced slices of the
launches, each member's non-finite values counted apart and the sum of squares for ``max_grad_norm``,
all-reduced with each member's edit flag in one collective; each member's skip flag and the clip
coefficient stay on the device."""

from __future__ import annotations

import torch

from ...algorithms.fused import clip_coefficient, grad_sumsq
from ..comm import collectives
from .launches import Unit


def check(iteration, units: list[Unit], scales: dict, clip: float | None, edited: dict, group, *, scratch, backend: str,
          world: int, members: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass over this rank's reduced slices of ``units`` (each unscaled by its member's loss
    scale): the sum of squares and each member's count of non-finite values, all-reduced with this
    rank's edit flags in one collective. Returns each member's skip flag, float32 ``[members]`` (a
    device tensor: no host sync), and the sum of squares (the global norm's where the units hold every
    member's gradients: Updates.grad_sumsq); with ``clip`` (a ``max_grad_norm``), writes the iteration's
    clip coefficient into ``iteration.clip``. ``group``: the collective's (updates.py: DDP's, or its twin), of
    ``world`` ranks; ``scratch``: where the pass writes (comm/scratch.py); ``members``: how many."""
    n = members
    scratch = scratch.under("check", *sorted(edited))
    stats = scratch.take("stats", (1 + 2 * n,), torch.float32).zero_()
    for j, unit in enumerate(units):
        if not unit.norm_rows:
            continue
        segments = unit.norm_segments  # the Triton kernel's per-row sums: kept too
        partials = scratch.take(("rows", j), (max(segments.n_rows, 1), 2), torch.float32) \
            if segments is not None else None
        norm = scratch.take(("norm", j), (2,), torch.float32)
        grad_sumsq(backend, unit.norm_rows, segments, unit.table, unit.grad, scales[unit.member], out=norm,
                   partials=partials)
        stats[:1] += norm[:1]
        stats[1 + unit.member:2 + unit.member] += norm[1:]
    for m, flag in edited.items():
        if flag:
            stats[1 + n + m:2 + n + m].fill_(1.0)
    if world > 1:  # waited for by the side stream on CUDA, like the reductions
        collectives.all_reduce(stats, group).wait()
    # any non-finite count or edit flag (non-negative whole numbers): 1.0, else 0.0
    found = torch.maximum(stats[1:1 + n], stats[1 + n:], out=scratch.take("found", (n,), torch.float32))
    found.clamp_(max=1.0)
    if clip is not None:
        clip_coefficient(stats[0], clip, iteration.clip)
    return found, stats[0]
