"""The second stage of a bucket's pipeline: once its reduction is waited for, the fused update of this
rank's region (after the overflow / norm pass, which may skip it on every rank); then it starts the
third, the all-gather of the updated slices (pipeline/gathering/), in bucket order.

One launch per bucket, or, once the shards sit in arenas (overlap modes ``backward`` and ``step``, see
arena.py), one per dtype over all of them (launches.py); the checks, the updates and the bookkeeping
are the same for both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ...algorithms.fused import UpdateArgs
from ...algorithms.interface import Runs
from ..buckets.shard import BucketShard
from ..buckets.topology import post_update_groups
from ..comm.profiling import range_push
from ..reducing.reduction import Reduced
from .launches import Unit, launch_units
from .norm_check import check
from .tables import CoefficientTables
from .whole_matrix import WholeMatrix
from .whole_params import WholeParams

if TYPE_CHECKING:
    from ...options import ShardingOptions
    from ..buckets.param_table import ParamTable


class Updates:
    """Runs the updates of ready buckets for the engine (``finish``) and starts their all-gathers.

    Attributes:
        grad_sumsq: the global sum of squares of the last update's reduced, unscaled gradients (a device
            scalar; in overlap modes "step" and "backward", where one update covers every bucket: the
            pre-clip norm squared, which the integrations' clip_grad_norm_ returns), or None.
    """

    def __init__(self, parameters: ParamTable, options: ShardingOptions, *, topology, reduction, side, scratch,
                 step_counts, graph, single_launch, backend: str):
        """``parameters``: the engine's parameter table (buckets/param_table.py); ``topology``: the process
        groups (buckets/topology.py); ``reduction``: the stage before, whose divisors the update applies
        (reducing/reduction.py); ``side``, ``scratch``: where the device work runs and the tensors it
        writes (comm/); ``step_counts``: the counts it adds to (step_counts.py); ``graph``: the CUDA
        graphs that replay it (step_end/step_graph.py), or None; ``single_launch``: the arenas' launches
        (buckets/arena.py), or None; ``backend``: "triton" or "torch"."""
        self.parameters, self.members, self.group_of = parameters, parameters.members, parameters.group_of
        self.stochastic = options.stochastic_rounding
        self.reduction, self.side, self.scratch, self.step_counts = reduction, side, scratch, step_counts
        self.graph, self.single_launch, self.backend = graph, single_launch, backend
        self.group, self.world, self.rank = topology.group, topology.world, topology.rank
        # the collectives that wait for an update, off the reductions' communicators where a later
        # reduction of the same backward would queue behind them (overlap="bucket")
        self.gather_group, self.check_group = post_update_groups(topology) \
            if options.overlap == "bucket" and self.world > 1 else (topology.shard_group, self.group)
        self._pids_kept: dict[int, tuple] = {}  # member -> (shards, their pids on the device)
        self._whole_matrix: dict[int, WholeMatrix | WholeParams] = {}  # phased members' steps
        self.tables = CoefficientTables(parameters, options, grad_div=reduction.grad_div, side=side, scratch=scratch,
                                        step_counts=step_counts)
        self.grad_sumsq: torch.Tensor | None = None

    def forget_members(self) -> None:
        """Drop what was kept of the members' parameters: a param group joined one
        (pipeline/added_groups.py)."""
        self._pids_kept.clear()
        self._whole_matrix.clear()  # Muon's owners, from the member's matrices
        self.tables.forget_groups()

    def _whole(self, member) -> WholeMatrix | WholeParams:
        """The phased member's runner: Muon's matrices on their owners, or Adafactor's whole parameters on
        every rank (``algo.runs`` says which)."""
        if member.index not in self._whole_matrix:
            runner = {Runs.WHOLE_MATRIX: WholeMatrix, Runs.WHOLE_PARAMS: WholeParams}[member.algo.runs]
            self._whole_matrix[member.index] = runner(self.parameters, self.reduction, member, self.gather_group)
        return self._whole_matrix[member.index]

    def finish(self, iteration, count: int, max_norm: float | None = None, each_bucket: bool = False) -> None:
        """Overlap modes "bucket" and "backward", in the backward: wait for the first ``count`` ready
        reductions of iteration ``iteration`` and update those buckets, every member's parameters.

        ``each_bucket`` (overlap="bucket"): every bucket is checked and skipped on its own, also when
        several are updated in one call (on the CPU the last two are): one non-finite bucket must not
        take a finite one with it.

        On CUDA the waits are made by the side stream, so the backward's own stream never waits
        for communication.
        """
        todo, iteration.ready = iteration.ready[:count], iteration.ready[count:]
        if not todo:
            return
        members = [m.index for m in self.members]
        with self.side.run(follow_current=self.world == 1):
            for item in todo:
                for w in item.works:
                    w.wait()
            iteration.waited += todo
            scales = dict.fromkeys(members, iteration.grad_scale)
            for group in ([item] for item in todo) if each_bucket else [todo]:
                self._update(iteration, group, members, scales, members, self._clips(iteration, max_norm), {})

    def step_member(self, iteration, member, max_norm: float | None, grad_scale: torch.Tensor | None, edited: bool,
                    follow: bool) -> None:
        """Overlap mode "step", in ``member``'s ``step()``: its update of every bucket reduced in this
        iteration, from its gradients as they are now, skipped (on every rank) if they are not finite
        on some rank or hold an edit the update cannot honor (``edited``, this rank's). The other members
        update at their own ``step()``: each optimizer is torch.optim's own. With ``max_grad_norm`` the
        first member's step computes the clip coefficient from every member's gradients, as one
        ``clip_grad_norm_(model.parameters())`` before the steps does.

        ``grad_scale``: the loss scale the member's gradients carry (None once ``scaler.unscale_``
        divided them). ``follow``: the side stream also waits for the current stream (the update reads
        something queued there after the backward: the user's edit of ``.grad``, GradScaler's scale).
        """
        todo, iteration.ready = iteration.ready, []
        with self.side.run(follow_current=self.world == 1 or follow):
            for item in todo:
                for w in item.works:
                    w.wait()
            iteration.waited += todo
            scales = {m.index: m.scaler.scale() if m.scaler is not None and m.scaler.enabled and
                      not m.scaler.unscaled() else None for m in self.members}
            if grad_scale is not None and self.graph is not None:  # GradScaler hands a new tensor each step
                # (its scale times 1): the graph reads a copy of its own
                grad_scale = self.scratch.under("member", member.index).take(
                    "grad_scale", grad_scale.shape, grad_scale.dtype).copy_(grad_scale)
            scales[member.index] = grad_scale
            clip = self._clips(iteration, max_norm)
            norm = [m.index for m in self.members] if clip is not None else [member.index]
            self._update(iteration, iteration.waited, [member.index], scales, norm, clip, {member.index: edited})

    def _clips(self, iteration, max_norm: float | None) -> float | None:
        """``max_norm`` where this update computes the iteration's clip coefficient (the first one, with
        ``max_grad_norm``), whose tensor ``iteration.clip`` is then set: on the host, so that a replayed graph
        (which runs no Python) leaves it set too; else None."""
        if max_norm is None or iteration.clip is not None:
            return None
        iteration.clip = self.scratch.take("clip", (1,), torch.float32)
        return max_norm

    def _update(self, iteration, items: list[Reduced], members: list[int], scales: dict, norm: list[int],
                clip: float | None, edited: dict) -> None:
        """Update ``members``' parameters of ``items`` unless some rank's reduced gradients of the member
        are not finite (then nothing of that member is written, on every rank, and its step counts stay).
        ``scales``: the loss scale each member's gradients carry (or None); ``norm``: the members whose
        gradients the overflow / norm pass reads (every member's where the clip coefficient is computed);
        ``clip``: the ``max_grad_norm`` whose coefficient this update computes into ``iteration.clip``, or None;
        ``edited``: members with an edit of ``.grad`` that their update cannot honor (this rank's).

        The host's part first (tables uploaded, launches planned, earlier gathers waited for), then the
        device work: queued as it goes, or, with ``capturable=True``, captured once in a CUDA graph and
        replayed (step_graph.py)."""
        needed = sorted(set(members) | set(norm))
        coefs = [self.tables.for_bucket(iteration, item.shard, item.active, needed) for item in items]
        counted = self._counted(items, coefs, members)  # uploads first, before this call's kernels are queued
        units = launch_units(self.parameters, self.single_launch, self.tables, iteration, items, coefs, members)
        others = [m for m in norm if m not in members]
        norm_units = [u for u in units if u.member in norm] + (launch_units(
            self.parameters, self.single_launch, self.tables, iteration, items, coefs, others) if others else [])
        for shard in {id(s): s for unit in units for s in unit.shards}.values():
            shard.gather.finish()

        def work(joined: bool = False) -> None:
            self._device_work(iteration, items, coefs, counted, units, norm_units, members, scales, clip, edited,
                              joined)
        if self.graph is None or not all(self.members[m].captured for m in members):  # a member built without
            work()  # capturable=True steps eagerly beside one with it (step_graph.py)
            return
        self.graph.run(members[0] if len(members) == 1 else -1,
                    (iteration.found_inf, scales, edited, clip, iteration.clip, self.tables.pending, counted, units,
                     norm_units), lambda: work(joined=True))
        self.tables.pending = []

    def _device_work(self, iteration, items: list[Reduced], coefs: list, counted: list, units: list[Unit],
                     norm_units: list[Unit], members: list[int], scales: dict, clip: float | None,
                     edited: dict, joined: bool = False) -> None:
        """Everything ``_update`` queues on the device: step columns, checks, updates, counts, gathers. It
        reads device memory only (a CUDA graph can hold it). ``joined``: the side stream waits for the
        gathers too (a graph must join the streams it forks)."""
        self.tables.fill_steps()
        found, sumsq = check(iteration, norm_units, scales, clip, edited, self.check_group, scratch=self.scratch,
                             backend=self.backend, world=self.world, members=len(self.members))
        if len(norm_units) > 0 and {u.member for u in norm_units} >= {m.index for m in self.members}:
            self.grad_sumsq = sumsq  # the pass read every member's gradients: the global norm's
        for m in members:
            torch.maximum(iteration.found_inf[m:m + 1], found[m:m + 1], out=iteration.found_inf[m:m + 1])
        for j, (m, pids, table) in enumerate(counted):  # on the side stream: the next table reads the counts there
            self.step_counts.count(pids, table, found[m:m + 1], self.scratch.under("member", m, "count", j))
        args = {m: dict(grad_scale=scales[m], found_inf=found[m:m + 1], clip_coef=iteration.clip,
                        stochastic=self.stochastic, hparams=iteration.hparams[m], group_of=self.group_of,
                        grad_div=self.reduction.grad_div, asynchronous=self.side.asynchronous)
                for m in members}
        for m in members:  # what updates in phases with collectives between (Muon), first, on every rank
            member = self.members[m]
            if member.algo.runs.phased and any(m in item.shard.member_set for item in items):
                self._whole(member).step(iteration, items, [t[m] for t in coefs], [u for u in units if u.member == m],
                                         args[m])
        gathers = self._gathers(items, units, members)
        for j, unit in enumerate(units):
            algo = self.members[unit.member].algo
            if not algo.runs.phased:
                with range_push("fused_zero.update"):
                    algo.apply(self.backend, unit.rows, unit.segments, unit.table, UpdateArgs(
                        unit.grad, unit.param, unit.state, scales=unit.scales or None, blocks=unit.blocks,
                        **args[unit.member]))
            gathers(j)
        for m in members:  # what every rank keeps of each parameter, with or without a piece of it
            algo = self.members[m].algo
            for item, tables in zip(items, coefs) if algo.finishes else ():
                shard = item.shard
                if m in shard.member_set:
                    algo.finish(shard.pids[shard.members == m], tables[m], UpdateArgs(None, None, {}, **args[m]))
        gathers(len(units))
        if joined:
            for item in items:
                item.shard.gather.finish()

    def _gathers(self, items: list[Reduced], units: list[Unit], members: list[int]):
        """``ready(j)``: start, in bucket order, the all-gather of each bucket holding parameters of
        ``members`` once its last launch is among the first ``j + 1`` units: every member's parameters are
        current on every rank when its ``step()`` returns, as torch.optim's are (in overlap="step" a
        bucket shared by several optimizers is gathered after each one's update: whole by its lead, its
        own elements by each other, gathering/packed.py). Which buckets, and their order, are every
        rank's, whatever launches its region needs (a rank whose slice holds none of a member's rows
        launches nothing for it): collectives pair up by issue order."""
        last = {id(s): j for j, unit in enumerate(units) for s in unit.shards}
        todo = [item.shard for item in items if item.shard.member_set.intersection(members)]

        def ready(j: int) -> None:
            while todo and last.get(id(todo[0]), -1) <= j:  # a skipped update gathers the unchanged parameters
                shard = todo.pop(0)
                shard.gather.start(shard.param_buffer, members, self.gather_group, self.side, self.scratch)
        return ready

    def _counted(self, items: list[Reduced], coefs: list, members: list[int]) -> list[tuple]:
        """``(member, device pids, table)`` of the step counts ``members``' update of ``items`` adds: one
        per table, over the member's parameters of every bucket that read it (one per member in the
        steady state of the backward and step modes, where the single launch updates every bucket).
        Every rank counts every parameter of the bucket, whether its region holds a row of it or not:
        the counts are replicated."""
        by_table: dict[int, tuple] = {}
        for item, tables in zip(items, coefs):
            for m in sorted(item.shard.member_set.intersection(members)):
                by_table.setdefault(id(tables[m]), (tables[m], m, []))[2].append(item.shard)
        return [(m, self._device_pids(m, shards), table) for table, m, shards in by_table.values()]

    def _device_pids(self, member: int, shards: list[BucketShard]) -> torch.Tensor:
        """The member's parameter indices of ``shards``, int64 on the device: one shard's own, or a set's
        (kept while the same shards come: the single launch's every step)."""
        if len(shards) == 1:
            return shards[0].device_pids(member, self.side)
        kept = self._pids_kept.get(member)
        if kept is None or len(kept[0]) != len(shards) or any(a is not b for a, b in zip(kept[0], shards)):
            pids = np.concatenate([s.pids[s.members == member] for s in shards]).astype(np.int64)
            kept = self._pids_kept[member] = (list(shards), self.side.upload_kept(torch.from_numpy(pids)))
        return kept[1][0]
