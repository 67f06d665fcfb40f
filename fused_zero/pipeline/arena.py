"""One update launch per step and dtype (overlap modes ``backward`` and ``step``).

A launch needs one base pointer per buffer it reads. Three of them are ours and can be made one:
once DDP's buckets are stable, every shard's state regions and parameter buffer of one dtype move into
one allocation per state name and one for the parameters (the *arena*), so one row offset serves
exp_avg, exp_avg_sq and the master alike. The gradients are DDP's, one allocation per bucket: the
Triton backend addresses them from the lowest-addressed bucket buffer of the dtype with int64 element
offsets ``(buffer.data_ptr() - base.data_ptr()) // element_size`` (never negative, since the base is
the lowest; every row is checked here to stay inside its own bucket). The torch backend cannot index
across allocations; it gets ``BucketGrads``, which maps the same kind of offsets back to the bucket
buffers, so it still makes one ``update`` call per step and its per-run ops are those of the
per-bucket path (bit-identical results).

Until the buckets are stable (DDP rebuilds them in the first one to three iterations) and in overlap
mode ``bucket`` the engine keeps one launch per bucket over each shard's own allocations.
"""

from __future__ import annotations

import bisect

import torch

from ..kernels import Segments, row_table
from ..kernels.segments import VEC, VECTOR
from .shard import BucketShard

ARENA_ALIGN = 32
"""Each shard's region and parameter buffer starts at a multiple of 32 elements of its arena (128 bytes
of fp32), so every base pointer a launch sees stays 16-byte aligned."""


