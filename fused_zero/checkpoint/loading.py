"""Loading torch.optim's canonical dict (ours or torch.optim's) into the ranks' regions, at any world
size and bucket layout: at once when the optimizer is attached, or kept until ``attach`` when it is not.

Frameworks load the optimizer's state right after they wrap the model, which can be before fused_zero
attaches (the Trainer loads ``optimizer.pt`` inside ``train()``; a callback attaching later comes too
late). A load before attach is as valid as one after:

- at load time, everything that does not need the bucket layout is checked (the dict's structure, the
  groups, the optimizer kind, every entry's keys, shapes and values, the masters against the weights),
  the param groups are updated as torch.optim updates them (so a scheduler set up next sees the loaded
  learning rates), and the per-parameter state is kept, indexed like this optimizer's own dict;
- at ``attach``, before the engine changes anything, the kept state is checked again against the DDP
  module's parameters and the sharding options (which can add ``master_weights=`` then), every rank
  learns whether any rank refused (or kept a state while another did not), and only then is the state
  laid out. A refused attach raises on every rank and leaves the optimizer unattached, with the state
  still kept, and the model and the DDP module untouched.

Load the model's weights first: master weights are checked against (or, without them in the dict,
start from) the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..options import ShardingOptions
from ..params import member_params
from ..pipeline.buckets.strides import memory_order
from ..pipeline.buckets.topology import world_and_rank
from ..pipeline.comm import collectives
from ..pipeline.members import Ranks
from . import checks
from .canonical import packed_groups, param_index
from .checks import MASTER_KEY, StateDictError


@dataclass
class Target:
    """What a dict is checked against: the faces ``checks`` reads of a member's view
    (pipeline/members.MemberView), or of an optimizer whose engine does not exist yet.

    Attributes:
        opt, algo: the optimizer and its algorithm; ``table.params`` the parameters it updates, in the
            engine's order; ``masters[i]`` whether parameter i keeps an fp32 master.
        ranks: the ranks that must agree (world 1: this rank alone), the device of the parameters, where
            their refusals travel (checks.agree).
    """

    opt: object
    algo: object
    table: object
    masters: list[bool]
    ranks: Ranks


def _target(opt, algo, params: list, masters: list[bool], world: int = 1, rank: int = 0, group=None,
            device=None) -> Target:
    return Target(opt, algo, SimpleNamespace(params=params), masters, Ranks(world, rank, group, device, None))


def _of_view(view) -> Target:
    """``view``: one optimizer's share of the engine (pipeline/members.MemberView), as everywhere here."""
    view.synchronize()  # the masters are compared with the parameters
    masters = ["master" in view.layout.where(i)[0].names for i in range(len(view.table.params))]
    return Target(view.opt, view.algo, view.table, masters, view.ranks)


def _params_in_order(opt) -> list:
    seen, out = set(), []
    for group in opt.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def load_state_dict(view, sd) -> None:
    """Load into an attached optimizer: every rank checks, all agree, then every rank applies."""
    target = _of_view(view)
    error, plan = _checked(target, sd)
    checks.agree(target, error)
    _apply(view, *plan)


def keep_until_attach(opt, sd) -> dict | None:
    """``load_state_dict`` of an unattached optimizer: check what can be checked, update the param groups,
    and return the per-parameter state to lay out at attach (None if the dict has none)."""
    options = ShardingOptions(**opt._options)
    params = _params_in_order(opt)
    target = _target(opt, opt._algorithm, params, [options.keeps_master(p.dtype) for p in params])
    error, (groups, entries) = _checked(target, sd)
    if error is not None:
        raise StateDictError(error + " (nothing was loaded: the optimizer is as it was)")
    for g, merged in zip(opt.param_groups, groups):
        g.update({k: v for k, v in merged.items() if k != "params"})
    opt._algorithm.refresh(opt.param_groups)
    index = param_index(opt)
    state = {index[id(p)]: entries[pid] for pid, p in enumerate(params) if entries[pid]}
    return {"state": state, "param_groups": packed_groups(opt, index)} if state else None


def kept_state_dict(opt, kept: dict | None) -> dict:
    """What ``state_dict()`` of an unattached optimizer returns: the kept state with the current groups."""
    return {"state": dict(kept["state"]) if kept else {}, "param_groups": packed_groups(opt, param_index(opt))}


