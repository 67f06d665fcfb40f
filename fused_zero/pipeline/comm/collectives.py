"""Every collective fused_zero issues, in one place: callers use ``collectives.<name>(...)``, looked up at
call time, so that the stream-order checker (fused_zero/testing/streamcheck) can stand in for them and record
which stream each one follows and which tensors it reads and writes. Each wrapper declares those facts
(``@_declare``: FACTS), and the checker reads them from here. No module outside comm/ calls a
torch.distributed collective (tests/test_package_layout.py holds it, its few exceptions named there).

The flat-tensor collectives carry this torch's names: 2.13 renamed them (``reduce_scatter_single``,
``all_gather_single``); 2.11 and 2.12 have only the old ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Facts:
    """What a collective does to its caller's tensors: what the stream-order checker models it by.

    Attributes:
        reads, writes: the positions of the arguments it reads and writes (each a tensor, or a list of
            tensors), on the process group's communication stream.
        asynchronous: it takes ``async_op`` (True by default) and then returns a Work that the caller
            waits for; otherwise it blocks its caller until it is done.
        objects: it moves picklable host objects, no tensor of the caller's: nothing a stream orders.
    """

    reads: tuple[int, ...]
    writes: tuple[int, ...]
    asynchronous: bool = False
    objects: bool = False


FACTS: dict[str, Facts] = {}
"""Each wrapper's Facts, by its name here."""


def _declare(**facts):
    def declared(fn):
        FACTS[fn.__name__] = Facts(**facts)
        return fn
    return declared


@_declare(reads=(0,), writes=(0,), asynchronous=True)
def all_reduce(t: torch.Tensor, group, async_op: bool = True, op=dist.ReduceOp.SUM):
    """``t`` reduced (``op``, a ``dist.ReduceOp``) over ``group``, in place."""
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


@_declare(reads=(1,), writes=(0,), asynchronous=True)
def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    return _reduce_scatter(out, inp, group=group, async_op=async_op)


@_declare(reads=(1,), writes=(0,), asynchronous=True)
def all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    """``inp`` of every rank of ``group`` into ``out`` (rank r's at chunk r), as
    ``all_gather_into_tensor``; on gloo by one broadcast per rank (``broadcast_replaces_all_gather``)."""
    if broadcast_replaces_all_gather(group, out.device):
        return _gather_by_broadcasts(out, inp, group, async_op)
    return _all_gather(out, inp, group=group, async_op=async_op)


