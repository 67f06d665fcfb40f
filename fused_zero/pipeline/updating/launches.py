"""The launches that update a step's buckets: one per bucket, member and state format (each part of a
shard, shard.py), or, once the shards sit in arenas (overlap modes ``backward`` and ``step``, arena.py),
one per dtype, member and state format over all of them; a member that updates in phases (Muon's,
whole_matrix.py) always by part. A part of the updates' stage (updates.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..buckets.shard import BucketShard
from ..reducing.reduction import Reduced, UsedFlags

if TYPE_CHECKING:
    from ..buckets.param_table import ParamTable


def identity(x) -> object:
    """What a captured launch fixes of ``x`` (the key of a step's graph, step_graph.py): a tensor's
    address, shape, strides and dtype; a container's items'; a number as it is; an object's
    ``graph_identity()`` where it has one."""
    if isinstance(x, torch.Tensor):
        return ("tensor", x.data_ptr(), tuple(x.shape), x.stride(), x.dtype)
    if hasattr(x, "graph_identity"):
        return x.graph_identity()
    if isinstance(x, (tuple, list)):
        return tuple(identity(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, identity(v)) for k, v in x.items())
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return ("object", id(x))  # layout objects: kept alive with the graph, so the id is not reused


@dataclass
class Unit:
    """One update launch: a member's rows (and norm rows), its coefficient table and buffers, its parts
    and the shards it covers: a bucket's state may take several launches (one per member and state
    format), and its all-gather starts after the last."""

    member: int
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
    parts: list
    shards: list

    def graph_identity(self) -> tuple:
        """What a CUDA graph of this launch fixes (step_graph.py): the row tables by object (the
        launch's or the part's own, kept while the layout stays), the buffers by address."""
        grad = getattr(self.grad, "buffers", self.grad)  # the torch backend's BucketGrads: its buffers
        return (self.member, id(self.rows), id(self.segments), id(self.blocks), id(self.norm_rows),
                id(self.norm_segments), identity((self.table, grad, self.param, self.state, self.scales)))


def launch_units(parameters: ParamTable, single_launch, coefficients, iteration, items: list[Reduced], coefs: list,
                 members: list[int]) -> list[Unit]:
    """The launches that update ``members``' parameters of ``items``: one per dtype, member and state
    format when the arenas hold exactly these shards and one table per member serves them all, else
    one per bucket, member and state format (and always one per part for a member that updates in
    phases). The norm pass reads each part's counted gradients in its launch. ``coefficients``: the
    step's CoefficientTables (tables.py), ``coefs`` the tables each item's update reads; ``parameters`` the
    engine's parameter table (buckets/param_table.py), ``single_launch`` the arenas' launches
    (buckets/arena.py) or None."""
    phased = {m.index for m in parameters.members if m.algo.runs.phased}
    launches = single_launch.for_step([item.shard for item in items], skip=phased) if single_launch else None
    tables = _one_table(len(parameters.tensors), coefficients, iteration, items, coefs, members) \
        if launches is not None else None
    if tables is None:
        return [_part_unit(part, item.shard, t[part.member])
                for item, t in zip(items, coefs) for part in item.shard.parts if part.member in members]
    units = [Unit(launch.fs.key[0], launch.rows, launch.segments, launch.blocks, launch.norm_rows,
                  launch.norm_segments, tables[launch.fs.key[0]], launch.grad(buffers), launch.arena.params,
                  launch.fs.state, launch.fs.scales, [p for p in launch.fs.parts if p is not None],
                  [s for s, p in zip(launch.arena.shards, launch.fs.parts) if p is not None])
             for launch, buffers in launches if launch.fs.key[0] in members]
    units += [_part_unit(part, item.shard, tables[part.member])
              for item in items for part in item.shard.parts if part.member in phased and part.member in members]
    return units


def _part_unit(part, shard: BucketShard, table: torch.Tensor) -> Unit:
    return Unit(part.member, part.rows, part.segments, part.blocks, part.norm_rows, part.norm_segments, table,
                shard.reduced_buffer, shard.param_buffer, part.state, part.scales, [part], [shard])


def _one_table(n: int, coefficients, iteration, items: list[Reduced], coefs: list, members: list[int]) -> dict | None:
    """One coefficient table per member for every bucket of the step (a parameter is in one bucket
    only): the iteration's shared ones, or ones built from the host's flags where some parameter is
    known to have no gradient; None where neither fits (then one launch per bucket). ``n``: the engine's
    parameters."""
    if all(t[m] is coefs[0][m] for t in coefs for m in members):
        return coefs[0]
    if any(isinstance(item.active, UsedFlags) for item in items):
        return None
    mask = np.ones(n)
    for item in items:
        mask[item.shard.pids] = item.active
    return coefficients.build(iteration, mask, members)
