"""The third stage of a bucket's pipeline: the all-gather of the shard group's updated slices into the
flat parameter buffer the bucket's parameters are views of, in place (this rank's slice is the input).

``start`` and ``finish`` are one pair, as a reduction's start and its Work's wait are. ``start`` runs
after the bucket's update, on the side stream, in bucket order on every rank (updating/updates.py: the
gathers pair up by issue order), on the gathers' communicator (buckets/topology.py,
``post_update_groups``). ``finish`` makes its caller wait for the gather, wherever the parameters are
read or rewritten next (docs/design-streams.md numbers these edges): the next update of the bucket (7),
``step()`` with param_sync="step" (11), a forward pre-hook (12), the arenas' packing (14),
``synchronize()`` (15), a reshard or a rebuild of the shard (buckets/registry.py), and, inside a CUDA
graph's capture, the side stream before the capture ends (a capture must join every stream it forks:
step_end/step_graph.py). With NCCL the wait is a stream wait, with gloo a host wait. At most one gather
of a bucket is pending: a new start finishes the previous one first.
"""

from __future__ import annotations

import numpy as np

from ..comm import collectives
from ..comm.profiling import range_push
from .packed import PackedGather, lead_member, member_runs


class BucketGather:
    """One bucket's all-gather, from its start to its finish.

    Attributes:
        layout: the bucket's BucketLayout (pipeline/buckets/layout.py): its slices and head.
        pending: the started gather's Work (``collectives.all_gather``'s, or a PackedGather), None once
            finished or where none was started.
        lead: where several members share the bucket, the one whose update gathers it whole in
            overlap="step" (the others gather their own elements: packed.py); else None.
    """

    def __init__(self, layout, members: np.ndarray, member_set: frozenset[int]):
        """``members``: each parameter's member, in bucket order (negative: no fused_zero optimizer's);
        ``member_set``: the members present."""
        self.layout, self._members, self._member_set = layout, members, member_set
        self.pending = None
        self.lead = lead_member(layout, members) if len(member_set) > 1 else None
        self._runs: dict[int, list] = {}  # member -> its runs in each rank's slice, made at first use
        # one rank, an empty slice or a bucket no fused_zero optimizer updates: nothing to gather
        self._gathers = layout.world_size > 1 and layout.shard > 0 and bool(member_set)

    def start(self, buffer, members: list[int], group, side, scratch) -> None:
        """The updated slices back into ``buffer`` (the bucket's parameter buffer) after ``members``'
        update: in place, the whole head, unless the bucket is shared and the update is not its lead
        member's (overlap="step"): then each member's own elements, packed (packed.py). ``side``: the
        side stream, ``scratch``: where the packed buffers come from (pipeline/comm/scratch.py)."""
        if not self._gathers:
            return
        layout = self.layout
        self.finish()  # one pending gather at a time (this rank's region may hold no row of ``members``)
        with range_push("fused_zero.all_gather"):
            if self.lead is None or self.lead in members:
                lo, hi = layout.slice_of(layout.rank)
                self.pending = collectives.all_gather(buffer[:layout.head], buffer[lo:hi], group)
                return
            for m in sorted(self._member_set.intersection(members)):
                self.finish()
                self.pending = PackedGather(buffer, self._member_runs(m), layout.rank, group, side,
                                            scratch.under("packed", layout.pids, m))

    def finish(self) -> None:
        """Make the caller wait for the pending gather, if any (a stream wait with NCCL, a host wait with
        gloo)."""
        work, self.pending = self.pending, None
        if work is not None:
            work.wait()

    def _member_runs(self, member: int) -> list[list[tuple[int, int]]]:
        if member not in self._runs:
            self._runs[member] = member_runs(self.layout, self._members, member)
        return self._runs[member]