def check_at_attach(opt, ddp, options: dict, kept: dict | None):
    """At ``attach``, before the engine exists: the kept state checked against what the engine will be,
    agreed on by every rank of the DDP group (a collective). Returns what ``apply_at_attach`` lays out,
    or None; raises StateDictError on every rank, having changed nothing."""
    sharding = ShardingOptions(**options)
    params, _ = member_params(opt.param_groups, ddp)
    group = ddp.process_group
    world, rank = world_and_rank(group)
    target = _target(opt, opt._algorithm, params, [sharding.keeps_master(p.dtype) for p in params], world, rank,
                     group, params[0].device)
    error, plan = (None, None) if kept is None else _checked(target, kept)
    if error is not None:
        error = f"the state loaded before attach does not fit: {error}"
    if world > 1:
        flags = torch.tensor([kept is not None, kept is None, error is not None], dtype=torch.int32,
                             device=params[0].device)
        collectives.all_reduce(flags, group, async_op=False, op=dist.ReduceOp.MAX)
        some_kept, some_not, refused = (bool(f) for f in flags.tolist())
        if some_kept and some_not and error is None:
            error = ("some ranks loaded an optimizer state before attach and others did not: load it on "
                     "every rank" + ("" if kept is None else f" (rank {rank} did)"))
        if refused or (some_kept and some_not):
            checks.agree(target, error)
    elif error is not None:
        raise StateDictError(error)
    return plan


def apply_at_attach(view, plan) -> None:
    _apply(view, *plan)


def _checked(target: Target, sd) -> tuple[str | None, tuple]:
    try:
        return None, _check(target, sd)
    except StateDictError as e:
        return str(e), (None, None)
    except Exception as e:  # a corrupt dict: whatever it trips over, it must not load
        return f"the state dict is malformed ({type(e).__name__}: {e})", (None, None)


def _check(target: Target, sd):
    """Everything a load needs, validated: the merged param groups and each parameter's saved entry
    (by the parameter's index in ``target.table.params``)."""
    algo = target.algo
    checks.check_structure(sd, algo)
    opt = target.opt
    groups = checks.merged_groups(opt, sd["param_groups"])
    checks.check_algorithm(target, groups)
    saved_index = {}
    for g, s in zip(opt.param_groups, sd["param_groups"]):
        for p, i in zip(g["params"], s["params"]):
            saved_index[id(p)] = i
    required = algo.state_names() + (["step"] if algo.keeps_step else [])
    group_of = {id(p): g for g, group in enumerate(groups) for p in group["params"]}
    entries = {}
    for pid, p in enumerate(target.table.params):
        key = saved_index[id(p)]
        entry = sd["state"].get(key, {})
        where = f"parameter {key} (shape {tuple(p.shape)})"
        group = groups[group_of[id(p)]]
        needs = [n for n in required if n == "step" or algo.group_has(n, group)]
        checks.check_entry(target, pid, where, entry, p.shape,
                           needs + [n for n in algo.kept_names if algo.kept_needed(n, p)])
        master = entry.get(MASTER_KEY)
        if master is not None and target.masters[pid]:
            if not torch.equal(master.detach().to(device=p.device, dtype=p.dtype), p.detach()):
                raise StateDictError(
                    f"{where}: its {MASTER_KEY!r} does not round to the parameter. Load the model's weights "
                    f"before the optimizer's state; if the dict was saved by another optimizer (which does "
                    f"not update {MASTER_KEY!r}), delete those entries to start the masters from the weights")
        entries[pid] = entry
    return groups, entries


def _apply(view, groups: list[dict], entries: dict[int, dict]) -> None:
    opt = view.opt
    for g, merged in zip(opt.param_groups, groups):
        g.update({k: v for k, v in merged.items() if k != "params"})
    view.algo.refresh(opt.param_groups)
    view.synchronize()
    hold = view.layout.rebuild_pending()  # 8-bit moments encoded once, in the rebuilt layout's blocks
    view.layout.held_decoded = view.layout.held_decoded or hold
    member = view.table.member
    for shard in view.layout.shards():
        shard.init_master_from_params(member)
        filled = {name: shard.values("master") if name == "master" else
                  torch.zeros(shard.layout.region_size, dtype=torch.float32, device=view.ranks.device)
                  for name in view.layout.names(shard)}
        for piece in shard.layout.pieces(shard.layout.rank):
            i = view.table.local_of.get(shard.layout.pids[piece.local])
            if i is None:
                continue  # another optimizer's parameter
            saved = entries[i]
            for name, region in filled.items():
                value = saved.get(MASTER_KEY if name == "master" else name)
                if value is None:
                    continue
                flat = memory_order(value.detach(), view.table.params[i])
                region[piece.region_off:piece.region_off + piece.length].copy_(
                    flat[piece.elem:piece.elem + piece.length])
        for name, region in filled.items():  # moments encoded in their format, as an update would
            if region is not shard.live(name, member):
                shard.load_values(name, region, hold, member)
    view.layout.masters_loaded()
    steps = view.steps
    for i, saved in entries.items():
        steps[i] = view.algo.saved_count(saved)
        load_kept(view, i, saved)
    view.steps = steps


def load_kept(view, i: int, saved: dict) -> None:
    """Parameter ``i``'s state kept on every rank beside the regions (canonical.kept_entries), from its
    saved entry; a parameter the dict has no state for makes it afresh at its first step."""
    if view.algo.kept_names:
        view.algo.load_kept(int(view.table.pids[i]), saved, view.ranks.device)
