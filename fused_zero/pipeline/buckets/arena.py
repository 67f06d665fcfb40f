"""One update launch per step, dtype, member and state format (overlap modes ``backward`` and ``step``).

A launch needs one base pointer per buffer it reads. Three of them are ours and can be made one:
once DDP's buckets are stable, every shard's parameter buffer of one dtype moves into one allocation
(the *arena*), and its state into one allocation per member, state format and name (the parts of
shard.py),
so one row offset serves exp_avg, exp_avg_sq and the master alike. The gradients are DDP's, one
allocation per bucket: the Triton backend addresses them from the lowest-addressed bucket buffer of
the dtype with int64 element offsets ``(buffer.data_ptr() - base.data_ptr()) // element_size`` (never
negative, since the base is the lowest; every row is checked here to stay inside its own bucket). The
torch backend cannot index across allocations; it gets ``BucketGrads``, which maps the same kind of
offsets back to the bucket buffers, so it still makes one ``update`` call per step and its per-run
ops are those of the per-bucket path (bit-identical results).

Until the buckets are stable (DDP rebuilds them in the first one to three iterations) and in overlap
mode ``bucket`` the engine keeps one launch per bucket over each shard's own allocations.
"""

from __future__ import annotations

import bisect

import torch

from ...algorithms.codecs import BlockTable
from ...kernels import Segments, row_table
from ...kernels.segments import VEC, VECTOR
from .shard import BucketShard

ARENA_ALIGN = 32
"""Each shard's region and parameter buffer starts at a multiple of 32 elements of its arena (128 bytes
of fp32), so every base pointer a launch sees stays 16-byte aligned."""


