"""A param group added to an attached optimizer (``opt.add_param_group``), as torch.optim and
ZeroRedundancyOptimizer allow it: progressive unfreezing, a head trained first and the body after.

The group's parameters are ones DDP reduces and no fused_zero optimizer updates until now (the engine's
``NO_MEMBER``: kept out of the flat buffers and the state). They join the member of the optimizer, with
the group's hyperparameters: the shards of their buckets are built anew over the same buckets
(buckets/registry.py ``rebuild``: the layout depends on the bucket alone, so every other parameter's state
keeps its place), the joined parameters bound to the flat buffers, their state starting as torch.optim's
does (zero, made at their first step; fp32 masters taken from them), their step counts at zero. Where the
group changes the state the member keeps (an RMSprop group with momentum beside groups without), every
shard of the member is built anew. The hooks that know which parameters each module's forward waits for,
and which ones record a gradient, are registered again.

Between steps only: with no backward since the last step (the state does not move while an update or a
gather may still read it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..options import group_state_formats
from ..params import NO_MEMBER, member_params
from .reducing.weight_watch import refresh_masters

if TYPE_CHECKING:
    from ..options import ShardingOptions
    from .buckets.param_table import ParamTable


def check_joining(parameters: ParamTable, iteration, options: ShardingOptions, member, params: list) -> list[int]:
    """The engine's indices of ``params``, a new param group of ``member``'s optimizer, once checked:
    parameters DDP reduces (``parameters``, the engine's table: buckets/param_table.py), no fused_zero
    optimizer's, between steps (``iteration``: step_end/iteration.py), valid for ``options``.
    Changes nothing."""
    if iteration.invoked or iteration.stepped:
        raise RuntimeError(
            f"{member.name}: add_param_group() between a backward and the step of every fused_zero optimizer "
            "over the module: the state cannot move while the iteration's updates read it. Call it after "
            "step() (and before the next forward), as progressive unfreezing does")
    pids = []
    for p in params:
        pid = parameters.pid_of.get(p)
        if pid is None:
            raise ValueError(
                f"{member.name}: add_param_group() got a parameter of shape {tuple(p.shape)} that this DDP module "
                "does not reduce (not one of its parameters, or frozen when DDP was built: DDP reduces the "
                "parameters that required grad then; build the DDP module with them trainable)")
        owner = int(parameters.member_of[pid])
        if owner != NO_MEMBER:
            raise ValueError(f"{member.name}: add_param_group() got a parameter of shape {tuple(p.shape)} that "
                             f"{parameters.members[owner].name} already updates: give each parameter to one optimizer")
        pids.append(pid)
    options.check_params(params)
    return pids


def join(parameters: ParamTable, member, pids: list[int], default_format: str, *, ddp, registry, weights,
         updates) -> None:
    """``pids`` join ``member`` with its optimizer's last param group (the module docstring); its
    algorithm has already taken the new group (``refresh``). Once every all-gather is waited for; the
    engine registers the module hooks again after it. ``parameters``: the engine's table, written in
    place; ``registry``, ``weights``, ``updates``: the shards (buckets/registry.py), the weights' watch
    (reducing/weight_watch.py) and the updates' stage (updating/updates.py), which learn of the change."""
    opt = member.opt
    group = len(opt.param_groups) - 1
    member.group_formats = group_state_formats(opt.param_groups, default_format)
    for pid in pids:
        parameters.member_of[pid] = member.index
        parameters.group_of[pid] = group
        parameters.state_formats[pid] = member.group_formats[group]
    mine, _ = member_params(opt.param_groups, ddp)
    member.pids = np.asarray([parameters.pid_of[p] for p in mine], dtype=np.int64)  # its own order: its groups'
    parameters.regrouped(member.index)
    names = member.algo.state_names()
    changed = names != registry.state_names[member.index]
    registry.state_names[member.index] = names
    joined = set(pids)
    shards = [s for s in registry.shards()
              if joined.intersection(s.layout.pids) or (changed and member.index in s.member_set)]
    registry.rebuild(shards)
    for shard in registry.shards():
        if joined.intersection(shard.layout.pids):
            refresh_masters(shard, pids)
    weights.own(pids)
    updates.forget_members()


__all__ = ["check_joining", "join"]
