"""The two checkpoint threads of one DDP process group in this process (their protocol: serving.py).

- The **listener** records announcements: "rank r is in ``state_dict()`` for optimizer n at version v
  (request k)", and cancellations of them. It never blocks on anything but its receive, so a rank in
  ``state_dict(to=r)`` learns at once that r asked, however busy the server is.
- The **server** answers requests, one at a time: a refusal, or this rank's slices (serving.py), and
  records the outcome of each announced request (what ``state_dict(to=r)`` on this rank waits for).

Both are daemon threads, blocked in a receive when idle; they need no stopping. What must not happen
is a process exiting while a peer is still being served by it (the peer's request would fail, and
gloo may abort the exiting process mid-send): an ``atexit`` handler lets every announced request finish
first (up to ``channel.EXIT_DEADLINE_S``). A request announced only after this process has exited fails on
the requester at once, saying so.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import threading
import time
import weakref

import torch

from . import channel
from .channel import ANNOUNCE_TAG, REQUEST_TAG, Channel, ChannelError, request_tag

CANCELLED = -2
"""``to`` of an announcement that withdraws request k (the requester failed before asking this rank)."""

_OUTCOMES_KEPT = 256

_servers: dict[int, ShardServer] = {}  # id(DDP process group) -> its server (which keeps the group alive)


def server_for(ddp_group) -> ShardServer:
    """The group's server in this process, started at the first optimizer attached to it (a collective:
    every rank of the group attaches)."""
    server = _servers.get(id(ddp_group))
    if server is None or server.ddp_group is not ddp_group:
        server = _servers[id(ddp_group)] = ShardServer(ddp_group)
    return server


class ShardServer:
    """Attributes:
        channel: the checkpoint's own gloo group (channel.py); ``rank`` this rank's place in it.
        optimizers: number -> weak reference to that optimizer's CheckpointPeers (numbered in attach
            order, the same on every rank).
        announced: (optimizer number, rank) -> that rank's recent announcements, (version, to, k).
        in_flight: (rank, k) of requests announced here and not yet answered.
        outcomes: (rank, k) -> "" (served) or why not, for announced requests that were answered.
        cond: guards the three; notified whenever one changes.
        requests: this rank's own request numbers (they pick the messages' tags).
    """

    def __init__(self, ddp_group):
        self.ddp_group = ddp_group
        self.channel = Channel(ddp_group)
        self.rank = self.channel.rank
        self.optimizers: dict[int, weakref.ref] = {}
        self.announced: dict[tuple[int, int], collections.deque] = {}
        self.in_flight: set[tuple[int, int]] = set()
        self.outcomes: collections.OrderedDict = collections.OrderedDict()
        self.cond = threading.Condition()
        self.requests = itertools.count()
        self._numbers = itertools.count()
        for target, name in ((self._listen, "listener"), (self._serve, "server")):
            threading.Thread(target=target, name=f"fused_zero-checkpoint-{name}", daemon=True).start()

    def register(self, peers) -> int:
        number = next(self._numbers)
        self.optimizers[number] = weakref.ref(peers)
        return number

    def _listen(self) -> None:
        while True:
            msg = torch.zeros(4, dtype=torch.int64)
            try:
                src = self.channel.recv_any(msg, ANNOUNCE_TAG)
            except Exception:  # the group is gone (destroyed): nothing left to listen to
                return
            number, version, to, k = msg.tolist()
            with self.cond:
                if to == CANCELLED:
                    self._answered(src, k, "the requester gave up before asking this rank")
                else:
                    self.announced.setdefault((number, src), collections.deque(maxlen=64)).append((version, to, k))
                    self.in_flight.add((src, k))
                self.cond.notify_all()

    def _answered(self, src: int, k: int, why: str) -> None:
        """Under ``cond``: request k of ``src`` got its answer."""
        self.in_flight.discard((src, k))
        self.outcomes[(src, k)] = why
        while len(self.outcomes) > _OUTCOMES_KEPT:
            self.outcomes.popitem(last=False)

    def _serve(self) -> None:
        while True:
            msg = torch.zeros(5, dtype=torch.int64)
            try:
                src = self.channel.recv_any(msg, REQUEST_TAG)
            except Exception:
                return
            number, version, _, k, fingerprint = msg.tolist()
            why = "this rank could not send its slices (the requester's process is gone or stuck)"
            try:
                ref = self.optimizers.get(number)
                peers = ref() if ref is not None else None
                if peers is None:
                    why = (f"rank {self.rank} has no fused_zero optimizer number {number} on this process group "
                           "(attach the optimizers in the same order on every rank)")
                else:
                    why = peers.ready_for(version, fingerprint)
                self.channel.send_text(why, src, request_tag(k, 0), channel.TRANSFER_DEADLINE_S)
                if not why:
                    peers.send_slices(self.channel, src, k)
            except ChannelError:
                pass  # the requester's process is gone or stuck; it raised on its side
            except Exception as e:  # never let the thread die: later requests would wait for nothing
                why = f"rank {self.rank} failed to serve: {type(e).__name__}: {e}"
                try:
                    self.channel.send_text(why, src, request_tag(k, 0), channel.TRANSFER_DEADLINE_S)
                except Exception:
                    pass
            with self.cond:
                self._answered(src, k, why)
                self.cond.notify_all()

    def wait(self, until, deadline_s: float):
        """Under ``cond``: wait until ``until()`` returns something other than None (returned), or None
        once ``deadline_s`` has passed."""
        end = time.monotonic() + deadline_s
        while True:
            found = until()
            left = end - time.monotonic()
            if found is not None or left <= 0:
                return found
            self.cond.wait(min(left, 0.5))


@atexit.register
def _finish_in_flight() -> None:
    """At exit, serve what was announced before leaving (module docstring)."""
    for server in list(_servers.values()):
        with server.cond:
            server.wait(lambda s=server: True if not s.in_flight else None, channel.EXIT_DEADLINE_S)
