"""The second and third stages of a bucket's pipeline: once its reduction is waited for, the fused
update of this rank's region (after the overflow / norm pass, which may skip it on every rank), then
the all-gather of the updated slices into the flat parameter buffer.

One launch per bucket, or, once the shards sit in arenas (overlap modes ``backward`` and ``step``, see
arena.py), one per dtype over all of them; the checks, the updates and the bookkeeping are the same
for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..update.algorithms import UpdateArgs, clip_coefficient
from . import collectives
from .profiling import range_push
from .reduction import Reduced, UsedFlags
from .shard import BucketShard
from .topology import post_update_groups


@dataclass
class Unit:
    """One update launch: its rows (and norm rows), coefficient table and buffers, and the buckets
    whose updates end with it: a bucket's state may take several launches (one per state format), and
    its all-gather starts after the last."""

    rows: list
    segments: object
    blocks: object
    norm_rows: list
    norm_segments: object
    table: torch.Tensor
    grad: object
    param: torch.Tensor
    state: dict
    scales: dict
    items: list


class Updates:
    """Runs the updates of ready buckets for the engine (``finish``) and starts their all-gathers."""

    def __init__(self, engine):
        self.engine = engine
        self.group, self.world, self.rank = engine.group, engine.world, engine.rank
        # the collectives that wait for an update, off the reductions' communicators where a later
        # reduction of the same backward would queue behind them (overlap="bucket")
        topo = engine.topology
        self.gather_group, self.check_group = post_update_groups(topo) \
            if engine.overlap == "bucket" and self.world > 1 else (topo.shard_group, self.group)
        self._groups: torch.Tensor | None = None
        self._pids_kept: tuple = ((), None)

    @property
    def side(self):
        """The engine's side stream (read each time: tests swap in a recording one)."""
        return self.engine.side

    def finish(self, it, count: int, max_norm: float | None = None, follow: bool = False,
               each_bucket: bool = False) -> None:
        """Wait for the first ``count`` ready reductions of iteration ``it`` and update those buckets.

        ``each_bucket`` (overlap="bucket"): every bucket is checked and skipped on its own, also when
        several are updated in one call (on the CPU the last two are): one non-finite bucket must not
        take a finite one with it.

        On CUDA the waits are made by the side stream, so the backward's own stream never waits
        for communication. ``follow``: the side stream also waits for the current stream (the update
        reads something queued there after the backward: the user's edit of ``.grad``, GradScaler's
        scale tensor).
        """
        todo, it.ready = it.ready[:count], it.ready[count:]
        if not todo:
            return
        with self.side.run(follow_current=self.world == 1 or follow):
            for item in todo:
                for w in item.works:
                    w.wait()
            for group in ([item] for item in todo) if each_bucket else [todo]:
                self._update(it, group, max_norm)

    def _coefficient_table(self, hparams: list[dict], active: np.ndarray) -> torch.Tensor:
        """Every parameter's update scalars for this step, one row per parameter, on the update's device:
        the host's columns uploaded, the step counts' written there (update/step_columns.py)."""
        e = self.engine
        host = e.algo.coefficients(hparams, e.group_of, active, e.reduction.grad_div)
        table = self.side.upload(host)
        with self.side.run(follow_current=False):
            e.algo.fill_steps(table, hparams, e.group_of, e.step_counts, self._device_groups(),
                              e.options.seed if e.options.stochastic_rounding else None, self.side.upload)
        return table

    def _device_groups(self) -> torch.Tensor:
        """Each parameter's param group, int64 on the device (uploaded once)."""
        if self._groups is None:
            self._groups = self.side.upload(torch.from_numpy(np.asarray(self.engine.group_of, dtype=np.int64)))
        return self._groups

    def _coefs_for(self, it, shard: BucketShard, active: np.ndarray | UsedFlags) -> torch.Tensor:
        """The table a bucket's update reads: the iteration's shared one (every row active), with this
        bucket's rows of column 0 set from all-reduced flags on the device, or a table of its own where
        the host knows that some parameter of the bucket got no gradient."""
        n = len(self.engine.params)
        if it.coefs is None:  # the iteration's first table, before any of its updates
            self.engine.step_counts.begin_iteration()
            it.coefs = self._coefficient_table(it.hparams, np.ones(n))
        if isinstance(active, UsedFlags):  # runs on the side stream, after the flags' all-reduce
            pids, used = active.table[0], active.table[1]
            it.coefs[:, 0].index_copy_(0, pids, (used > 0).to(it.coefs.dtype))
            return it.coefs
        if active.all():
            return it.coefs
        mask = np.ones(n)
        mask[shard.pids] = active
        return self._coefficient_table(it.hparams, mask)

    def _update(self, it, items: list[Reduced], max_norm: float | None = None) -> None:
        """Update ``items`` unless some rank's reduced gradients of them are not finite (then nothing
        is written, on every rank, and their step counts stay)."""
        e = self.engine
        coefs = [self._coefs_for(it, item.shard, item.active) for item in items]
        counted = self._counted(items, coefs)  # uploads first, before this call's kernels are queued
        for item in items:
            item.shard.wait_gather()
        units = self._launch_units(it, items, coefs)
        found, clip = self._check(it, units, max_norm)
        torch.maximum(it.found_inf, found, out=it.found_inf)
        for pids, table in counted:  # on the side stream: the next table reads the counts there
            e.step_counts.count(pids, table, found)
        for unit in units:
            with range_push("fused_zero.update"):
                e.algo.update(e.backend, unit.rows, unit.segments, unit.table, UpdateArgs(
                    unit.grad, unit.param, unit.state, grad_scale=it.grad_scale, found_inf=found,
                    clip_coef=clip, scales=unit.scales or None, stochastic=e.options.stochastic_rounding,
                    blocks=unit.blocks))
            for item in unit.items:
                item.shard.reduced_buffer = None
                self._start_gather(item.shard)  # a skipped update gathers the unchanged parameters

    def _counted(self, items: list[Reduced], coefs: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(device pids, table)`` of the step counts ``items`` add: one per table, over the parameters
        of every bucket that read it (one in the steady state of the backward and step modes, where the
        single launch updates every bucket)."""
        by_table: dict[int, tuple] = {}
        for item, table in zip(items, coefs):
            by_table.setdefault(id(table), (table, []))[1].append(item.shard)
        return [(self._device_pids(shards), table) for table, shards in by_table.values()]

    def _device_pids(self, shards: list[BucketShard]) -> torch.Tensor:
        """The parameter indices of ``shards``, int64 on the device: one shard's own, or the last set's
        (kept while the same shards come: the single launch's every step)."""
        if len(shards) == 1:
            return shards[0].device_pids(self.side)
        kept, pids = self._pids_kept
        if len(kept) != len(shards) or any(a is not b for a, b in zip(kept, shards)):
            pids = self.side.upload_kept(torch.from_numpy(np.concatenate([s.pids for s in shards]).astype(np.int64)))
            self._pids_kept = (shards, pids)
        return pids[0]

    def _launch_units(self, it, items: list[Reduced], coefs: list) -> list[Unit]:
        """The launches that update ``items``: one per dtype and state format when the arenas hold
        exactly these shards and one coefficient table serves them all, else one per bucket and state
        format. The norm pass reads each bucket's gradients once, in the first launch of its bucket or
        its dtype."""
        single = self.engine.single
        launches = single.for_step([item.shard for item in items]) if single else None
        table = self._one_table(it, items, coefs) if launches is not None else None
        if table is None:
            units = []
            for item, t in zip(items, coefs):
                s = item.shard
                for k, part in enumerate(s.parts):
                    units.append(Unit(part.rows, part.segments, part.blocks, s.norm_rows if k == 0 else [],
                                      s.norm_segments if k == 0 else None, t, s.reduced_buffer, s.param_buffer,
                                      part.state, part.scales, [item] if k == len(s.parts) - 1 else []))
            return units
        units = [Unit(launch.rows, launch.segments, launch.blocks, launch.norm_rows, launch.norm_segments, table,
                      launch.grad(buffers), launch.arena.params, launch.fs.state, launch.fs.scales, [])
                 for launch, buffers in launches]
        last = {id(launch.arena): unit for (launch, _), unit in zip(launches, units)}
        for item in items:
            last[id(single.arenas[item.shard.param_buffer.dtype])].items.append(item)
        return units

    def _one_table(self, it, items: list[Reduced], coefs: list) -> torch.Tensor | None:
        """One coefficient table for every bucket of the step (a parameter is in one bucket only): the
        iteration's shared one, or one built from the host's flags where some parameter is known to
        have no gradient; None where neither fits (then one launch per bucket)."""
        if all(t is coefs[0] for t in coefs):
            return coefs[0]
        if any(isinstance(item.active, UsedFlags) for item in items):
            return None
        mask = np.ones(len(self.engine.params))
        for item in items:
            mask[item.shard.pids] = item.active
        return self._coefficient_table(it.hparams, mask)

    def _check(self, it, units: list[Unit], max_norm: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass over this rank's reduced slices of ``units`` (unscaled by the loss scale): the
        sum of squares and the count of non-finite values, all-reduced with this rank's edit flag in
        one collective. Returns the skip flag and, with ``max_norm``, the clip coefficient (device
        tensors: no host sync)."""
        e = self.engine
        stats = torch.zeros(3, dtype=torch.float32, device=e.device)
        for unit in units:
            if not unit.norm_rows:
                continue
            sumsq, bad = e.algo.grad_sumsq(e.backend, unit.norm_rows, unit.norm_segments, unit.table,
                                           unit.grad, it.grad_scale)
            stats[0] += sumsq
            stats[1] += bad
        stats[2] = float(it.edited)
        if self.world > 1:  # waited for by the side stream on CUDA, like the reductions
            collectives.all_reduce(stats, self.check_group).wait()
        e.grad_sumsq = stats[0]
        found = (stats[1:] > 0).any().to(torch.float32).reshape(1)
        it.edited = it.edited if self.side.asynchronous else bool(stats[2] > 0)  # a host value on the CPU
        clip = clip_coefficient(stats[0], max_norm) if max_norm is not None else None
        return found, clip

    def _start_gather(self, shard: BucketShard) -> None:
        """The updated slices of the shard group back into every member's parameter buffer, in place."""
        layout = shard.layout
        if layout.world_size == 1 or layout.shard == 0:
            return
        lo, hi = layout.slice_of(layout.rank)
        with range_push("fused_zero.all_gather"):
            shard.gather = collectives.all_gather(shard.param_buffer[:layout.head], shard.param_buffer[lo:hi],
                                                  self.gather_group)