class Works:
    """Several Works waited for as one (what ``all_gather`` returns where it issues several)."""

    def __init__(self, works: list):
        self.works = works

    def wait(self, *args) -> bool:
        for w in self.works:
            w.wait(*args)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _gather_by_broadcasts(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
    """Chunk r of ``out`` broadcast from rank r of ``group``, in place: rank r sends ``inp``, every
    other rank receives into its chunk r, and rank r's own chunk takes ``inp`` unless it is that very
    memory (fused_zero's gathers: the updated slice lies in the buffer gathered into)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat, src = out.view(-1), inp.reshape(-1)
    n = src.numel()
    if flat.numel() != n * world:
        raise ValueError(f"all_gather: output of {flat.numel()} elements for {world} inputs of {n}")
    own = flat[rank * n:(rank + 1) * n]
    works = [dist.broadcast(src if r == rank else flat[r * n:(r + 1) * n], group=group, group_src=r,
                            async_op=True) for r in range(world)]
    if own.data_ptr() != src.data_ptr():
        own.copy_(src)  # only reads what the broadcast of this rank's chunk reads
    work = Works(works)
    if not async_op:
        work.wait()
        return None
    return work


@_declare(reads=(1,), writes=(0,))
def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)


@_declare(reads=(0,), writes=(1,))
def gather(t: torch.Tensor, chunks: list[torch.Tensor] | None, dst: int, group):
    """``dst`` is a rank of ``group``."""
    return dist.gather(t, chunks, dst=dist.get_global_rank(group, dst), group=group)


@_declare(reads=(0,), writes=(0,))
def broadcast(t: torch.Tensor, src: int, group):
    """``src`` is a rank of ``group``."""
    return dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)


@_declare(reads=(0,), writes=(), objects=True)
def all_gather_object(obj, group) -> list:
    """Every rank's picklable ``obj``, in the ranks' order of ``group``."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def backend_of(group, device: torch.device) -> str:
    """The backend that runs ``group``'s collectives on ``device``'s tensors ("gloo", "nccl", ...; every
    NCCL variant reads "nccl", ``NCCL_NAMES``).

    Asked per device type: a process group holds one backend per device type, built from the backend
    config that ``dist.get_backend_config`` reports ("cpu:gloo,cuda:nccl" for torchtitan's string;
    "cuda:nccl" for ``init_process_group()`` with no backend on a GPU machine in torch 2.13, "cpu:gloo"
    on a CPU one; "cpu:gloo,cuda:gloo" for "gloo"). ``dist.get_backend`` names no device: it reads
    "undefined" after ``init_process_group()`` and the whole string for a mixed one."""
    kind = torch.device(device).type
    config = str(dist.get_backend_config(group))
    served = dict(p.split(":", 1) for p in config.split(",") if ":" in p)
    if kind not in served:
        raise ValueError(f"no backend of the process group ({config}) runs {kind} tensors: give "
                         f"init_process_group (or new_group) one, e.g. backend=\"cpu:gloo,cuda:nccl\"")
    return "nccl" if served[kind] in NCCL_NAMES else served[kind]


NCCL_NAMES = ("nccl", "nccl2", "nccl-lazy", "nccl-legacy")
"""The names NCCL's process groups go by: torch 2.14 on registers "nccl2" (ProcessGroupNCCL2, which
torch 2.15's "nccl" is by default), "nccl-lazy" and "nccl-legacy" (the classic ProcessGroupNCCL) beside
"nccl". Each runs NCCL's collectives with Works that have Futures: the same choices as "nccl"."""


def reduce_scatter_has_future(group, device: torch.device) -> bool:
    """Whether a reduce-scatter of ``device`` tensors has a Work with a Future (NCCL's has; gloo's raises
    "not implemented"). With one, DDP's ``finalize_backward`` waits for the reduction before it reads
    the bucket, which the reduce-scatter writes in place."""
    return backend_of(group, device) == "nccl"


def all_reduce_replaces_reduce_scatter(group, device: torch.device) -> bool:
    """Whether the bucket's reduction should be one in-place all-reduce, this rank's slice read from it,
    instead of a reduce-scatter. On gloo it should: ProcessGroupGloo's reduce-scatter all-reduces a full
    clone of its input and then copies this rank's chunk out, so the in-place all-reduce computes the
    same values with one copy of the bucket less, and its Work has a Future (DDP then waits for the
    reduction before it reads the bucket). NCCL keeps its reduce-scatter: half the bytes of an
    all-reduce."""
    return backend_of(group, device) == "gloo"


def broadcast_replaces_all_gather(group, device: torch.device) -> bool:
    """Whether ``all_gather`` should be one in-place broadcast per rank. On gloo it should:
    ProcessGroupGloo's all-gather gathers into a flat scratch tensor of the output's size and then
    copies it out, while a broadcast sends and receives in place; the bytes each rank sends and
    receives are the same. Measured on 2 gloo ranks (2 CPU cores, bench/test_bench_floor.py's
    MLP): an all-gather of 8.4M fp32 elements 55-62 ms, the two broadcasts 13-19 ms. NCCL keeps its
    all-gather."""
    return backend_of(group, device) == "gloo"


REDUCE_DTYPES = {"gloo": (torch.float32, torch.bfloat16, torch.float16),
                 "nccl": (torch.float32, torch.bfloat16, torch.float16)}
"""What each backend sums (NCCL: bfloat16 from NCCL 2.10, checked where it is used)."""


def reduces_in(group, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``group``'s backend can sum ``dtype`` tensors (the checks of ``grad_reduce_dtype``)."""
    backend = backend_of(group, device)
    if dtype not in REDUCE_DTYPES.get(backend, (torch.float32,)):
        return False
    if backend == "nccl" and dtype == torch.bfloat16:
        return _nccl_version() >= (2, 10)
    return True


def _nccl_version() -> tuple:
    """The NCCL version torch was built with, ``(0,)`` where it has none (a CPU build)."""
    try:
        return tuple(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        return (0,)
