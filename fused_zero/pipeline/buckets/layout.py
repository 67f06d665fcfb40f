"""Where every element of a DDP bucket lives: one source of truth for offsets, slices and rows.

DDP packs a bucket's gradients back to back in one buffer of ``numel`` elements, with no padding.
fused_zero cuts it without padding too:

    [ rank 0 | rank 1 | ... | rank W-1 | tail ]
      shard     shard          shard      numel - W * shard elements (< W * align)

``shard`` is the largest multiple of ``align`` with ``W * shard <= numel``, so every rank's slice
starts ``align``-aligned, the head reduces with one ``reduce_scatter`` straight out of DDP's buffer
(no padded staging copy) and the updated head comes back with one in-place ``all_gather``. The few
tail elements are all-reduced and updated redundantly by every rank, which keeps their optimizer
state replicated; that costs less than a padded copy of the whole bucket, and the state a rank holds
for a bucket is ``shard + tail`` elements: exactly 1/W of the bucket plus under ``W * align``.

``align`` is ``ALIGN`` unless that would make the tail (up to ``W * align``) more than an eighth of a
rank's slice (``numel / W``): at 1024 ranks a 25 MB bucket gives each rank only 12k elements, and a
32-element alignment would replicate up to 32k. It halves down to 1 until ``8 * W * align <= numel / W``.
Alignment 1 still leaves up to ``W - 1`` tail elements, so the eighth holds only for buckets of at least
``8 W^2`` elements; smaller ones replicate fewer than ``W`` (DDP's default 25 MiB bucket at W=1024: bf16,
13.1M elements, within the eighth; fp32, 6.55M, up to 1023 of a 6400-element slice, 16%).

A rank's *region* (its optimizer state for one bucket) holds its slice, then the tail. Both start at
region offsets congruent to their bucket offsets modulo the kernels' vector width ``VEC`` (4): then an
element sits at the same position within a 16-byte vector of fp32 state as within a vector of the
parameter and gradient buffers, and every aligned run of a parameter is on the kernels' vector path
(kernels/segments.py). Where ``align`` is a multiple of ``VEC`` (every bucket but tiny ones at large W)
the region is exactly ``[slice | tail]``; otherwise up to ``VEC - 1`` unused elements precede the slice
and up to ``VEC - 1`` the tail, and the regions of different ranks differ in size by those few.
This module is pure: no process group, no device.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ...kernels import VEC, vector_elements

ALIGN = 32
"""Slice starts are multiples of 32 elements (64 bytes of bf16, 128 bytes of fp32) where the bucket is
large enough for the world size (see ``alignment``)."""

REPLICATED = -1
"""Owner of tail elements: every rank holds and updates them."""


def alignment(numel: int, world_size: int) -> int:
    """The slice alignment for a bucket: ALIGN, halved while the tail could exceed 1/8 of a slice (down
    to 1, where the tail is under ``world_size`` elements whatever the bucket)."""
    align = ALIGN
    while align > 1 and 8 * world_size * align * world_size > numel:
        align //= 2
    return align


@dataclass(frozen=True)
class Piece:
    """A run of one parameter's elements inside one rank's region.

    Attributes:
        local: index of the parameter within the bucket.
        elem: first element of the parameter (flattened) in the run.
        length: number of elements.
        region_off: where the run starts in the owner's region.
        bucket_off: where the run starts in the bucket buffer.
    """

    local: int
    elem: int
    length: int
    region_off: int
    bucket_off: int


@dataclass(frozen=True)
class BucketLayout:
    """The layout of one DDP bucket as seen by ``rank`` of ``world_size``.

    Attributes:
        pids: the optimizer's index of each parameter, in bucket order.
        numels: elements of each parameter.
        offsets: element offset of each parameter in the bucket buffer.
        numel: elements in the bucket buffer.
        world_size, rank: the process group's.
        shard: elements of each rank's slice (a multiple of ``alignment(numel, world_size)``, maybe 0).
    """

    pids: tuple[int, ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    world_size: int
    rank: int
    shard: int

    @staticmethod
    def build(pids, numels, offsets, world_size: int, rank: int) -> BucketLayout:
        pids, numels, offsets = tuple(pids), tuple(numels), tuple(offsets)
        if not (len(pids) == len(numels) == len(offsets)) or not pids:
            raise ValueError("a bucket needs one offset and one size per parameter, and a parameter")
        order = sorted(range(len(pids)), key=offsets.__getitem__)
        end = 0
        for i in order:
            if offsets[i] < end:
                raise ValueError(f"parameter {pids[i]} overlaps another in the bucket buffer")
            end = offsets[i] + numels[i]
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        numel = end
        align = alignment(numel, world_size)
        shard = numel // (world_size * align) * align
        return BucketLayout(pids, numels, offsets, numel, world_size, rank, shard)

    @property
    def head(self) -> int:
        """Elements reduce-scattered and all-gathered: ``world_size * shard``."""
        return self.world_size * self.shard

    @property
    def tail(self) -> int:
        return self.numel - self.head

    @property
    def region_size(self) -> int:
        """Elements of optimizer state this rank holds for this bucket."""
        return self.region_tail(self.rank)[1]

    def region_slice(self, rank: int) -> tuple[int, int]:
        """Where ``rank``'s slice lies in its region: congruent to ``slice_of(rank)`` modulo VEC."""
        lo = rank * self.shard % VEC
        return lo, lo + self.shard

    def region_tail(self, rank: int) -> tuple[int, int]:
        """Where the tail lies in ``rank``'s region: after the slice, congruent to ``head`` modulo VEC."""
        end = self.region_slice(rank)[1]
        lo = end + (self.head - end) % VEC
        return lo, lo + self.tail

    def same_bucket(self, pids, offsets) -> bool:
        return self.pids == tuple(pids) and self.offsets == tuple(offsets)

    def slice_of(self, rank: int) -> tuple[int, int]:
        return rank * self.shard, (rank + 1) * self.shard

    def pieces(self, rank: int) -> list[Piece]:
        """The runs of parameters in ``rank``'s region, in region order (slice first, then tail)."""
        lo, hi = self.slice_of(rank)
        out = self._cut(lo, hi, region_base=self.region_slice(rank)[0])
        out += self._cut(self.head, self.numel, region_base=self.region_tail(rank)[0])
        return out

    def owners(self, local: int, rank: int) -> list[tuple[int, int, int, int]]:
        """``(elem_lo, elem_hi, owner, region_off)`` runs covering parameter ``local``.

        ``owner`` is a rank, or REPLICATED for tail elements (every rank's region holds them; the
        ``region_off`` given is in ``rank``'s region).
        """
        start, n = self.offsets[local], self.numels[local]
        runs = []
        pos = start
        while pos < start + n:
            if pos < self.head:
                owner = pos // self.shard
                end = min(start + n, (owner + 1) * self.shard)
                runs.append((pos - start, end - start, owner,
                             self.region_slice(owner)[0] + pos - owner * self.shard))
            else:
                owner, end = REPLICATED, start + n
                runs.append((pos - start, end - start, owner, self.region_tail(rank)[0] + pos - self.head))
            pos = end
        return runs

    def rows(self) -> list[tuple[int, int, int, int, int, int]]:
        """Kernel pieces (shard_off, length, param_off, grad_off, pid, elem) for this rank's region.

        The parameter buffer and the gradient (DDP's bucket buffer, reduced in place) are both
        indexed like the bucket. ``pid`` is the parameter's index within the bucket (the coefficient
        table's row); ``elem`` the index of the piece's first element in its parameter.
        """
        return [(p.region_off, p.length, p.bucket_off, p.bucket_off, p.local, p.elem)
                for p in self.pieces(self.rank)]

    def _cut(self, lo: int, hi: int, region_base: int) -> list[Piece]:
        out = []
        for local in sorted(range(len(self.pids)), key=self.offsets.__getitem__):
            start, n = self.offsets[local], self.numels[local]
            a, b = max(start, lo), min(start + n, hi)
            if a < b:
                out.append(Piece(local, a - start, b - a, region_base + a - lo, a))
        return out


