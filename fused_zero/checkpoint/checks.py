"""Checks a state dict passes before anything is loaded from it: a refused load must leave the running
optimizer exactly as it was (parameters, state, ``param_groups``), so every check runs first and the
loaders only mutate once all of them passed, on every rank.

The error names the first difference found, in the optimizer's parameter order.
"""

from __future__ import annotations

import copy
import math

import torch

from ..algorithms import registry
from ..pipeline.comm import collectives

MASTER_KEY = "fp32_master"
"""The canonical dict's per-parameter entry holding the fp32 master weights of a bf16/fp16 parameter.
torch.optim loads it as an unknown key (carried along, never read), see canonical.py."""

class StateDictError(ValueError):
    """A state dict that cannot be loaded; nothing was changed."""


def check_structure(sd, algo) -> None:
    """The outer shape: what a truncated file or an unrelated object fails; every param group holds the
    keys of ``algo``'s kind (algorithms/interface.Algorithm.group_keys), or the dict is another kind's."""
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) or not isinstance(
            sd.get("param_groups"), list):
        keys = f" with keys {sorted(map(str, sd))}" if isinstance(sd, dict) else ""
        raise StateDictError("not an optimizer state dict (need a dict with 'state' and 'param_groups', got "
                             f"{type(sd).__name__}{keys})")
    for i, g in enumerate(sd["param_groups"]):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            raise StateDictError(f"param group {i} of the state dict has no 'params' list")
        missing = [k for k in algo.group_keys if k not in g]
        if missing:
            other = registry.resembling(g, type(algo))
            hint = f": it looks like {other.title} state" if other else ""
            raise StateDictError(f"param group {i} of the state dict lacks {missing}, which "
                                 f"{algo.title} needs{hint}")


def merged_groups(opt, saved_groups: list) -> list[dict]:
    """The param groups as they will be after the load (copies; the optimizer's are not touched). A
    group's ``state_format`` stays the optimizer's: it lays out the state, and a checkpoint's moments
    (fp32 in every saved form) load into whatever format the optimizer keeps."""
    if len(saved_groups) != len(opt.param_groups):
        raise StateDictError(f"the state dict has {len(saved_groups)} param groups, the optimizer "
                             f"{len(opt.param_groups)}")
    out = []
    for i, (g, s) in enumerate(zip(opt.param_groups, saved_groups)):
        if len(g["params"]) != len(s["params"]):
            raise StateDictError(f"param group {i} has {len(g['params'])} parameters, the state dict's "
                                 f"{len(s['params'])}")
        merged = {k: copy.deepcopy(v) for k, v in s.items() if k not in ("params", "state_format")}
        merged["params"] = g["params"]
        if "state_format" in g:
            merged["state_format"] = g["state_format"]
        out.append(merged)
    return out


def check_algorithm(view, groups: list[dict]) -> None:
    """The groups' hyperparameters pass the algorithm's checks and need the state the optimizer has."""
    probe = copy.copy(view.algo)
    try:
        probe.refresh(groups)
    except ValueError as e:
        raise StateDictError(f"the state dict's param groups are refused: {e}") from None
    if probe.state_names() != view.algo.state_names():
        raise StateDictError(f"the state dict's settings need state {probe.state_names()}, the optimizer was "
                             f"built with {view.algo.state_names()}; build it with the same amsgrad / "
                             "momentum settings")


def check_entry(view, pid: int, where: str, entry, shape, required: list[str]) -> None:
    """One parameter's saved state: no foreign keys, every required tensor, shapes, finite values.
    ``shape``: the shape each state tensor must have (the parameter's, or a flat local share)."""
    if not isinstance(entry, dict):
        raise StateDictError(f"{where}: the state entry is a {type(entry).__name__}, not a dict")
    algo = view.algo
    foreign = [k for k in registry.foreign_state(type(algo)) if entry.get(k) is not None]
    if foreign:
        raise StateDictError(f"{where} has {foreign}: that is not {algo.title} state (the state dict "
                             "was saved by another kind of optimizer)")
    if not entry:
        return  # a parameter that has not stepped yet
    for name in required:
        if entry.get(name) is None:
            raise StateDictError(f"{where} lacks {name!r}, which {algo.title} needs")
    for name, value in entry.items():
        if name in algo.kept_names:  # kept on every rank, in its own shape (algorithms/elementwise.py, adafactor.py)
            error = algo.check_kept(name, value, view.table.params[pid].shape)
            if error is not None:
                raise StateDictError(f"{where}: {error}")
            continue
        if name == "step":
            step = float(value.item() if isinstance(value, torch.Tensor) else value)
            if not (math.isfinite(step) and step >= 0 and step == int(step)):
                raise StateDictError(f"{where}: step is {step}, not a count")
            continue
        if not isinstance(value, torch.Tensor):
            continue
        if tuple(value.shape) != tuple(shape):
            raise StateDictError(f"{where}: state {name!r} has shape {tuple(value.shape)}, the parameter "
                                 f"needs {tuple(shape)}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise StateDictError(f"{where}: state {name!r} holds non-finite values")


def agree(view, error: str | None) -> None:
    """Every rank learns whether any rank refused; all raise (the first refusing rank's message) or none
    does. Without this a rank with a corrupt copy would refuse while the others go on and mutate.

    The messages travel as bytes in tensors on the parameters' device, through the optimizer's own
    collectives: ``all_gather_object`` would put its tensors on the *current* device, which under NCCL,
    in a script that never calls ``torch.cuda.set_device``, is cuda:0 on every rank."""
    errors = [error]
    if view.ranks.world > 1:
        errors = _gather_messages(view, error)
    for rank, e in enumerate(errors):
        if e is not None:
            prefix = "" if rank == view.ranks.rank else f"rank {rank} refused the state dict: "
            raise StateDictError(prefix + e)


def _gather_messages(view, message: str | None) -> list[str | None]:
    """Every rank's ``message`` (None: no message), on every rank: the lengths, then the bytes."""
    device, world = view.ranks.device, view.ranks.world
    data = (message or "").encode()[:_MESSAGE_BYTES]
    lengths = torch.zeros(world, dtype=torch.int64, device=device)
    mine = torch.tensor([0 if message is None else len(data) + 1], dtype=torch.int64, device=device)
    collectives.all_gather(lengths, mine, view.ranks.group, async_op=False)
    lengths = lengths.tolist()
    width = max(lengths)
    if width == 0:
        return [None] * world
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    if data:
        buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8, device=device)
    everyone = torch.empty(world * width, dtype=torch.uint8, device=device)
    collectives.all_gather(everyone, buf, view.ranks.group, async_op=False)
    everyone = everyone.cpu().tolist()
    return [None if n == 0 else bytes(everyone[r * width:r * width + n - 1]).decode(errors="replace")
            for r, n in enumerate(lengths)]


_MESSAGE_BYTES = 4096
"""Longest refusal message sent (bytes); longer ones are cut."""
