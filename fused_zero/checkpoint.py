"""Optimizer state in torch.optim's canonical per-parameter form, gathered from and scattered to the
ranks' regions: a ``state_dict()`` of ours loads into ``torch.optim.AdamW`` (or Adam, SGD), and
theirs into ours, at any world size and bucket layout.

The layout module says where each element lives; this module only walks its pieces.
"""

from __future__ import annotations

import torch

from .collectives import all_gather
from .layout import BucketLayout


def _full(engine, shard, name: str) -> torch.Tensor:
    """The whole bucket's values of one state tensor, in bucket order (a collective)."""
    layout: BucketLayout = shard.layout
    region = shard.state[name]
    full = torch.empty(layout.numel, dtype=region.dtype, device=region.device)
    if layout.shard:
        if engine.world > 1:
            all_gather(full[:layout.head], region[:layout.shard].contiguous(), group=engine.group)
        else:
            full[:layout.head].copy_(region[:layout.shard])
    full[layout.head:].copy_(region[layout.shard:])
    return full


def _has_state(engine, pid: int) -> bool:
    """torch.optim creates a parameter's state on its first step (SGD: only with momentum)."""
    if engine.steps[pid] == 0:
        return False
    if engine.algo.kind == "sgd":
        return engine.opt.param_groups[engine.group_of[pid]]["momentum"] != 0
    return True


def state_dict(engine) -> dict:
    """Every rank must call this (it all-gathers); every rank gets the whole dict, on CPU."""
    engine.synchronize()
    opt = engine.opt
    index, groups = {}, []
    for group in opt.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = []
        for p in group["params"]:
            index.setdefault(id(p), len(index))
            packed["params"].append(index[id(p)])
        groups.append(packed)
    names = engine.algo.state_names()
    state = {}
    for shard in engine.shards():
        fulls = {n: _full(engine, shard, n).cpu() for n in names}
        for local, pid in enumerate(shard.layout.pids):
            if not _has_state(engine, pid):
                continue
            p = engine.params[pid]
            off, n = shard.layout.offsets[local], shard.layout.numels[local]
            entry = {}
            if engine.algo.kind == "adam":
                entry["step"] = torch.tensor(float(engine.steps[pid]), dtype=torch.float32)
            for name in names:
                entry[name] = fulls[name][off:off + n].view(p.shape).clone()
            state[index[id(p)]] = entry
    return {"state": state, "param_groups": groups}


def load_state_dict(engine, sd: dict) -> None:
    """Load a canonical state dict. Load the model's weights first: master weights start from them."""
    opt = engine.opt
    saved_groups = sd["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"the state dict has {len(saved_groups)} param groups, the optimizer "
                         f"{len(opt.param_groups)}")
    for i, (g, s) in enumerate(zip(opt.param_groups, saved_groups)):
        if len(g["params"]) != len(s["params"]):
            raise ValueError(f"param group {i} has {len(g['params'])} parameters, the state dict's "
                             f"{len(s['params'])}")
    index_of = {}
    for g, s in zip(opt.param_groups, saved_groups):
        for p, i in zip(g["params"], s["params"]):
            index_of[id(p)] = i
        g.update({k: v for k, v in s.items() if k != "params"})
    names = engine.algo.state_names()
    engine.algo.refresh(opt.param_groups)
    if engine.algo.state_names() != names:
        raise ValueError(f"the state dict's settings need state {engine.algo.state_names()}, the optimizer "
                         f"was built with {names}; build it with the same amsgrad / momentum settings")
    engine.synchronize()
    for shard in engine.shards():
        for n in names:
            shard.state[n].zero_()
        shard.init_master_from_params()
        pieces_of = {}
        for piece in shard.layout.pieces(engine.rank):
            pieces_of.setdefault(piece.local, []).append(piece)
        for local, pid in enumerate(shard.layout.pids):
            p = engine.params[pid]
            saved = sd["state"].get(index_of[id(p)], {})
            engine.steps[pid] = _saved_step(engine, saved)
            for name in names:
                value = saved.get(name)
                if value is None:
                    continue
                if value.shape != p.shape:
                    raise ValueError(f"state {name!r} of a parameter of shape {tuple(p.shape)} has shape "
                                     f"{tuple(value.shape)}")
                flat = value.detach().reshape(-1).to(shard.state[name])
                for piece in pieces_of.get(local, ()):
                    shard.state[name][piece.region_off:piece.region_off + piece.length].copy_(
                        flat[piece.elem:piece.elem + piece.length])


def _saved_step(engine, saved: dict) -> float:
    if engine.algo.kind == "sgd":
        return 1.0 if saved.get("momentum_buffer") is not None else 0.0
    step = saved.get("step", 0.0)
    return float(step.item() if isinstance(step, torch.Tensor) else step)
