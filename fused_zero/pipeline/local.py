"""One process without DDP: a plain ``nn.Module`` trained by the same engine, at world size 1.

Without DDP nothing hands the engine buckets during the backward, and nothing needs to: there is
nothing to reduce. ``LocalModule`` stands where the DDP module would (the few attributes the engine
reads of DDP), and each optimizer's ``step()`` hands the engine one bucket per parameter dtype, a flat
copy of its parameters' ``param.grad`` as it is then (the other optimizers' as having none), before its
update runs and the iteration ends as ``overlap="step"`` ends it. So gradients
accumulate in ``param.grad`` over any number of backwards, edits of ``.grad`` (clipping,
``scaler.unscale_``) and late hyperparameters are honored, and a parameter whose ``.grad`` is None is
skipped, as torch.optim does. The copy costs one pass over the gradients per step.

A DDP module built under ``torch._dynamo.config.optimize_ddp = "python_reducer"`` (compiled autograd's
DDP) takes the same path at any world size (``PythonReducerDDP``). Its C++ reducer keeps no buckets: each
parameter's post-accumulate-grad hook, traced into the compiled autograd graph, all-reduces that
``param.grad`` alone (divided by W first, through functional collectives), and calls a registered comm
hook instead with ``(param.grad, param)`` in place of a bucket, its return value dropped: no bucket to
shard, no index, no future. So fused_zero registers no comm hook there; DDP leaves ``param.grad`` its
average, as it does for DDP + torch.optim, and ``step()`` hands it over as above; the engine reduces
nothing again (``reduces``), updates this rank's slice and gathers the slices into every rank's
parameters. The state stays sharded; the gradients travel in DDP's all-reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from .buckets.strides import strided_view

if TYPE_CHECKING:
    from .buckets.param_table import ParamTable

OVERRIDES = {"overlap": "step", "grad_reduce": "all_reduce"}
"""The modes a local module runs in: the update reads ``param.grad`` at ``step()``; at world size 1
the other modes differ only in when DDP's comm hook would have run, and there is no comm hook."""


def refuse_plain_module_in_group(module: nn.Module) -> None:
    """A plain module while a process group of several ranks exists: each rank would step on its own
    gradients and the replicas would drift apart. Refused before anything changes."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        kind = f"{type(module).__module__}.{type(module).__qualname__}"
        raise TypeError(
            f"ddp got a plain {kind} while a process group of {dist.get_world_size()} ranks is initialized: "
            "wrap the model first, ddp = DistributedDataParallel(model), and pass ddp "
            "(a plain module trains in one process only, with no process group or a group of one rank)")


class _Bucket:
    """What the engine reads of a DDP ``GradBucket``."""

    def __init__(self, index: int, buffer: torch.Tensor, params: list, grads: list, last: bool):
        self._index, self._buffer, self._params, self._grads, self._last = index, buffer, params, grads, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list:
        return self._params

    def gradients(self) -> list:
        return self._grads

    def is_last(self) -> bool:
        return self._last


class LocalModule:
    """The DDP module's place for a plain module: no process group, no comm hook to call.

    ``find_unused_parameters`` is True so that the engine learns, every step, which parameters have a
    ``.grad`` (``drive`` sets them): torch.optim skips the others."""

    find_unused_parameters = True
    static_graph = False
    process_group = None

    def __init__(self, module: nn.Module):
        self.module = module
        self._comm_hooks: list = []
        self.comm_hook_state = None

    def register_comm_hook(self, state, hook) -> None:
        self.comm_hook_state = state

    def drive(self, parameters: ParamTable, used_local, hand, member) -> bool:
        """Hand the comm hook (``hand``: the engine's ``on_bucket``) this step's gradients of ``member``'s
        parameters (pipeline/members.py), one bucket per dtype in registration order (the engine's
        initial layout, so no state moves), each parameter's "got a gradient" flag into ``used_local``
        (the reduction's); the other members' parameters are handed as having none, and step at their
        own ``step()``. ``parameters``: the engine's parameter table (buckets/param_table.py). False when none
        of the member's parameters has a ``.grad``: then torch.optim's step does nothing, and so does
        this one."""
        mine = {int(pid) for pid in member.pids}
        by_dtype: dict[torch.dtype, list[int]] = {}
        for p in self.module.parameters():
            if p in parameters.pid_of:
                by_dtype.setdefault(p.dtype, []).append(parameters.pid_of[p])
        if all(parameters.tensors[pid].grad is None for pid in mine):
            return False
        for index, (dtype, pids) in enumerate(by_dtype.items()):
            params = [parameters.tensors[pid] for pid in pids]
            buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype,
                                 device=parameters.tensors[0].device)  # the engine's device
            grads, offset = [], 0
            for pid, p in zip(pids, params):
                view = strided_view(buffer[offset:offset + p.numel()], p)  # as DDP lays a gradient out
                used = pid in mine and p.grad is not None
                if used:
                    view.copy_(p.grad)
                used_local[pid] = used
                grads.append(view)
                offset += p.numel()
            hand(_Bucket(index, buffer, params, grads, index == len(by_dtype) - 1))
        return True


def uses_python_reducer(ddp) -> bool:
    """Whether ``ddp`` was built under ``optimize_ddp="python_reducer"``: DDP reads the setting once, in its
    constructor, and keeps it as ``_use_python_reducer`` (torch 2.11 to 2.15)."""
    return bool(getattr(ddp, "_use_python_reducer", False))


class PythonReducerDDP(LocalModule):
    """A python-reducer DDP module's place (module docstring): its gradients are handed from ``step()``, as
    a plain module's, already averaged by DDP over its process group. It keeps the DDP module's process
    group (the shards' and the all-gathers'), its ignored parameters and its comm hooks (a comm hook of
    the user's is refused as on any DDP module)."""

    reduces = True
    """``param.grad`` is DDP's average when ``step()`` reads it: the engine does not reduce it again."""

    def __init__(self, ddp):
        super().__init__(ddp.module)
        self.ddp = ddp
        self.process_group = ddp.process_group
        self.parameters_to_ignore = getattr(ddp, "parameters_to_ignore", ())
        self._comm_hooks = getattr(ddp, "_comm_hooks", [])  # DDP's own list: a hook the user registered

    def _get_ddp_logging_data(self) -> dict:
        return self.ddp._get_ddp_logging_data()