def _aligned(n: int) -> int:
    return -(-n // ARENA_ALIGN) * ARENA_ALIGN


class Arena:
    """One dtype's shards, their parameter buffers moved into one allocation, and their state into one
    allocation per member, state format and name (those parts of every shard, see shard.py).

    Attributes:
        shards: the shards, in arena order.
        params: the tensor holding every shard's parameter buffer (``shard.param_buffer`` are views);
            ``param_at`` each shard's first element there.
        formats: (member, state format) -> FormatState, in the order the shards' parts first name them.
    """

    def __init__(self, shards: list[BucketShard]):
        self.shards = shards
        device, dtype = shards[0].device, shards[0].param_buffer.dtype
        self.param_at, n_param = [], 0
        for shard in shards:
            self.param_at.append(n_param)
            n_param += _aligned(shard.param_buffer.numel())
        self.params = torch.zeros(n_param, dtype=dtype, device=device)
        self.formats: dict[str, FormatState] = {}
        for shard in shards:
            for part in shard.parts:
                if part.key not in self.formats:
                    self.formats[part.key] = FormatState(shards, part.key, device)
        placed = {key: fs.views() for key, fs in self.formats.items()}
        for k, (shard, po) in enumerate(zip(shards, self.param_at)):
            shard.relocate([placed[part.key][k] for part in shard.parts],
                           self.params[po:po + shard.param_buffer.numel()])


class FormatState:
    """One member's parts of one state format of an arena's shards, back to back.

    Attributes:
        key: the parts' ``(member, state format)``.
        state: state name -> tensor holding every shard's part (``part.state[name]`` are views).
        scales: 8-bit moments' scales of every part back to back, in arena order, as the launch numbers
            the rows of its table (``part.scales[name]`` are views); else empty.
        parts: each shard's part of this format, or None; ``state_at`` / ``scale_at`` where each starts.
        size: slots of each state tensor.
    """

    def __init__(self, shards: list[BucketShard], key: tuple[int, str], device: torch.device):
        self.key = key
        self.parts = [next((p for p in shard.parts if p.key == key), None) for shard in shards]
        self.state_at, self.scale_at = [], []
        n_state = n_scale = 0
        for part in self.parts:
            self.state_at.append(n_state)
            self.scale_at.append(n_scale)
            if part is not None:
                n_state += _aligned(part.size)
                n_scale += part.table.shape[0]
        self.size = n_state
        first = next(p for p in self.parts if p is not None)
        self.state = {name: torch.zeros(n_state, dtype=t.dtype, device=device) for name, t in first.state.items()}
        self.scales = {name: torch.zeros(n_scale, dtype=torch.float32, device=device) for name in first.scales}

    def views(self) -> list[tuple[dict, dict] | None]:
        """Each shard's ``(state, scales)`` views for its part of this format (None: no such part)."""
        out = []
        for part, so, ko in zip(self.parts, self.state_at, self.scale_at):
            if part is None:
                out.append(None)
                continue
            blocks = part.table.shape[0]
            out.append(({name: t[so:so + part.size] for name, t in self.state.items()},
                        {name: t[ko:ko + blocks] for name, t in self.scales.items()}))
        return out


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
    """One update launch over one member's parts of one state format of every shard of an arena, for given
    bucket buffers, with the norm pass over the same parts' gradients.

    Attributes:
        fs: the arena's FormatState this launch updates.
        rows, segments: the update's rows over all parts (arena state and parameter offsets, gradient
            offsets from the base bucket buffer); ``segments`` on the device (Triton backend only);
            ``table`` their host row table, ``blocks`` its 8-bit blocks (torch backend only).
        norm_rows, norm_segments: the rows whose gradients count towards the global norm.
        base: index of the shard whose buffer is the gradients' base (Triton backend).
        ptrs: the buffers' addresses the gradient offsets were computed from.
        cuts_like_shards: the rows cut every part as its own table does (always, without 8-bit
            moments); else the step takes one launch per bucket.
    """

    def __init__(self, arena: Arena, key: tuple[int, str], buffers: list[torch.Tensor], backend: str, upload=None):
        self.arena, self.backend = arena, backend
        self.fs = fs = arena.formats[key]
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
        for part, so, po, go, buf in zip(fs.parts, fs.state_at, arena.param_at, grad_at, buffers):
            for rows, out in ((part.rows if part is not None else [], self.rows),
                              (part.norm_rows if part is not None else [], self.norm_rows)):
                for s, n, p, g, pid, elem in rows:
                    if g + n > buf.numel():
                        raise ValueError(f"a row reaches element {g + n} of a bucket of {buf.numel()}")
                    out.append((so + s, n, po + p, go + g, pid, elem))
        self.table = row_table(self.rows)
        self.cuts_like_shards = not fs.scales or _cuts_like_shards(fs, self.table)
        # gradient offsets span several allocations: bounds are checked above, per bucket
        triton = backend == "triton"
        self.blocks = None if triton else BlockTable(self.table, fs.size, arena.params.device)
        self.segments = Segments.build(self.rows, grad_across_allocations=True, upload=upload) if triton else None
        self.norm_segments = Segments.build(self.norm_rows, grad_across_allocations=True, upload=upload) \
            if triton and self.norm_rows else None

    def matches(self, buffers: list[torch.Tensor]) -> bool:
        return len(buffers) == len(self.ptrs) and all(b.data_ptr() == p for b, p in zip(buffers, self.ptrs))

    def grad(self, buffers: list[torch.Tensor]):
        """The gradient argument of the launch: the base buffer, or BucketGrads (torch backend)."""
        if self.backend == "triton":
            return buffers[self.base]
        return BucketGrads(buffers, self.grad_at)


def _cuts_like_shards(fs: FormatState, combined: torch.Tensor) -> bool:
    """8-bit moments' scales are numbered by the launch's rows: the launch's table must cut every part
    exactly as the part's own table does. It does when every offset keeps its alignment modulo VEC,
    which the arena's 32-element and the allocators' 64-byte (CPU) and 512-byte (CUDA) alignments
    give; bucket buffers that break it get one launch per bucket instead (``combined``: the launch's
    row table)."""
    parts = [(p, at) for p, at in zip(fs.parts, fs.scale_at) if p is not None]
    if combined.shape[0] != sum(p.table.shape[0] for p, _ in parts):
        return False
    return all(torch.equal(combined[at:at + p.table.shape[0], [1, VECTOR]], p.table[:, [1, VECTOR]])
               for p, at in parts)


class SingleLaunch:
    """The engine's entry point: packs the shards into arenas once the buckets are stable, and gives
    each step's launches (one per dtype, member and state format) when every shard of the step is in
    them.

    Attributes:
        arenas: dtype -> Arena, built by ``pack``; empty until then.
        launches: (dtype, (member, state format)) -> Launch for the bucket buffers last seen.
    """

    def __init__(self, registry, backend: str):
        self.registry, self.backend = registry, backend
        self.arenas: dict[torch.dtype, Arena] = {}
        self.launches: dict[tuple[torch.dtype, str], Launch] = {}
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

    def for_step(self, shards: list[BucketShard], skip=()) -> list[tuple[Launch, list[torch.Tensor]]] | None:
        """``(launch, its bucket buffers)`` per dtype, member and state format when ``shards`` (with their
        ``reduced_buffer``) are exactly the arenas' shards; None when they are not (one launch per
        bucket then). ``skip``: members the caller updates per part (Muon's: pipeline/updating/whole_matrix.py)."""
        if not self.arenas or len(shards) != sum(len(a.shards) for a in self.arenas.values()):
            return None
        index = {id(s): s for s in shards}
        out = []
        for dtype, arena in self.arenas.items():
            if any(id(s) not in index for s in arena.shards):
                return None
            buffers = [s.reduced_buffer for s in arena.shards]
            for key in arena.formats:
                if key[0] in skip:
                    continue
                launch = self.launches.get((dtype, key))
                if launch is None or not launch.matches(buffers):
                    launch = self.launches[(dtype, key)] = Launch(arena, key, buffers, self.backend,
                                                                  self.registry.upload)
                if not launch.cuts_like_shards:
                    return None
                out.append((launch, buffers))
        return out