def vector_share(layouts: Iterable[BucketLayout]) -> float:
    """The share of the elements the layouts' kernel rows update on the aligned vector path.

    Pure: the same cut of the same rows as the kernels' `Segments` (kernels.vector_elements). Pass the
    layouts of every rank to measure a whole run.
    """
    vector = total = 0
    for lay in layouts:
        v, t = vector_elements(lay.rows())
        vector, total = vector + v, total + t
    return vector / total if total else 1.0


@dataclass(frozen=True)
class Transfer:
    """Elements of one parameter that move from ``src``'s old region to ``dst``'s new one."""

    src: int
    dst: int
    pid: int
    length: int
    src_off: int  # in the source rank's old region of the parameter's old bucket
    dst_off: int  # in the destination rank's new region


def reshard_plan(new: BucketLayout, old_of: dict[int, tuple[BucketLayout, int]]) -> list[Transfer]:
    """Every transfer that fills every rank's region of ``new`` from the layouts its parameters had.

    ``old_of[pid]`` is ``(old layout, local index there)``. Replicated (tail) elements are taken from
    the destination rank itself. Every rank computes the same list, in the same order, with no
    messages: all ranks see the same buckets.
    """
    plan = []
    for dst in range(new.world_size):
        for piece in new.pieces(dst):
            pid = new.pids[piece.local]
            old, old_local = old_of[pid]
            lo, hi = piece.elem, piece.elem + piece.length
            for a, b, owner, region_off in old.owners(old_local, dst):
                s, e = max(a, lo), min(b, hi)
                if s < e:
                    plan.append(Transfer(
                        src=dst if owner == REPLICATED else owner, dst=dst, pid=pid, length=e - s,
                        src_off=region_off + (s - a), dst_off=piece.region_off + (s - lo)))
    return plan
