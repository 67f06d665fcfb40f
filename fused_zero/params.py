"""The parameters an optimizer updates, collected and checked where the optimizer is built: which of them
the DDP module reduces (``ddp_params``, less ``parameters_to_ignore``), each optimizer's own, checked one
by one (``member_params``: dtype, dense storage, not sparse, one device), and all of them as the engine
numbers them (``collect_params``: every optimizer's over one DDP module, in attach order, then the ones no
fused_zero optimizer updates, member ``NO_MEMBER``). The options themselves are options.py's."""

from __future__ import annotations

import numpy as np
import torch

from .options import PARAM_DTYPES


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive storage slots, in any order of dimensions
    (row-major, channels_last, any permutation): what DDP's bucket views and ours need."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def ddp_params(ddp) -> list[torch.nn.Parameter]:
    """The parameters DDP reduces: those requiring grad, less ``parameters_to_ignore``."""
    ignored = {id(p) for name, p in ddp.module.named_parameters()
               if name in getattr(ddp, "parameters_to_ignore", ())}
    return [p for p in ddp.module.parameters() if p.requires_grad and id(p) not in ignored]


def param_name(ddp, p) -> str:
    """How a user finds a parameter of the DDP module: its name there, and its shape."""
    name = next((n for n, q in ddp.module.named_parameters() if q is p), None)
    return f"{name or 'a parameter'} (shape {tuple(p.shape)})"


def member_params(param_groups: list[dict], ddp) -> tuple[list[torch.nn.Parameter], np.ndarray]:
    """The parameters one optimizer updates (those requiring grad), each with its group index, checked
    one by one: each must be one that the DDP module reduces, of a dtype and a memory layout fused_zero
    updates. Whether every parameter DDP reduces is some optimizer's is ``collect_params``'s question."""
    ddp_ids = {id(p) for p in ddp_params(ddp)}
    params, group_of, seen = [], [], set()
    for gi, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            if p.is_sparse or getattr(p, "layout", torch.strided) != torch.strided:
                raise ValueError(f"param group {gi}, parameter {i}: sparse parameters are not supported")
            if p.requires_grad and p.dtype not in PARAM_DTYPES:
                raise ValueError(f"param group {gi}, parameter {i} (shape {tuple(p.shape)}) is {p.dtype}: fused_zero "
                                 "keeps fp32 optimizer state and updates float32, bfloat16 and float16 parameters; "
                                 "convert the model (model.float()) before wrapping it in DDP, or keep torch.optim "
                                 "for float64 training")
            if p.requires_grad and not _dense(p):
                raise ValueError(f"param group {gi}, parameter {i} (shape {tuple(p.shape)}, strides {p.stride()}) "
                                 "does not fill its storage densely (an expanded or overlapping view): make it "
                                 "a parameter of its own, e.g. nn.Parameter(p.detach().clone())")
            if id(p) not in ddp_ids and p.requires_grad:
                raise ValueError(
                    f"param group {gi}, parameter {i} (shape {tuple(p.shape)}) is not a parameter that "
                    "the DDP module reduces; build the optimizer from ddp.parameters()")
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
                group_of.append(gi)
    if not params:
        raise ValueError("the optimizer has no trainable parameters")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
    for module in ddp.module.modules():
        if getattr(module, "sparse", False) and isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            raise ValueError(f"{type(module).__name__}(sparse=True) produces sparse gradients, which "
                             "fused_zero does not support; use sparse=False")
    return params, np.asarray(group_of, dtype=np.int64)


def unowned(ddp, owned: set[int]) -> list[torch.nn.Parameter]:
    """The parameters DDP reduces that no optimizer of ``owned`` (ids) updates, in registration order."""
    return [p for p in ddp_params(ddp) if id(p) not in owned]


def collect_params(members: list[list[dict]], ddp) -> tuple[list[torch.nn.Parameter], np.ndarray, np.ndarray]:
    """The parameters DDP reduces, as the engine numbers them: every optimizer's over ``ddp`` (their param
    groups, in attach order), each with its optimizer's index and its group index there, then the ones
    no fused_zero optimizer updates (member ``NO_MEMBER``: reduced as DDP reduces them, their ``.grad``
    DDP's average, and left to their owner, a torch.optim optimizer or none). A parameter given to two
    optimizers is refused."""
    params, member_of, group_of, owner = [], [], [], {}
    for m, groups in enumerate(members):
        mine, groups_of = member_params(groups, ddp)
        for p, g in zip(mine, groups_of):
            if id(p) in owner:
                raise ValueError(f"{param_name(ddp, p)} is given to optimizers {owner[id(p)]} and {m} over one DDP "
                                 "module: give each parameter to one optimizer")
            owner[id(p)] = m
            params.append(p)
            member_of.append(m)
            group_of.append(int(g))
    for p in unowned(ddp, set(owner)):
        params.append(p)
        member_of.append(NO_MEMBER)
        group_of.append(0)
    return params, np.asarray(member_of, dtype=np.int64), np.asarray(group_of, dtype=np.int64)


NO_MEMBER = -1
"""The member index of a parameter DDP reduces that no fused_zero optimizer updates (``collect_params``)."""
