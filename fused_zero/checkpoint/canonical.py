"""Optimizer state in torch.optim's canonical per-parameter form, gathered from and scattered to the
ranks' regions: a ``state_dict()`` of ours loads into ``torch.optim.AdamW`` (or Adam, SGD), and
theirs into ours, at any world size and bucket layout.

bf16/fp16 parameters carry one more entry, ``"fp32_master"`` (checks.MASTER_KEY): the fp32 master
weights, without which a resumed run restarts from rounded weights and drifts. torch.optim's
``load_state_dict`` keeps unknown keys as they are (cast to the parameter's dtype like the rest) and its
``step()`` never reads them; a dict without them (torch.optim's) starts the masters from the parameters.
Since torch.optim never updates that entry, a master that no longer rounds to its parameter is stale and
refused.

The layout module says where each element lives; this module only walks its pieces. With shard groups
(pipeline/topology.py) every shard group holds the whole state: the gathers run within one, and a
load fills each rank's region from the dict with no collective, whatever the sharding it was saved at.
"""

from __future__ import annotations

import torch

from ..pipeline import collectives
from ..pipeline.layout import REPLICATED, BucketLayout
from ..pipeline.strides import memory_order, strided_view
from . import checks
from .checks import MASTER_KEY, StateDictError
from .rank0 import CheckpointHandshake


def _full_into(engine, shard, name: str, out: torch.Tensor | None, to: int | None) -> None:
    """Write the whole bucket's values of one state tensor into ``out`` (bucket order; None on ranks
    that do not receive). A collective of the shard group: each shard group holds the whole state, so
    with ``to`` only ``to``'s shard group gathers, and the others have nothing to do."""
    layout: BucketLayout = shard.layout
    topo = engine.topology
    region = shard.state[name]
    mine, tail = slice(*layout.region_slice(layout.rank)), slice(*layout.region_tail(layout.rank))
    if layout.shard:
        if layout.world_size == 1:
            if out is not None:
                out[:layout.head].copy_(region[mine])
        elif to is None:
            collectives.all_gather(out[:layout.head], region[mine].contiguous(), topo.shard_group, async_op=False)
        else:
            replica, dst = topo.position(to)
            if replica == topo.replica:
                chunks = [out[r * layout.shard:(r + 1) * layout.shard] for r in range(layout.world_size)] if (
                    engine.rank == to) else None
                collectives.gather(region[mine].contiguous(), chunks, dst, topo.shard_group)
    if out is not None:
        out[layout.head:].copy_(region[tail])


def has_state(engine, pid: int) -> bool:
    """torch.optim creates a parameter's state on its first step (SGD: only with momentum)."""
    if engine.steps[pid] == 0:
        return False
    if engine.algo.kind == "sgd":
        return engine.opt.param_groups[engine.group_of[pid]]["momentum"] != 0
    return True


def param_index(opt) -> dict[int, int]:
    """id(parameter) -> its index in torch.optim's state dict (every parameter of every group)."""
    index = {}
    for group in opt.param_groups:
        for p in group["params"]:
            index.setdefault(id(p), len(index))
    return index


def packed_groups(opt, index: dict[int, int]) -> list[dict]:
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
            for g in opt.param_groups]


def install_rank0(engine, enabled: bool) -> CheckpointHandshake:
    """The rank-0-only ``state_dict()`` handshake (rank0.py), hooked into the engine's iteration: it posts
    from the training forward and serves lone state dicts before an iteration's first collective."""
    handshake = CheckpointHandshake(engine, enabled)
    engine.forward_start.append(handshake.at_forward)
    engine.iteration_start.append(
        lambda: handshake.at_iteration_start(lambda plan: gather_state_dict(engine, plan)))
    return handshake


def state_dict(engine, handshake: CheckpointHandshake, to: int | None = None) -> dict | None:
    """The canonical dict on CPU. Called on every rank, or on rank 0 alone (the others then join the
    gathers from their next backward; see rank0.py). ``to=None``: every calling rank gets it;
    ``to=r``: rank r only (others get None), gathered one bucket and one state tensor at a time, so that
    the extra device memory is one bucket's worth."""
    if to is not None and not (isinstance(to, int) and 0 <= to < engine.world):
        raise ValueError(f"to={to!r} is not a rank of the optimizer's process group (0..{engine.world - 1})")
    return handshake.state_dict(to, lambda plan: gather_state_dict(engine, plan))


def gather_state_dict(engine, to: int | None) -> dict | None:
    """The gathers behind ``state_dict()``; every rank runs them with the same ``to``."""
    engine.synchronize()
    opt = engine.opt
    index = param_index(opt)
    receives = to is None or engine.rank == to
    state: dict[int, dict] = {}
    for shard in engine.shards():
        stepped = [(local, pid) for local, pid in enumerate(shard.layout.pids) if has_state(engine, pid)]
        for name in shard.state:
            out = torch.empty(shard.layout.numel, dtype=torch.float32, device=engine.device) if receives else None
            _full_into(engine, shard, name, out, to)
            if not receives or not stepped:
                continue
            key = MASTER_KEY if name == "master" else name
            for local, pid in stepped:
                p = engine.params[pid]
                off, n = shard.layout.offsets[local], shard.layout.numels[local]
                state.setdefault(index[id(p)], {})[key] = strided_view(out[off:off + n], p).cpu().clone()
        if receives:
            for _, pid in stepped:
                entry = state.setdefault(index[id(engine.params[pid])], {})
                if engine.algo.kind == "adam":
                    entry["step"] = torch.tensor(float(engine.steps[pid]), dtype=torch.float32)
    if not receives:
        return None
    # torch.optim's order: step first, then the state tensors
    state = {k: dict(sorted(v.items(), key=lambda kv: kv[0] != "step")) for k, v in sorted(state.items())}
    return {"state": state, "param_groups": packed_groups(opt, index)}


