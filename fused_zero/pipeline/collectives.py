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


def backend_of(group, device: torch.device | None = None) -> str:
    """The backend that runs ``group``'s collectives on ``device``'s tensors ("gloo", "nccl", ...): a group
    made with one backend per device ("cpu:gloo,cuda:nccl") names each."""
    name = dist.get_backend(group)
    if ":" in name:
        parts = dict(p.split(":", 1) for p in name.split(","))
        return parts.get(device.type if device is not None else "cpu", name)
    return name


def reduce_scatter_has_future(group) -> bool:
    """Whether a reduce-scatter's Work has a Future (NCCL's has; gloo's raises "not implemented")."""
    return backend_of(group) == "nccl"


def all_reduce_replaces_reduce_scatter(group, device: torch.device | None = None) -> bool:
    """Whether the bucket's reduction should be one in-place all-reduce, this rank's slice read from it,
    instead of a reduce-scatter. On gloo it should: ProcessGroupGloo's reduce-scatter all-reduces a full
    clone of its input and then copies this rank's chunk out, so the in-place all-reduce computes the
    same values with one copy of the bucket less, and its Work has a Future (DDP then waits for the
    reduction before it reads the bucket). NCCL keeps its reduce-scatter: half the bytes of an
    all-reduce."""
    return backend_of(group, device) == "gloo"


REDUCE_DTYPES = {"gloo": (torch.float32, torch.bfloat16, torch.float16),
                 "nccl": (torch.float32, torch.bfloat16, torch.float16)}
"""What each backend sums (NCCL: bfloat16 from NCCL 2.10, checked where it is used)."""


def reduces_in(group, dtype: torch.dtype, device: torch.device | None = None) -> bool:
    """Whether ``group``'s backend can sum ``dtype`` tensors (the checks of ``grad_reduce_dtype``)."""
    backend = backend_of(group, device)
    if dtype not in REDUCE_DTYPES.get(backend, (torch.float32,)):
        return False
    if backend == "nccl" and dtype == torch.bfloat16:
        version = torch.cuda.nccl.version() if torch.cuda.is_available() else (0,)
        return tuple(version) >= (2, 10)
    return True
