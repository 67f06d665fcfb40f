"""The coefficient tables of a step: one per member, one row per parameter of the engine, on the
update's device. Built in two halves (algorithms/interface.py): the host's columns and the step columns'
inputs uploaded when the table is made (``build``), the step columns written from the device's counts by
the device work that reads the table (``fill_steps``), so that work reads device memory only and a CUDA
graph can hold it (step_graph.py). A part of the updates' stage (updates.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..reducing.reduction import UsedFlags

if TYPE_CHECKING:
    from ...options import ShardingOptions
    from ..buckets.param_table import ParamTable


class CoefficientTables:
    """Attributes:
        pending: ``(member, table, step inputs)`` of the tables made since the last ``fill_steps``.
    """

    def __init__(self, parameters: ParamTable, options: ShardingOptions, *, grad_div: np.ndarray, side, scratch,
                 step_counts):
        """``parameters``: the engine's parameter table (buckets/param_table.py); ``grad_div``: what each reduced
        gradient is divided by (reducing/reduction.py); ``side``, ``scratch``: the side stream the tables
        are uploaded from and the tensors they are kept in (comm/); ``step_counts``: the counts their step
        columns are made from (step_counts.py)."""
        self.parameters, self.grad_div = parameters, grad_div
        self.seed = options.seed if options.stochastic_rounding else None
        self.side, self.scratch, self.step_counts = side, scratch, step_counts
        self.pending: list[tuple] = []
        self._groups: dict[int, torch.Tensor] = {}

    def _table(self, member: int, hparams: list[dict], active: np.ndarray) -> torch.Tensor:
        """One member's update scalars for this step, one row per parameter of the engine (the other
        members' rows inactive), on the update's device: the host's columns and the step columns'
        inputs uploaded now; the step columns written from the counts by the device work that reads the
        table (``fill_steps``, algorithms/step_columns.py)."""
        m = self.parameters.members[member]
        group_idx = self.parameters.group_index(member)
        host = m.algo.coefficients(hparams, group_idx, active * (self.parameters.member_of == member), self.grad_div)
        k = sum(1 for p in self.pending if p[0] == member)
        scratch = self.scratch.under("member", member, "table", k)  # one step's tables, each its own
        table = self.side.upload(host, out=scratch.take("coefs", host.shape, host.dtype))
        inputs = m.algo.step_inputs(hparams, group_idx, self.step_counts.bound, self._device_groups(member),
                                    self.side.upload, scratch)
        self.pending.append((member, table, inputs))
        return table

    def fill_steps(self) -> None:
        """The step columns of the tables made since the last device work (on the side stream)."""
        fills, self.pending = self.pending, []
        for member, table, inputs in fills:
            self.parameters.members[member].algo.fill_steps(table, inputs, self.step_counts, self.seed,
                                                            self.scratch.under("member", member))

    def forget_groups(self) -> None:
        """A param group joined a member: its parameters' groups are uploaded again."""
        self._groups.clear()

    def _device_groups(self, member: int) -> torch.Tensor:
        """Each parameter's param group in ``member``, int64 on the device (uploaded once)."""
        if member not in self._groups:
            groups = np.asarray(self.parameters.group_index(member), dtype=np.int64)
            self._groups[member] = self.side.upload(torch.from_numpy(groups))
        return self._groups[member]

    def build(self, iteration, active: np.ndarray, members: list[int]) -> dict[int, torch.Tensor]:
        """The tables of ``members`` for this step, rows active where ``active``."""
        return {m: self._table(m, iteration.hparams[m], active) for m in members}

    def for_bucket(self, iteration, shard, active: np.ndarray | UsedFlags,
                   members: list[int]) -> dict[int, torch.Tensor]:
        """The tables of ``members`` a bucket's update reads: the iteration's shared ones (every row
        active), with this bucket's rows of column 0 set from all-reduced flags on the device, or tables
        of its own where the host knows that some parameter of the bucket got no gradient. The shared
        table of a member is built at its first use in the iteration (in overlap="step", the member's
        ``step()`` drops it first: its param groups are read then)."""
        n = len(self.parameters.tensors)
        if not iteration.counting:  # the iteration's first tables, before any of its updates
            self.step_counts.begin_iteration()
            iteration.counting = True
        missing = [m for m in members if m not in iteration.coefs]
        if missing:
            iteration.coefs.update(self.build(iteration, np.ones(n), missing))
        tables = {m: iteration.coefs[m] for m in members}
        if isinstance(active, UsedFlags):  # runs on the side stream, after the flags' all-reduce
            pids, used = active.table[0], active.table[1]
            for table in tables.values():  # another member's rows are read by no launch of this member
                table[:, 0].index_copy_(0, pids, (used > 0).to(table.dtype))
            return tables
        if active.all():
            return tables
        mask = np.ones(n)
        mask[shard.pids] = active
        return self.build(iteration, mask, members)
