"""The two checkpoint threads of one DDP process group in this process (their protocol: peers.py).

- The **listener** takes this rank's mailbox messages (inbox.py), in order: "rank r is in
  ``state_dict()`` for optimizer n at version v (request k)", "rank r asks this rank for its slices"
  (acknowledged at once, through r's mailbox), "rank r gave up", and, for this rank's own requests,
  the other ranks' acknowledgements. Announcements are recorded at once, so a rank in
  ``state_dict(to=r)`` learns that r asked however busy the server is.
- The **server** sends what is asked for, one request at a time: a refusal, or this rank's slices
  over the gloo channel (channel.py, peers.py), and records each request's outcome (what
  ``state_dict(to=r)`` on this rank waits for).

Idle, the listener is blocked in one store ``wait`` and the server on a Python condition: no store
request, no message, no gloo wait. At exit an ``atexit`` handler leaves a "stop" in this rank's own
mailbox; the listener takes the messages before it, and the two threads go on until every request
announced before the stop is answered (up to ``channel.EXIT_DEADLINE_S``: a peer must not lose its
checkpoint because this rank is done), then end, so that none is inside a C++ call when the
interpreter finalizes. A request announced after that fails on the requester as soon as this process
is gone, saying so.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import threading
import time
import weakref

from . import channel
from .channel import Channel, ChannelError, request_tag
from .inbox import Inbox

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
        inbox: the ranks' mailboxes (inbox.py).
        optimizers: number -> weak reference to that optimizer's CheckpointPeers (numbered in attach
            order, the same on every rank).
        announced: (optimizer number, rank) -> that rank's recent announcements, (version, to, k).
        asked: the requests to serve, in the order they came.
        in_flight: (rank, k) of requests announced here and not yet answered.
        outcomes: (rank, k) -> "" (served) or why not, for announced requests that were answered.
        acks: (rank, k) of this rank's own requests that rank has taken (it serves them before exiting).
        cond: guards the five above; notified whenever one changes.
        requests: this rank's own request numbers (they pick the messages' tags).
    """

    def __init__(self, ddp_group):
        self.ddp_group = ddp_group
        self.channel = Channel(ddp_group)
        self.inbox = Inbox(ddp_group)
        self.rank = self.channel.rank
        self.optimizers: dict[int, weakref.ref] = {}
        self.announced: dict[tuple[int, int], collections.deque] = {}
        self.asked: collections.deque = collections.deque()
        self.in_flight: set[tuple[int, int]] = set()
        self.outcomes: collections.OrderedDict = collections.OrderedDict()
        self.acks: set[tuple[int, int]] = set()
        self.cond = threading.Condition()
        self.requests = itertools.count()
        self._numbers = itertools.count()
        self.closing: float | None = None  # when the stop came (monotonic), or None
        self.threads = [threading.Thread(target=target, name=f"fused_zero-checkpoint-{name}", daemon=True)
                        for target, name in ((self._listen, "listener"), (self._serve, "server"))]
        for thread in self.threads:
            thread.start()

    def register(self, peers) -> int:
        with self.cond:
            number = next(self._numbers)
            self.optimizers[number] = weakref.ref(peers)
            self.cond.notify_all()
        return number

    def _optimizer(self, number: int):
        """Optimizer ``number``'s CheckpointPeers, or None. A requester may be ahead of this rank: it
        returned from attaching that optimizer while this rank is still attaching it, so a number not
        registered yet is waited for (up to JOIN_DEADLINE_S); one registered and since collected is not."""
        with self.cond:
            ref = self.wait(lambda: self.optimizers.get(number), channel.JOIN_DEADLINE_S)
        return ref() if ref is not None else None

    def _done(self) -> bool:
        """Under ``cond``: stopping, with nothing announced left to answer (or out of time for it)."""
        return self.closing is not None and (
            not self.in_flight or time.monotonic() > self.closing + channel.EXIT_DEADLINE_S)

    def _listen(self) -> None:
        try:
            while True:
                msg = self.inbox.take(timeout_s=1.0 if self.closing is not None else None)
                if msg is not None and msg["kind"] == "serve":  # committed: it is served before this rank exits
                    self.inbox.post(msg["src"], {"kind": "queued", "k": msg["k"], "src": self.rank})
                with self.cond:
                    if msg is not None:
                        self._record(msg)
                    self.cond.notify_all()
                    if self._done():
                        return
        except Exception:  # the store is gone: nobody can reach this rank any more
            with self.cond:
                self.closing = self.closing or time.monotonic() - channel.EXIT_DEADLINE_S
                self.cond.notify_all()

    def _record(self, msg: dict) -> None:
        """Under ``cond``: one mailbox message."""
        kind, src = msg["kind"], msg.get("src")
        if kind == "stop":
            self.closing = time.monotonic()
        elif kind == "announce":
            self.announced.setdefault((msg["number"], src), collections.deque(maxlen=64)).append(
                (msg["version"], msg["to"], msg["k"]))
            self.in_flight.add((src, msg["k"]))
        elif kind == "serve":
            self.asked.append(msg)
        elif kind == "cancel":
            self._answered(src, msg["k"], "the requester gave up before asking this rank")
        elif kind == "queued":
            self.acks.add((src, msg["k"]))

    def _answered(self, src: int, k: int, why: str) -> None:
        """Under ``cond``: request k of ``src`` got its answer."""
        self.in_flight.discard((src, k))
        self.outcomes[(src, k)] = why
        while len(self.outcomes) > _OUTCOMES_KEPT:
            self.outcomes.popitem(last=False)

    def _serve(self) -> None:
        while True:
            with self.cond:
                while not self.asked and not self._done():
                    self.cond.wait(1.0 if self.closing is not None else None)
                if not self.asked:
                    return
                msg = self.asked.popleft()
            src, k = msg["src"], msg["k"]
            why = "this rank could not send its slices (the requester's process is gone or stuck)"
            try:
                peers = self._optimizer(msg["number"])
                if peers is None:
                    why = (f"rank {self.rank} has no fused_zero optimizer number {msg['number']} on this process "
                           f"group (none attached within {channel.JOIN_DEADLINE_S:.0f} s, or it was deleted): attach "
                           "the optimizers in the same order on every rank")
                else:
                    why, record = peers.ready_for(msg["version"], msg["fingerprint"])
                self.channel.send_text(why, src, request_tag(k, 0), channel.TRANSFER_DEADLINE_S)
                if not why:
                    peers.send_slices(self.channel, src, k, record)
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

    def stop(self) -> None:
        """At exit: answer what was announced before now, then end both threads (module docstring)."""
        try:
            self.inbox.post(self.rank, {"kind": "stop"})  # wakes the listener
        except Exception:  # the store is gone: the listener has ended already
            with self.cond:
                self.closing = time.monotonic() - channel.EXIT_DEADLINE_S
                self.cond.notify_all()
        for thread in self.threads:
            thread.join(timeout=channel.EXIT_DEADLINE_S + 5.0)


@atexit.register
def stop_all() -> None:
    """Every server of this process stopped as at exit, and forgotten: what a process that goes on to
    other process groups (a test suite's kept ranks) calls before destroying the current ones."""
    for server in list(_servers.values()):
        server.stop()
    _servers.clear()
