"""One optimizer's parameters of a bucket it shares with others, all-gathered alone (overlap="step").

With several optimizers over one DDP module (pipeline/members.py) a bucket holds parameters of several
of them, and with ``overlap="step"`` each updates at its own ``step()``, after which its parameters must
be current on every rank. The bucket's *lead* member (the one with the most of its elements, the same on
every rank) gathers the whole head in place, as a bucket of one member does; each other member gathers
only its own elements: each rank packs its runs of them in its slice into one buffer, padded to the
longest rank's, the buffers are all-gathered, and each rank copies the other ranks' runs out of them.
So the bytes of a shared bucket's gathers are one whole bucket's plus the others' own elements (Muon's
matrices with AdamW's norms and biases: 1 + AdamW's share, whichever steps first), where gathering the
whole bucket after each step would double them.
"""

from __future__ import annotations

import numpy as np
import torch

from ..comm import collectives


def lead_member(layout, members: np.ndarray) -> int:
    """The member with the most elements of the bucket (the lowest index on a tie): it gathers the whole
    head; the same on every rank. ``members``: each parameter's, in bucket order."""
    counts: dict[int, int] = {}
    for m, n in zip(members.tolist(), layout.numels):
        if m >= 0:
            counts[m] = counts.get(m, 0) + n
    return min(counts, key=lambda m: (-counts[m], m))


def member_runs(layout, members: np.ndarray, member: int) -> list[list[tuple[int, int]]]:
    """``(bucket offset, length)`` of ``member``'s elements in each rank's slice of the bucket, in bucket
    order (the tail is every rank's: nothing to gather): what a PackedGather of the member gathers."""
    out = []
    for r in range(layout.world_size):
        lo, hi = layout.slice_of(r)
        out.append([(p.bucket_off, p.length) for p in layout.pieces(r)
                    if lo <= p.bucket_off < hi and members[p.local] == member])
    return out


class PackedGather:
    """A member's runs of a bucket's slices, all-gathered packed (the module docstring): ``wait()`` waits
    for the collective and copies the other ranks' runs into the parameter buffer, on the side stream
    (where the buffers were made and the gather was issued), then orders the caller's stream after it."""

    def __init__(self, buffer: torch.Tensor, runs: list[list[tuple[int, int]]], rank: int, group, side, scratch):
        """``scratch``: where the packed buffers come from (pipeline/comm/scratch.py: kept across steps
        where a CUDA graph replays the gather, one pair per bucket and member)."""
        self.buffer, self.runs, self.rank, self.side = buffer, runs, rank, side
        counts = [sum(n for _, n in r) for r in runs]
        self.chunk = max(counts)
        world = len(runs)
        send = scratch.take("send", (self.chunk,), buffer.dtype)
        mine = [buffer[o:o + n] for o, n in runs[rank]]
        if mine:
            torch.cat(mine, out=send[:counts[rank]])
        self.send = send
        self.recv = scratch.take("recv", (world * self.chunk,), buffer.dtype)
        self.work = collectives.all_gather(self.recv, send, group)

    def wait(self, *args) -> bool:
        with self.side.run(follow_current=False):
            self.work.wait(*args)
            dst, src = [], []
            for r, runs in enumerate(self.runs):
                at = r * self.chunk
                for o, n in runs:
                    if r != self.rank:
                        dst.append(self.buffer[o:o + n])
                        src.append(self.recv[at:at + n])
                    at += n
            if dst:
                torch._foreach_copy_(dst, src)
        self.side.join()
        return True