def load_state_dict(engine, sd) -> None:
    """Load a canonical state dict (ours or torch.optim's) after checking all of it on every rank; a
    refused dict changes nothing. Load the model's weights first: master weights are checked against
    (or, without them in the dict, start from) the parameters."""
    error = None
    try:
        plan = _check(engine, sd)
    except StateDictError as e:
        error, plan = str(e), None
    except Exception as e:  # a corrupt dict: whatever it trips over, it must not load
        error, plan = f"the state dict is malformed ({type(e).__name__}: {e})", None
    checks.agree(engine, error)
    _apply(engine, *plan)


def _check(engine, sd):
    """Everything a load needs, validated: the merged param groups and each parameter's saved entry."""
    kind = engine.algo.kind
    checks.check_structure(sd, kind)
    opt = engine.opt
    groups = checks.merged_groups(opt, sd["param_groups"])
    checks.check_algorithm(engine, groups)
    saved_index = {}
    for g, s in zip(opt.param_groups, sd["param_groups"]):
        for p, i in zip(g["params"], s["params"]):
            saved_index[id(p)] = i
    required = engine.algo.state_names() + (["step"] if kind == "adam" else [])
    engine.synchronize()  # the masters are compared with the parameters
    entries = {}
    for pid, p in enumerate(engine.params):
        key = saved_index[id(p)]
        entry = sd["state"].get(key, {})
        where = f"parameter {key} (shape {tuple(p.shape)})"
        checks.check_entry(engine, pid, where, entry, p.shape, required)
        master = entry.get(MASTER_KEY)
        if master is not None and "master" in engine.registry.where[pid][0].state:
            if not torch.equal(master.detach().to(device=p.device, dtype=p.dtype), p.detach()):
                raise StateDictError(
                    f"{where}: its {MASTER_KEY!r} does not round to the parameter. Load the model's weights "
                    f"before the optimizer's state; if the dict was saved by another optimizer (which does "
                    f"not update {MASTER_KEY!r}), delete those entries to start the masters from the weights")
        entries[pid] = entry
    return groups, entries


def _apply(engine, groups: list[dict], entries: dict[int, dict]) -> None:
    opt = engine.opt
    for g, merged in zip(opt.param_groups, groups):
        g.update({k: v for k, v in merged.items() if k != "params"})
    engine.algo.refresh(opt.param_groups)
    engine.synchronize()
    for shard in engine.shards():
        for region in shard.state.values():
            region.zero_()
        shard.init_master_from_params()
        for piece in shard.layout.pieces(shard.layout.rank):
            pid = shard.layout.pids[piece.local]
            saved = entries[pid]
            for name, region in shard.state.items():
                value = saved.get(MASTER_KEY if name == "master" else name)
                if value is None:
                    continue
                flat = memory_order(value.detach(), engine.params[pid])
                region[piece.region_off:piece.region_off + piece.length].copy_(
                    flat[piece.elem:piece.elem + piece.length])
    for pid, saved in entries.items():
        engine.steps[pid] = saved_step(engine, saved)


def saved_step(engine, saved: dict) -> float:
    if engine.algo.kind == "sgd" and "step" not in saved:
        return 1.0 if saved.get("momentum_buffer") is not None else 0.0
    step = saved.get("step", 0.0)
    return float(step.item() if isinstance(step, torch.Tensor) else step)


def is_state_init_step(engine) -> bool:
    """Whether a step() with no backward before it is torch's state initialization
    (torch.distributed.checkpoint.state_dict._init_optim_state): no state yet, every gradient a zero
    tensor, every learning rate 0. torch.optim then only creates zero state (Adam: step 1)."""
    if engine.steps.any():
        return False
    if any(float(g.get("lr", 0.0)) != 0.0 for g in engine.opt.param_groups):
        return False
    return all(p.grad is not None and not bool(p.grad.any()) for p in engine.params)


def run_state_init_step(engine) -> None:
    """What torch.optim's step does with zero gradients at lr 0 on a fresh optimizer: the moments stay
    zero and the parameters unchanged; only the step counts advance."""
    engine.steps += 1


def local_entry(engine, pid: int) -> dict:
    """``opt.state[p]``: a snapshot of this rank's share of a parameter's state, with no collective.
    ``step`` as torch.optim keeps it; each state tensor (and ``fp32_master``) flattened (in the
    parameter's memory order, pipeline/strides.py), holding only
    the elements of the parameter that this rank updates (its slices, then the replicated tail)."""
    shard, local = engine.registry.where[pid]
    me = shard.layout.rank
    runs = [(region_off, hi - lo) for lo, hi, owner, region_off in shard.layout.owners(local, me)
            if owner in (me, REPLICATED)]
    entry = {}
    if engine.algo.kind == "adam":
        entry["step"] = torch.tensor(float(engine.steps[pid]), dtype=torch.float32)
    engine.synchronize()
    for name, region in shard.state.items():
        parts = [region[off:off + n] for off, n in runs]
        value = torch.cat(parts) if parts else region[:0].clone()
        entry[MASTER_KEY if name == "master" else name] = value
    return entry
