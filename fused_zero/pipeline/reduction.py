"""The first stage of a bucket's pipeline: its reduction, started in place in DDP's buffer, and which of
its parameters got a gradient on some rank (torch.optim skips those that did not).

Every collective is issued on the autograd thread, in the comm hook, in bucket order (see engine.py);
this module only issues them. Where DDP may skip parameters (``find_unused_parameters``, ``static_graph``)
the local "got a gradient" flags go to the device and are all-reduced asynchronously: no host sync per
bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import collectives
from .shard import BucketShard


@dataclass
class UsedFlags:
    """A bucket's "got a gradient on some rank" flags, being all-reduced on the update's device.

    ``table`` is int64 ``[2, k]``: row 0 the bucket's parameter indices, row 1 how many ranks produced
    a gradient for each (all-reduced in place; the Work is among the bucket's Works). The update folds
    row 1 into column 0 ("active") of the coefficient table on the device: no host sync in the backward.
    """

    table: torch.Tensor


@dataclass
class Reduced:
    """A bucket whose reduction has been started: its shard, the parameters that got a gradient (known
    on the host, or being all-reduced) and the Works to wait for."""

    shard: BucketShard
    active: np.ndarray | UsedFlags
    works: list


class Reduction:
    """Attributes:
        track_used: whether DDP may leave parameters without a gradient (find_unused_parameters or
            static_graph), so that which ones got one must be learned.
        used_local: per parameter, whether this rank produced a gradient in this iteration (written by
            hooks.MarkUsed).
        used_static: with static_graph, the global used map once the first iteration made it known.
        grad_div: what the kernel divides each parameter's reduced gradient by (1 where the reduction
            averaged already).
    """

    def __init__(self, engine, ddp):
        self.engine = engine
        self.group, self.world, self.rank = engine.group, engine.world, engine.rank
        self.grad_reduce = engine.grad_reduce
        n = len(engine.params)
        self.track_used = bool(ddp.find_unused_parameters or getattr(ddp, "static_graph", False))
        self.static_graph = bool(getattr(ddp, "static_graph", False))
        self.used_local = np.zeros(n, dtype=bool)
        self.used_static: np.ndarray | None = None
        self.grad_div = np.array([1.0 if self.pre_divides(p.dtype) else float(self.world) for p in engine.params])
        self.rs_future = self.world > 1 and collectives.reduce_scatter_has_future(self.group)


    @property
    def side(self):
        """The engine's side stream (read each time: tests swap in a recording one)."""
        return self.engine.side
    def pre_divides(self, dtype: torch.dtype) -> bool:
        """Divide before summing, as DDP does, wherever rounding or range make it matter: for all-reduce
        (so param.grad is DDP's average) and for low-precision gradients (DDP's rounding, and no fp16
        overflow). fp32 reduce-scatter sums leave the division to the kernel: a pass over the bucket
        saved."""
        return self.grad_reduce == "all_reduce" or dtype != torch.float32

    def start(self, shard: BucketShard, buffer: torch.Tensor) -> Reduced:
        """Start the bucket's reduction and learn which of its parameters are active."""
        active, works = self._active(shard)
        works += self._reduce(shard, buffer)
        return Reduced(shard, active, works)

    def future(self, reduced: Reduced, buffer: torch.Tensor) -> torch.futures.Future:
        """What the comm hook hands DDP: the bucket's last reduction's future wherever the backend has
        one, so that DDP's ``finalize_backward`` waits for it (a stream wait on CUDA) before it reads
        the bucket (copying it into ``param.grad`` without ``gradient_as_bucket_view``) and before the
        backward returns: nothing reads or writes the bucket while the reduction still writes it in
        place. With ``all_reduce`` that is DDP's own contract (``param.grad`` is the average); with
        ``reduce_scatter`` only this rank's slice and the tail are reduced. gloo's reduce-scatter has
        no future; there the future is complete, and DDP's copy into ``param.grad`` (only without
        ``gradient_as_bucket_view``) may race the gloo thread on the slice it writes, which no update
        reads through ``param.grad`` in that mode. Its callback only hands the buffer back: it issues
        nothing (every collective is issued from the hook, see engine.py)."""
        if reduced.works and (self.grad_reduce == "all_reduce" or self.rs_future):
            return reduced.works[-1].get_future().then(lambda _: buffer)
        return reduced.shard.completed(buffer)

    def _active(self, shard: BucketShard) -> tuple[np.ndarray | UsedFlags, list]:
        """Which of the bucket's parameters got a gradient on some rank, and the Works to wait for
        before that is known. Where it is not known on the host, the local flags go to the device and
        are all-reduced asynchronously, in the hook like every collective."""
        pids = shard.pids
        if not self.track_used:
            return shard.all_active, []
        if self.used_static is not None:
            return self.used_static[pids], []
        local = torch.from_numpy(np.stack([pids, self.used_local[pids]]).astype(np.int64))
        with self.side.run(follow_current=False):
            table = self.side.upload(local)
            works = [collectives.all_reduce(table[1], self.group)] if self.world > 1 else []
        return UsedFlags(table), works

    def _reduce(self, shard: BucketShard, buffer: torch.Tensor) -> list:
        """Start this bucket's reduction, in place in DDP's buffer; return its Works.

        reduce_scatter: the head is reduce-scattered into this rank's own slice of it (the output is
        a chunk of the input, as Megatron-core does; gloo and NCCL accept it) and the tail is
        all-reduced where it is, so the kernel reads the reduced gradient from the bucket buffer and
        no gradient copy exists. The other ranks' slices are left holding this rank's local
        (pre-divided) gradients: ``param.grad`` is not the global gradient in this mode.
        """
        if self.world == 1:
            return []
        layout, g = shard.layout, self.group
        if self.pre_divides(buffer.dtype):
            buffer.div_(self.world)
        works = []
        if self.grad_reduce == "all_reduce":
            works.append(collectives.all_reduce(buffer, g))
        else:
            if layout.tail:
                works.append(collectives.all_reduce(buffer[layout.head:], g))
            if layout.shard:
                lo, hi = layout.slice_of(self.rank)
                works.append(collectives.reduce_scatter(buffer[lo:hi], buffer[:layout.head], g))
        return works

    def end_step(self) -> None:
        """After ``step()``: with static_graph the first iteration's used map is made global once (a host
        sync on CUDA, once); the local flags start again."""
        if self.track_used and self.used_static is None and self.static_graph:
            self.used_static = self._used_on_any_rank(np.arange(len(self.used_local)))
        self.used_local[:] = False

    def _used_on_any_rank(self, pids: np.ndarray) -> np.ndarray:
        """All-reduce the local "got a gradient" flags of ``pids`` (a host sync on CUDA)."""
        flags = torch.from_numpy(self.used_local[pids].astype(np.int32)).to(self.engine.device)
        if self.world > 1:
            collectives.all_reduce(flags, self.group, async_op=False)
        return flags.cpu().numpy() > 0
