"""Adam's bias-correction tables (algorithms/step_columns.py) under betas that change every step: OneCycleLR's
``cycle_momentum`` moves beta1 each step, and the table is rewritten in place (one device tensor, so one
pinned buffer for its uploads and one address for a CUDA graph), not made anew per set of betas. Run on
the CPU model of the side stream (the stream-order checker's pinned memory), 400 steps of OneCycleLR:
the pinned bytes stay those of the table's doublings (it grows with the step counts up to beta2's
saturation step), never one buffer per step."""

from __future__ import annotations

import numpy as np
import torch

import fused_zero
from fused_zero.algorithms.step_columns import UPLOAD_ROWS, BiasTables, saturation
from fused_zero.pipeline.comm.streams import _PinnedRing
from fused_zero.testing.streamcheck import StreamChecker

STEPS = 400


def _pinned(engine) -> tuple[int, int]:
    """Bytes of pinned host memory the side stream's uploads hold, and how many shapes they have."""
    rings = engine.side._staging.rings
    return sum(b.numel() * b.element_size() for ring in rings.values() for b, _ in ring), len(rings)


def test_onecycle_keeps_the_pinned_memory_of_one_table():
    """Each step uploads the rows beta1's change touched (up to saturation(beta1) + 1, at least
    UPLOAD_ROWS), not the table, and the shapes a doubling left behind are dropped: once the table holds
    UPLOAD_ROWS, the pinned bytes are one such upload and the small ones of every step (-lr, counts), flat."""
    with StreamChecker():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        opt = fused_zero.AdamW(model.parameters(), lr=1e-2, ddp=model)
        schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS)
        seen = []
        for _ in range(STEPS):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
            seen.append(_pinned(opt._engine))
    table = opt._algorithm._bias
    assert table.length >= 256, table.length  # it doubled on the way
    rows = 24 * (table.length + 1)  # three float64 columns, at most the table's rows per staging shape
    assert seen[-1][0] <= 2 * rows + 4096 and seen[-1][1] <= 8, (seen[-1], rows)
    assert len(set(seen[-40:])) == 1, seen[-40:]  # flat


def test_the_staging_of_a_shape_no_longer_uploaded_is_dropped():
    """A table that grew leaves its old shape behind: its pinned buffers go once ``stale`` uploads of other
    shapes passed (and their copies are done), while the shapes in use keep theirs."""
    class Done:
        def query(self):
            return True

    class Api:
        def pinned_empty(self, shape, dtype):
            return torch.empty(shape, dtype=dtype)

        def event(self):
            return Done()
    ring = _PinnedRing(Api(), stale=256)
    ring.take(torch.zeros(33, 2))  # the table before it grew
    for _ in range(400):
        ring.take(torch.zeros(65, 2))
        ring.take(torch.zeros(3))
    assert sorted(k[0] for k in ring.rings) == [(3,), (65, 2)], list(ring.rings)
    assert all(len(buffers) == 1 for buffers in ring.rings.values())


def test_a_beta_changed_every_step_uploads_the_rows_it_changed():
    """With a table asked for 65,536 rows (what a CUDA graph asks for) and beta1 moving between 0.85 and 0.95
    as OneCycleLR moves it, each step uploads 1,024 rows (saturation(0.95) = 730), not the 37,413 of the
    table (capped at saturation(0.999))."""
    group = torch.zeros(1, dtype=torch.int64)
    sizes = []

    def upload(host, out=None):
        sizes.append(host.shape[0])
        return host.clone() if out is None else out.copy_(host)
    kept = BiasTables()
    for i, beta1 in enumerate(np.linspace(0.95, 0.85, 50)):
        kept.get([{"betas": (float(beta1), 0.999)}], 100 + i, group, upload, first=2 ** 16)
        fresh = BiasTables().get([{"betas": (float(beta1), 0.999)}], 100 + i, group, upload, first=2 ** 16)
        assert torch.equal(kept.both, fresh.both), beta1
        sizes.pop()  # the fresh table's own upload
    assert sizes[0] == kept.length + 1 >= saturation(0.999) and set(sizes[1:]) == {UPLOAD_ROWS}, sizes[:5]


def test_a_table_holding_a_bfloat16_step_size_is_rewritten_whole_when_lr_changes():
    """A bfloat16 tensor lr: the table holds the step size itself (step_columns.folds_lr), constant from
    beta1's saturation on; a new lr rewrites every row, past that saturation too (the counts there read
    the last rows), as a table made for it from nothing holds them."""
    group = torch.zeros(1, dtype=torch.int64)

    def upload(host, out=None):
        return host.clone() if out is None else out.copy_(host)
    kept = BiasTables()
    for lr in (1e-2, 5e-3, 2.5e-3):
        groups = [{"lr": torch.tensor(lr, dtype=torch.bfloat16), "betas": (0.5, 0.999)}]
        kept.get(groups, 2000, group, upload)
        fresh = BiasTables().get(groups, 2000, group, upload, first=kept.length)
        assert kept.length == fresh.length > saturation(0.5) + UPLOAD_ROWS
        assert torch.equal(kept.both, fresh.both), lr


def test_a_rewritten_table_holds_what_a_new_one_would():
    """The table after betas changed, in place, equals one made for the new betas from nothing."""
    group = torch.zeros(1, dtype=torch.int64)

    def upload(host, out=None):
        return host.clone() if out is None else out.copy_(host)
    kept = BiasTables()
    for betas, bound in (((0.9, 0.999), 40), ((0.85, 0.999), 41), ((0.95, 0.99), 90), ((0.9, 0.999), 2000)):
        kept.get([{"betas": betas}], bound, group, upload)
        fresh = BiasTables().get([{"betas": betas}], bound, group, upload, first=kept.length)
        assert kept.length == fresh.length >= min(bound, max(saturation(b) for b in betas))
        assert torch.equal(kept.both, fresh.both), betas
