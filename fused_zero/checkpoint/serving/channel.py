"""The checkpoint's own CPU process group: a gloo group beside the DDP's, over which a rank serves its
shards of the optimizer state from a thread of its own while its training thread does whatever the
loop does between steps (its next forward, a logging all-reduce, another model's DDP, an evaluation).

Why a group of its own: collectives pair by issue order, so nothing may be issued on the training
group behind the training thread's back; and a timed-out gloo receive closes its pair for good
("Application timeout caused pair closure"), which must never reach the training group. Here only
point-to-point messages run, each request with tags of its own, so a late or abandoned message can
never be taken for another.

The group is created once per DDP process group and process, at the first ``attach``: a collective,
as ``attach`` already is. It is created with gloo's lazy connections (``TORCH_GLOO_LAZY_INIT``), so
attaching costs no connection setup and a pair of ranks connects (through the store, once) when a
checkpoint first makes them talk: the cost is paid when checkpoints are taken, never per iteration.

Every wait has a deadline. The protocol (peers.py) is built so that a healthy peer always answers
within it, refusals included; a deadline that expires means the peer's process is gone or stuck.

Only requesters receive here, and only while they are in ``state_dict()``; servers only send, while
they serve. No thread ever waits here for a message that may never come (server.py, inbox.py).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

_WINDOW, _PER_REQUEST = 1 << 10, 1 << 20
"""Tags of request ``k``: ``1 + (k mod 1024) * 2**20 + i`` for its i-th message (header first), all
under 2**31 (gloo's tags are non-negative 32-bit ints)."""

TEXT_BYTES = 1024
"""A header: a short utf-8 text, zero-padded (an empty text means "served as asked")."""

JOIN_DEADLINE_S = 60.0
"""How long a server waits for its rank to complete the requester's step, and ``state_dict(to=r)``
waits for rank r to ask. Tests lower it (read at each use)."""

TRANSFER_DEADLINE_S = 300.0
"""How long one message may take: a server busy with another requester answers late, never not at all.
Only a hung process runs it out (a process that exits fails a message at once)."""

EXIT_DEADLINE_S = 60.0
"""How long an exiting process lets the requests announced to it finish (server.py)."""


class ChannelError(RuntimeError):
    """A message to or from a peer failed: its process is gone, or it did not answer in time."""


def request_tag(request: int, index: int) -> int:
    if index >= _PER_REQUEST:
        raise ValueError(f"a checkpoint request uses at most {_PER_REQUEST} messages")
    return 1 + (request % _WINDOW) * _PER_REQUEST + index


def _lazy_gloo_group(ranks: list[int], whole_world: bool):
    """A new gloo group of ``ranks`` whose pairs connect on first use. Every rank of the default group
    calls ``new_group`` when ``ranks`` is all of it; a subgroup is created by its members alone. Its own
    timeout, JOIN_DEADLINE_S, bounds what no deadline here can: connecting a pair (to a peer that
    exited mid-handshake, gloo would otherwise wait for the default group's 30 minutes)."""
    saved = os.environ.get("TORCH_GLOO_LAZY_INIT")
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    timeout = datetime.timedelta(seconds=JOIN_DEADLINE_S)
    try:
        if whole_world:
            return dist.new_group(backend="gloo", timeout=timeout, group_desc="fused_zero_checkpoint")
        return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True,
                              group_desc="fused_zero_checkpoint")
    finally:
        if saved is None:
            del os.environ["TORCH_GLOO_LAZY_INIT"]
        else:
            os.environ["TORCH_GLOO_LAZY_INIT"] = saved


class Channel:
    """Point-to-point messages between the ranks of one DDP group, with deadlines.

    Attributes:
        group: the gloo process group; ``rank`` and ``size`` are this rank's place in it, which is
            its place in the DDP group (the same ranks, in the same order).
        abandoned: the works (and their tensors) given up on at a deadline, kept so that nothing
            gloo may still write into is freed.
    """

    def __init__(self, ddp_group):
        ranks = dist.get_process_group_ranks(ddp_group)
        if ranks != sorted(ranks):
            raise ValueError(f"fused_zero's checkpoint channel needs the DDP group's ranks in order, got {ranks}")
        self.group = _lazy_gloo_group(ranks, whole_world=len(ranks) == dist.get_world_size())
        self.rank, self.size = self.group.rank(), self.group.size()
        self.abandoned: list = []

    def start_send(self, tensor: torch.Tensor, peer: int, tag: int):
        try:  # with lazy connections, the first message to a peer connects, and may fail right here
            return self.group.send([tensor], peer, tag)
        except RuntimeError as e:
            raise self._failed(e, "sending to", peer, None) from None

    def start_recv(self, tensor: torch.Tensor, peer: int, tag: int):
        try:
            return self.group.recv([tensor], peer, tag)
        except RuntimeError as e:
            raise self._failed(e, "receiving from", peer, None) from None

    def wait(self, work, tensor, peer: int, what: str, deadline_s: float) -> None:
        """Wait for ``work`` (a message of ``tensor`` to or from ``peer``); ChannelError on failure."""
        try:
            work.wait(datetime.timedelta(seconds=deadline_s))
        except RuntimeError as e:
            self.abandoned.append((work, tensor))
            raise self._failed(e, what, peer, deadline_s) from None

    @staticmethod
    def _failed(e: RuntimeError, what: str, peer: int, deadline_s: float | None) -> ChannelError:
        text = str(e).lower()
        timed_out = "timed out" in text or "timeout" in text
        why = f"no answer within {deadline_s:.0f} s" if timed_out and deadline_s else "its process is gone"
        return ChannelError(f"{what} rank {peer} failed ({why}; gloo: {str(e).splitlines()[0][:160]})")

    def send(self, tensor: torch.Tensor, peer: int, tag: int, deadline_s: float) -> None:
        self.wait(self.start_send(tensor, peer, tag), tensor, peer, "sending to", deadline_s)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int, deadline_s: float) -> None:
        self.wait(self.start_recv(tensor, peer, tag), tensor, peer, "receiving from", deadline_s)

    def send_text(self, text: str, peer: int, tag: int, deadline_s: float) -> None:
        data = text.encode()[:TEXT_BYTES]
        buf = torch.zeros(TEXT_BYTES, dtype=torch.uint8, device="cpu")
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
        self.send(buf, peer, tag, deadline_s)

    def recv_text(self, peer: int, tag: int, deadline_s: float) -> str:
        buf = torch.zeros(TEXT_BYTES, dtype=torch.uint8, device="cpu")
        self.recv(buf, peer, tag, deadline_s)
        return bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace")