def _aligned(n: int) -> int:
    return -(-n // ARENA_ALIGN) * ARENA_ALIGN


class Arena:
    """One dtype's shards, their state and parameter buffers moved into one allocation each.

    Attributes:
        shards: the shards, in arena order.
        state: state name -> tensor holding every shard's region (``shard.state[name]`` are views).
        scales: 8-bit moments' scales of every shard back to back, in arena order, as the launch numbers
            the rows of its table (``shard.scales[name]`` are views); else empty.
        params: the tensor holding every shard's parameter buffer (``shard.param_buffer`` are views).
        state_at, param_at, scale_at: each shard's first element in ``state``, ``params``, ``scales``.
    """

    def __init__(self, shards: list[BucketShard]):
        self.shards = shards
        first = shards[0]
        device, dtype = first.param_buffer.device, first.param_buffer.dtype
        self.state_at, self.param_at, self.scale_at = [], [], []
        n_state = n_param = n_scale = 0
        for shard in shards:
            self.state_at.append(n_state)
            self.param_at.append(n_param)
            self.scale_at.append(n_scale)
            n_state += _aligned(shard.layout.region_size)
            n_param += _aligned(shard.layout.numel)
            n_scale += shard.table.shape[0]
        self.state = {name: torch.zeros(n_state, dtype=t.dtype, device=device) for name, t in first.state.items()}
        self.scales = {name: torch.zeros(n_scale, dtype=torch.float32, device=device) for name in first.scales}
        self.params = torch.zeros(n_param, dtype=dtype, device=device)
        for shard, so, po, ko in zip(shards, self.state_at, self.param_at, self.scale_at):
            region, blocks = shard.layout.region_size, shard.table.shape[0]
            shard.relocate({name: t[so:so + region] for name, t in self.state.items()},
                           {name: t[ko:ko + blocks] for name, t in self.scales.items()},
                           self.params[po:po + shard.layout.numel])


class BucketGrads:
    """DDP's bucket buffers of one dtype, sliced by one offset space (the torch backend's gradient).

    Bucket ``k`` starts at ``starts[k]``, a multiple of ``VEC`` with at least one element left
    between buckets: rows of different buckets are never contiguous (the torch backend never merges
    them into one run), and every offset keeps its alignment modulo ``VEC``, so the launch's rows are
    cut as each shard's own are (what 8-bit blocks need).
    """

    def __init__(self, buffers: list[torch.Tensor], starts: list[int]):
        self.buffers, self.starts = buffers, starts
        self.dtype = buffers[0].dtype

    def __getitem__(self, s: slice) -> torch.Tensor:
        k = bisect.bisect_right(self.starts, s.start) - 1
        lo, hi = s.start - self.starts[k], s.stop - self.starts[k]
        if k < 0 or hi > self.buffers[k].numel():
            raise IndexError(f"gradient slice {s.start}:{s.stop} crosses a bucket boundary")
        return self.buffers[k][lo:hi]


class Launch:
    """One update (and norm) launch over every shard of an arena, for given bucket buffers.

    Attributes:
        rows, segments: the update's rows over all shards (arena state and parameter offsets, gradient
            offsets from the base bucket buffer); ``segments`` on the device (Triton backend only).
        norm_rows, norm_segments: the rows whose gradients count towards the global norm.
        base: index of the shard whose buffer is the gradients' base (Triton backend).
        ptrs: the buffers' addresses the gradient offsets were computed from.
        cuts_like_shards: the rows cut every shard as its own table does (always, without 8-bit
            moments); else the step takes one launch per bucket.
    """

    def __init__(self, arena: Arena, buffers: list[torch.Tensor], backend: str, upload=None):
        self.arena, self.backend = arena, backend
        self.ptrs = [b.data_ptr() for b in buffers]
        if backend == "triton":
            size = buffers[0].element_size()
            self.base = min(range(len(buffers)), key=self.ptrs.__getitem__)
            gaps = [p - self.ptrs[self.base] for p in self.ptrs]
            if any(g % size for g in gaps):
                raise ValueError("bucket buffers are not element-aligned to each other")
            grad_at = [g // size for g in gaps]
        else:
            self.base = 0
            grad_at, pos = [], 0
            for b in buffers:
                grad_at.append(pos)
                pos += -(-(b.numel() + 1) // VEC) * VEC
        self.grad_at = grad_at
        self.rows, self.norm_rows = [], []
        for shard, so, po, go, buf in zip(arena.shards, arena.state_at, arena.param_at, grad_at, buffers):
            for rows, out in ((shard.rows, self.rows), (shard.norm_rows, self.norm_rows)):
                for s, n, p, g, pid, elem in rows:
                    if g + n > buf.numel():
                        raise ValueError(f"a row reaches element {g + n} of a bucket of {buf.numel()}")
                    out.append((so + s, n, po + p, go + g, pid, elem))
        self.cuts_like_shards = not arena.scales or _cuts_like_shards(arena, self.rows)
        # gradient offsets span several allocations: bounds are checked above, per bucket
        triton = backend == "triton"
        self.segments = Segments.build(self.rows, grad_across_allocations=True, upload=upload) if triton else None
        self.norm_segments = Segments.build(self.norm_rows, grad_across_allocations=True, upload=upload) \
            if triton else None

    def matches(self, buffers: list[torch.Tensor]) -> bool:
        return len(buffers) == len(self.ptrs) and all(b.data_ptr() == p for b, p in zip(buffers, self.ptrs))

    def grad(self, buffers: list[torch.Tensor]):
        """The gradient argument of the launch: the base buffer, or BucketGrads (torch backend)."""
        if self.backend == "triton":
            return buffers[self.base]
        return BucketGrads(buffers, self.grad_at)


def _cuts_like_shards(arena: Arena, rows: list) -> bool:
    """8-bit moments' scales are numbered by the launch's rows: the arena's table must cut every shard
    exactly as the shard's own table does. It does when every offset keeps its alignment modulo VEC,
    which the arena's 32-element and the allocators' 64-byte (CPU) and 512-byte (CUDA) alignments
    give; bucket buffers that break it get one launch per bucket instead."""
    combined = row_table(rows)
    if combined.shape[0] != sum(shard.table.shape[0] for shard in arena.shards):
        return False
    return all(torch.equal(combined[at:at + shard.table.shape[0], [1, VECTOR]], shard.table[:, [1, VECTOR]])
               for shard, at in zip(arena.shards, arena.scale_at))


class SingleLaunch:
    """The engine's entry point: packs the shards into arenas once the buckets are stable, and gives
    each step's launches (one per dtype) when every shard of the step is in them.

    Attributes:
        arenas: dtype -> Arena, built by ``pack``; empty until then.
        launches: dtype -> Launch for the bucket buffers last seen.
    """

    def __init__(self, registry, backend: str):
        self.registry, self.backend = registry, backend
        self.arenas: dict[torch.dtype, Arena] = {}
        self.launches: dict[torch.dtype, Launch] = {}
        self._reads = -1  # registry.bucket_reads when the last step ended

    def step_ended(self) -> bool:
        """Call at the end of every step; True when this is the time to ``pack``: no bucket was read
        in full since the previous step (DDP's buckets are stable) and the arenas do not hold
        exactly the registry's shards."""
        reads, self._reads = self._reads, self.registry.bucket_reads
        if reads != self.registry.bucket_reads:
            return False
        held = {id(s) for a in self.arenas.values() for s in a.shards}
        return held != {id(s) for s in self.registry.shards()}

    def pack(self) -> None:
        """Move every shard into its dtype's arena. No gather or update may be pending (the caller
        synchronizes first)."""
        by_dtype: dict[torch.dtype, list[BucketShard]] = {}
        for shard in self.registry.shards():
            by_dtype.setdefault(shard.param_buffer.dtype, []).append(shard)
        self.arenas = {dtype: Arena(shards) for dtype, shards in by_dtype.items()}
        self.launches = {}

    def for_step(self, shards: list[BucketShard]) -> list[tuple[Launch, list[torch.Tensor]]] | None:
        """``(launch, its bucket buffers)`` per dtype when ``shards`` (with their ``reduced_buffer``) are
        exactly the arenas' shards; None when they are not (one launch per bucket then)."""
        if not self.arenas or len(shards) != sum(len(a.shards) for a in self.arenas.values()):
            return None
        index = {id(s): s for s in shards}
        out = []
        for dtype, arena in self.arenas.items():
            if any(id(s) not in index for s in arena.shards):
                return None
            buffers = [s.reduced_buffer for s in arena.shards]
            launch = self.launches.get(dtype)
            if launch is None or not launch.matches(buffers):
                launch = self.launches[dtype] = Launch(arena, buffers, self.backend, self.registry.upload)
            if not launch.cuts_like_shards:
                return None
            out.append((launch, buffers))
        return out
