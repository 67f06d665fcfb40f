"""The first stage of a bucket's pipeline: its reduction, started in place in DDP's buffer, and which of
its parameters got a gradient on some rank (torch.optim skips those that did not).

Every collective is issued on the autograd thread, in the comm hook, in bucket order (see engine.py);
this module only issues them. Where DDP may skip parameters (``find_unused_parameters``, ``static_graph``)
the local "got a gradient" flags go to the device and are all-reduced asynchronously: no host sync per
bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..buckets.shard import BucketShard
from ..comm import collectives

if TYPE_CHECKING:
    from ...options import ShardingOptions


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
    """A bucket whose reduction has been started.

    Attributes:
        shard: the bucket's shard.
        active: the parameters that got a gradient (known on the host, or being all-reduced).
        works: the Works to wait for before the update.
        grad: what the update reads, indexed like the bucket: DDP's buffer, reduced in place, or its
            copy in ``grad_reduce_dtype`` (the staging copy, as ``bf16_compress_hook`` makes one).
        bucket: DDP's buffer.
        future_work: the Work whose Future DDP is handed (None: a completed Future).
    """

    shard: BucketShard
    active: np.ndarray | UsedFlags
    works: list
    grad: torch.Tensor
    bucket: torch.Tensor
    future_work: object | None = None


class Reduction:
    """Attributes:
        topology: the groups (pipeline/buckets/topology.py).
        side, device: the side stream the used flags are uploaded and all-reduced on, and their device.
        track_used: whether DDP may leave parameters without a gradient (find_unused_parameters or
            static_graph), so that which ones got one must be learned.
        used_local: per parameter, whether this rank produced a gradient in this iteration (written by
            hooks.MarkUsed).
        used_static: with static_graph, the global used map once the first iteration made it known.
        reduce_dtype: ``grad_reduce_dtype``: the dtype fp32 gradients travel in, or None.
        one_all_reduce: the bucket is reduced by one in-place all-reduce over DDP's group (``all_reduce``;
            one rank per shard group; gloo, whose reduce-scatter is an all-reduce of a clone, see
            collectives.all_reduce_replaces_reduce_scatter) instead of a reduce-scatter in the shard group.
        grad_div: what the kernel divides each parameter's reduced gradient by (1 where the reduction
            averaged already).
        reduced_by_ddp: DDP's python reducer averaged ``param.grad`` already (local.PythonReducerDDP): the
            buckets handed from ``step()`` are not reduced again.
    """

    def __init__(self, ddp, params: list, topology, options: ShardingOptions, side):
        """``params``: the parameters DDP reduces, by index (buckets/param_table.py); ``side``: the side stream
        (comm/streams.py), whose device the flags go to."""
        topo = self.topology = topology
        self.side, self.device = side, side.device
        self.group, self.world, self.rank = topo.group, topo.world, topo.rank
        self.grad_reduce = options.grad_reduce
        self.reduce_dtype = options.grad_reduce_dtype
        n = len(params)
        self.reduced_by_ddp = bool(getattr(ddp, "reduces", False))
        if self.reduced_by_ddp and self.reduce_dtype is not None:
            raise ValueError(
                f"grad_reduce_dtype={self.reduce_dtype} needs DDP's gradient buckets, which fused_zero reduces "
                "in that dtype; this DDP module was built with torch._dynamo.config.optimize_ddp = "
                "'python_reducer', whose python reducer all-reduces each param.grad in its own dtype itself. "
                "Build the DDP module with optimize_ddp = 'ddp_optimizer' (the default) or False, or leave "
                "grad_reduce_dtype out")
        self.track_used = bool(ddp.find_unused_parameters or getattr(ddp, "static_graph", False))
        self.static_graph = bool(getattr(ddp, "static_graph", False))
        self.used_local = np.zeros(n, dtype=bool)
        self.used_static: np.ndarray | None = None
        self.grad_div = np.array([1.0 if self.pre_divides(p.dtype) or self.reduced_by_ddp else float(self.world)
                                  for p in params])
        self.one_all_reduce = self.grad_reduce == "all_reduce" or topo.shard_size == 1 or \
            collectives.all_reduce_replaces_reduce_scatter(self.group, self.device)
        self.rs_future = self.world > 1 and collectives.reduce_scatter_has_future(topo.shard_group, self.device)

    def travel_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a gradient of ``dtype`` is reduced in: ``grad_reduce_dtype`` for fp32 ones."""
        return self.reduce_dtype if self.reduce_dtype is not None and dtype == torch.float32 else dtype

    def pre_divides(self, dtype: torch.dtype) -> bool:
        """Divide before summing, as DDP does, wherever rounding or range make it matter: for all-reduce
        (so param.grad is DDP's average) and for gradients reduced in 16 bits (DDP's rounding, and its
        compression hooks': cast, then divide, then sum; no fp16 overflow). fp32 reduce-scatter sums
        leave the division to the kernel: a pass over the bucket saved."""
        return self.grad_reduce == "all_reduce" or self.travel_dtype(dtype) != torch.float32

    def start(self, shard: BucketShard, buffer: torch.Tensor) -> Reduced:
        """Start the bucket's reduction and learn which of its parameters are active."""
        active, works = self._active(shard)
        grad, reduce_works, future_work = self._reduce(shard, buffer)
        return Reduced(shard, active, works + reduce_works, grad, buffer, future_work)

    def future(self, reduced: Reduced) -> torch.futures.Future:
        """What the comm hook hands DDP: the reduction's future wherever the backend has one, so that
        DDP's ``finalize_backward`` waits for it (a stream wait on CUDA) before it reads the bucket
        (copying it into ``param.grad`` without ``gradient_as_bucket_view``) and before the backward
        returns: nothing reads or writes the bucket while the reduction still writes it in place.

        With ``all_reduce`` that is DDP's own contract (``param.grad`` is the average); reduced in
        ``grad_reduce_dtype``, the future then copies the reduced copy back into the bucket, as DDP's
        compression hooks do. With ``reduce_scatter`` only this rank's slice and the tail are reduced,
        or the whole bucket where one all-reduce does it (gloo). Only a reduce-scatter without a future
        (gloo's, where it runs: never by default) leaves a completed future, and DDP's copy into
        ``param.grad`` may then race the gloo thread on the slice it writes, which no update reads
        through ``param.grad`` in that mode. The callbacks only copy or hand the buffer back: they
        issue nothing (every collective is issued from the hook, see engine.py)."""
        buffer, work = reduced.bucket, reduced.future_work
        if work is None:
            return reduced.shard.completed(buffer)
        if (self.grad_reduce == "all_reduce" or reduced.shard.foreign) and reduced.grad is not buffer:
            grad = reduced.grad
            return work.get_future().then(lambda _: buffer.copy_(grad))
        return work.get_future().then(lambda _: buffer)

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
        relay = self.world > 1  # the all-reduce not behind the side stream's updates; the update waits for it
        with self.side.run(follow_current=False, relay=relay):
            table = self.side.upload(local, relay=relay)
            works = [collectives.all_reduce(table[1], self.group)] if self.world > 1 else []
        return UsedFlags(table), works

    def _reduce(self, shard: BucketShard, buffer: torch.Tensor) -> tuple[torch.Tensor, list, object | None]:
        """Start this bucket's reduction; return what the update will read, the Works, and the Work whose
        future DDP gets.

        In ``grad_reduce_dtype`` the bucket is first cast to that dtype and divided by W there, which is
        what ``bf16_compress_hook`` does (``buffer.to(bfloat16).div_(W)``): the rounding to 16 bits comes
        before the division, the division rounds again, and so does every addition of the sum; the
        update reads the 16-bit sums into fp32. Then, in place in that copy or in DDP's buffer:

        - where the bucket holds parameters no fused_zero optimizer updates (``shard.foreign``), one
          all-reduce of the whole bucket over DDP's group, their runs divided by W first as DDP divides
          them: their ``.grad`` is DDP's average, for the torch.optim optimizer (or the user) that
          updates them; the rest of the bucket reduces as below would, in ZeRO-1's bytes (an all-reduce);

        - one all-reduce of the bucket over DDP's group (``one_all_reduce``), this rank's slice and the
          tail read from it;
        - or the head reduce-scattered within the shard group into this rank's own slice of it (the
          output a chunk of the input, as Megatron-core does; gloo and NCCL accept it) and the tail
          all-reduced over DDP's group where it lies; with replicas (R > 1), the slice is then
          all-reduced across them, issued from the relay stream once it has waited for the
          reduce-scatter (a stream wait on CUDA; on the CPU, where this plan runs only in tests, a
          host wait in the hook). The other ranks' slices keep this rank's local gradients:
          ``param.grad`` is not the global gradient in this mode.
        """
        if self.world == 1 or self.reduced_by_ddp:
            return buffer, [], None
        layout, topo = shard.layout, self.topology
        travel = self.travel_dtype(buffer.dtype)
        grad = buffer if travel == buffer.dtype else buffer.to(travel)
        if self.pre_divides(buffer.dtype):
            grad.div_(self.world)
        else:
            for off, n in shard.foreign:  # DDP's average, its rounding: divided, then summed
                grad[off:off + n].div_(self.world)
        if self.one_all_reduce or shard.foreign:
            work = collectives.all_reduce(grad, self.group)
            return grad, [work], work
        works = []
        if layout.tail:
            works.append(collectives.all_reduce(grad[layout.head:], self.group))
        if not layout.shard:
            return grad, works, works[-1] if works else None
        lo, hi = layout.slice_of(layout.rank)
        works.append(collectives.reduce_scatter(grad[lo:hi], grad[:layout.head], topo.shard_group))
        if topo.replicas == 1:
            return grad, works, works[-1] if self.rs_future else None
        across = self._across_replicas(works, grad[lo:hi])
        # the stage-1 Works are not waited for again: gloo's reduce-scatter copies its result into the
        # output at each wait(), which would overwrite the sum across replicas
        return grad, [across], across

    def _across_replicas(self, works: list, piece: torch.Tensor):
        """All-reduce this rank's reduced slice across the replicas, from the relay stream once it has
        waited for the shard group's reduction (NCCL's communicator of another group does not follow
        it by itself); not from the side stream, where it would wait for the updates queued there."""
        with self.side.run(follow_current=False, relay=True):
            for w in works:
                w.wait()
            return collectives.all_reduce(piece, self.topology.replica_group)

    def end_step(self) -> None:
        """After ``step()``: with static_graph the first iteration's used map is made global once (a host
        sync on CUDA, once); the local flags start again."""
        if self.track_used and self.used_static is None and self.static_graph:
            self.used_static = self._used_on_any_rank(np.arange(len(self.used_local)))
        self.used_local[:] = False

    def _used_on_any_rank(self, pids: np.ndarray) -> np.ndarray:
        """All-reduce the local "got a gradient" flags of ``pids`` (a host sync on CUDA)."""
        flags = torch.from_numpy(self.used_local[pids].astype(np.int32)).to(self.device)
        if self.world > 1:
            collectives.all_reduce(flags, self.group, async_op=False)
        return flags.cpu().numpy() > 0
