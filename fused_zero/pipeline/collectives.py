"""Every collective fused_zero issues, in one place: callers use ``collectives.<name>(...)``, looked up at
call time, so that the stream-order checker (fused_zero/streamcheck) can stand in for them and record
which stream each one follows and which tensors it reads and writes.

The flat-tensor collectives carry this torch's names: 2.13 renamed them (``reduce_scatter_single``,
``all_gather_single``); 2.11 and 2.12 have only the old ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce(t: torch.Tensor, group, async_op: bool = True):
    return dist.all_reduce(t, group=group, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    return _reduce_scatter(out, inp, group=group, async_op=async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    return _all_gather(out, inp, group=group, async_op=async_op)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)


def gather(t: torch.Tensor, chunks: list[torch.Tensor] | None, dst: int, group):
    """``dst`` is a rank of ``group``."""
    return dist.gather(t, chunks, dst=dist.get_global_rank(group, dst), group=group)


def broadcast(t: torch.Tensor, src: int, group):
    """``src`` is a rank of ``group``."""
    return dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)


def reduce_scatter_has_future(group) -> bool:
    """Whether a reduce-scatter's Work has a Future (NCCL's has; gloo's raises "not implemented")."""
    return dist.get_backend(group) == "nccl"
