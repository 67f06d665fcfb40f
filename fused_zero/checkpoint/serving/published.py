"""What serving each recently published version of a rank's state needs, kept while a request may still
want it: a rank's host runs ahead of its device.

Under NCCL nothing blocks a rank's host in the iteration after the one a requester stopped at (its
reductions and their waits are stream operations, see docs/design-streams.md, "Streams"). So while rank 0 is in
``state_dict()`` at version N, rank 1 finishes ``step()`` N+1 on the host and publishes N+1, with its
N+1 updates still queued on its device behind a reduce-scatter that rank 0 has not joined: the device
holds version N, only the host's count and event moved on. Version N must then still be served, from
what it was: its events, the state tensors its regions were in (a reshard after DDP's bucket rebuild,
or the arenas' packing, gives the shards new ones on the host; the old ones must stay alive, not go back
to the allocator's pool to be reused), and its layout fingerprint.

**How far ahead.** As far as the streams let it: the step path has no host wait
(pipeline/updating/step_counts.py), so nothing bounds the versions a server's rank may have published past the
one a request asks for. A version is kept until no request can still want it: once the events of a
later version published by ``step()`` have passed, that step's updates have run, after its reductions,
which every member of the shard group joined, each only after its last ``state_dict()`` of an earlier
version had returned (a requester is between steps until its last slice has come). So the older
versions go (``event.query()``, no wait); on a GPU that keeps the newest version whose events passed
and the ones queued after it, two in the steady state. A load's events prove nothing of the others (a
load is no reduction): they prune nothing.

**Why reading an old version is right.** Version N's reads wait for version N's events only, never for a
later one (N+1's follows N+1's updates, which wait for a reduction the requester has not joined: waiting
for it deadlocks until the transfer deadline). Nothing of N+1 can have written N's tensors on the
device by then, for the same reason: every write of iteration N+1 to the state (its updates, a reshard's
``all_to_all`` and what follows it, the arenas' moves, queued after ``synchronize()``) is ordered after
a collective of the shard group, and the requester, a member of that group asking only its members, has
joined none (it is between steps until the last slice has come).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..canonical import layout_fingerprint, sharded_slices


@dataclass(frozen=True)
class Published:
    """One version as it was published: what its reads wait for, and what they read.

    Attributes:
        version: completed steps and loads.
        events: CUDA events recorded after its last write (none on the CPU).
        slices: ``(shard, name)`` in the order the requester's builder takes them, the shards frozen
            as they were (``BucketShard.frozen``: their state tensors then, kept alive here).
        fingerprint: its layout's (canonical.layout_fingerprint).
        by_step: published by ``step()`` (else by a load or ``attach``): whether its events passing
            shows that every member of the shard group has gone past the versions before it.
    """

    version: int
    events: tuple
    slices: tuple
    fingerprint: int
    by_step: bool = True


class Versions:
    """The published versions of one optimizer that a request may still want (the module docstring),
    oldest first; written by the training thread, read by the server thread. Publishing costs a new
    record only where the shards' tensors changed (a reshard, a pack, a load): otherwise the previous
    one's slices and fingerprint are shared."""

    def __init__(self):
        self.cond = threading.Condition()
        self.kept: list[Published] = []
        self.newest = -1  # the first publish, at attach, is version 0
        self._frozen: tuple = ()  # (key, slices, fingerprint) of the newest distinct state
        self.waiting = False

    def publish(self, view, events: tuple, by_step: bool = True) -> None:
        shards = view.layout.shards()
        key = tuple((id(s), tuple(id(p.state) for p in s.parts)) for s in shards)
        if not self._frozen or self._frozen[0] != key:  # the frozen dicts of the last key are alive: no id reuse
            frozen = {id(s): s.frozen() for s in shards}
            slices = tuple((frozen[id(s)], name) for s, name in sharded_slices(view))
            self._frozen = (key, slices, layout_fingerprint(view))
        with self.cond:
            self.newest += 1
            self.kept.append(Published(self.newest, events, self._frozen[1], self._frozen[2], by_step))
            self._prune()
            if self.waiting:
                self.cond.notify_all()

    def _prune(self) -> None:
        """Drop the versions before the newest one published by a step whose events have passed."""
        for i in range(len(self.kept) - 1, 0, -1):
            record = self.kept[i]
            if record.by_step and all(event.query() for event in record.events):
                del self.kept[:i]
                return

    def get(self, version: int) -> Published | None:
        """Under ``cond``: the record of ``version`` if it is kept."""
        return next((p for p in self.kept if p.version == version), None)
