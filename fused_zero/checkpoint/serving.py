"""``optimizer.state_dict()`` on any rank, whatever the other ranks do meanwhile: each rank serves its
shards from a thread of its own, over a CPU process group of its own (channel.py).

Rank 0 calls ``state_dict()`` alone in nanoGPT (under ``if master_process:``) and in the Hugging Face
Trainer (``should_save``). Meanwhile the other ranks go on: into their next forward and backward, a
logging all-reduce, the Trainer's token-count gather, another model's DDP, an evaluation. Whatever
collective they are in waits for rank 0, so they cannot gather anything for it; their server threads
can.

What is served is the state after the last step every rank completed, on every rank, without locking
the training thread out:

- **Versions.** Every rank counts its completed optimizer steps and loads (``published``, called by
  the training thread after each). A request carries the requester's count; a server waits (up to
  ``JOIN_DEADLINE_S``) until its own rank has published that count, and refuses any other.
- **Why nothing moves under the server's reads.** A rank's state regions, and the registry saying
  where they are, change only in ``step()`` (before it publishes), in a load (after a collective
  check) or after a collective of the next iteration (its reductions, a reshard's all_to_all). A
  requester inside ``state_dict()`` is between steps, so it has joined none of its next iteration's
  collectives: no rank's state can change until every requester has been served. ``state_dict()``
  between a backward and ``step()`` is therefore refused, on the caller, at once.
- **GPU.** ``published`` records an event on the training thread's current stream, which ``step()``
  orders after every update (and keeps the side stream's last update event): the server's reads wait
  for those on a stream of their own, never for the side stream itself, where the next iteration's
  updates may already be queued behind reductions that wait for the requester.
- **No per-iteration cost** beyond the count (and, on CUDA, one event): no store traffic, no message.

Who talks to whom, per ``state_dict()`` call on rank r (``to=None`` or ``to=r``): r announces itself to
every rank (a listener thread records it: that is how ``state_dict(to=r)`` on the other ranks learns
that r asked), then asks the ranks one at a time, in rank order, for their slices, which their server
thread sends (a refusal first, if any). Several requesters at once (``state_dict()`` on every rank)
never deadlock: each holds one server at a time and takes them in the same order.
``state_dict(to=r)`` on a rank other than r returns None once r's announcement arrived, or raises
after ``JOIN_DEADLINE_S``.

Lifetime: the two threads are daemons, blocked in a receive when idle; one pair per DDP process group
and process, shared by its optimizers (numbered in attach order, the same on every rank). A process
exits, or destroys its process groups, with them blocked; a peer that exits mid-request makes the
request fail at once on the other side with this module's error.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import weakref

import torch

from .canonical import layout_fingerprint, sharded_slices
from .channel import ANNOUNCE_TAG, REQUEST_TAG, Channel, ChannelError, request_tag

JOIN_DEADLINE_S = 60.0
"""How long a server waits for its rank to complete the requester's step, and ``state_dict(to=r)``
waits for rank r to ask. Tests lower it."""

TRANSFER_DEADLINE_S = 300.0
"""How long one message may take: a server busy with another requester answers late, never not at all.
Only a hung process runs it out (a process that exits fails a message at once)."""

WINDOW = 8
"""Messages in flight per peer while slices are sent and received."""

USAGE = ("call optimizer.state_dict() between steps (before the backward or after optimizer.step()), on "
         "any rank or ranks; with to=r, rank r must call it too")


class CheckpointSyncError(RuntimeError):
    """``state_dict()`` could not be served; raised on the calling ranks, with what to do."""


_servers: dict[int, ShardServer] = {}  # id(DDP process group) -> its server (which keeps the group alive)


def peers_for(engine) -> CheckpointPeers:
    """This optimizer's side of rank-0-only (any-rank) ``state_dict()``; at ``attach``, on every rank."""
    if engine.world == 1:
        return CheckpointPeers(engine, None)
    server = _servers.get(id(engine.group))
    if server is None or server.ddp_group is not engine.group:
        server = _servers[id(engine.group)] = ShardServer(engine.group)
    return CheckpointPeers(engine, server)


class ShardServer:
    """One DDP process group's checkpoint threads in this process: a listener for announcements and a
    server for requests, over one Channel, for every optimizer attached to that group.

    Attributes:
        optimizers: number -> weak reference to that optimizer's CheckpointPeers.
        announced: (optimizer number, rank) -> the (version, to) of that rank's recent announcements.
        cond: guards ``announced``; notified on each announcement.
        requests: this rank's request numbers (they pick the messages' tags).
    """

    def __init__(self, ddp_group):
        self.ddp_group = ddp_group
        self.channel = Channel(ddp_group)
        self.rank = self.channel.rank
        self.optimizers: dict[int, weakref.ref] = {}
        self.announced: dict[tuple[int, int], collections.deque] = {}
        self.cond = threading.Condition()
        self.requests = itertools.count()
        self._numbers = itertools.count()
        for target, name in ((self._listen, "listener"), (self._serve, "server")):
            threading.Thread(target=target, name=f"fused_zero-checkpoint-{name}", daemon=True).start()

    def register(self, peers: CheckpointPeers) -> int:
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
            number, version, to, _ = msg.tolist()
            with self.cond:
                self.announced.setdefault((number, src), collections.deque(maxlen=16)).append((version, to))
                self.cond.notify_all()

    def _serve(self) -> None:
        while True:
            msg = torch.zeros(5, dtype=torch.int64)
            try:
                src = self.channel.recv_any(msg, REQUEST_TAG)
            except Exception:
                return
            number, version, _, k, fingerprint = msg.tolist()
            try:
                ref = self.optimizers.get(number)
                peers = ref() if ref is not None else None
                if peers is None:
                    why = (f"rank {self.rank} has no fused_zero optimizer number {number} on this process group "
                           "(attach the optimizers in the same order on every rank)")
                else:
                    why = peers.ready_for(version, fingerprint)
                self.channel.send_text(why, src, request_tag(k, 0), TRANSFER_DEADLINE_S)
                if not why:
                    peers.send_slices(self.channel, src, k)
            except ChannelError:
                continue  # the requester's process is gone or stuck; it raised on its side
            except Exception as e:  # never let the thread die: later requests would wait for nothing
                try:
                    self.channel.send_text(f"rank {self.rank} failed to serve: {type(e).__name__}: {e}", src,
                                           request_tag(k, 0), TRANSFER_DEADLINE_S)
                except Exception:
                    pass


class CheckpointPeers:
    """One optimizer's ``state_dict()`` across ranks: its version, what it serves, what it asks for.

    Attributes:
        version: completed steps and loads on this rank (the same on every rank between steps).
        server: the group's ShardServer (None at world size 1); ``number`` this optimizer's there.
    """

    def __init__(self, engine, server: ShardServer | None):
        self.engine = engine
        self.server = server
        self.version = 0
        self.number = server.register(self) if server is not None else None
        self._events: tuple = ()  # CUDA: what the server's reads wait for (see published)
        self._stream = None  # CUDA: the server's own stream, made when first needed
        self._cond = threading.Condition()
        self._waiting = False

    # ------------------------------------------------------------------ the training thread

    def published(self) -> None:
        """A step (or a load) completed on this rank: its state may be served as this version."""
        if self.server is None:
            return
        e = self.engine
        if e.side.stream is not None:
            events = [torch.cuda.current_stream(e.device).record_event()]
            self._events = tuple(events + ([e.side.updated] if e.side.updated is not None else []))
        self.version += 1
        if self._waiting:
            with self._cond:
                self._cond.notify_all()

    def state_dict(self, to: int | None, make_builder):
        """``make_builder()``: a canonical.StateDictBuilder of this engine, made only where the dict is
        built. Returns the dict, or None on ranks other than ``to``."""
        e = self.engine
        if e.iteration.invoked:
            raise CheckpointSyncError("optimizer.state_dict() was called between a backward and optimizer.step(): "
                                      "the state is served as it is after a step; " + USAGE)
        if self.server is None:
            return make_builder().local().result()
        if to is not None and to != e.rank:
            self._await_announcement(to)
            return None
        k = next(self.server.requests)
        self._announce(to, k)
        builder = make_builder().local()
        for src in range(e.world):
            if src != e.rank:
                self._fetch_from(src, k, builder)
        return builder.result()

    def _announce(self, to: int | None, k: int) -> None:
        ch = self.server.channel
        msg = torch.tensor([self.number, self.version, -1 if to is None else to, k], dtype=torch.int64)
        works = [(ch.start_send(msg, r, ANNOUNCE_TAG), r) for r in range(self.engine.world) if r != self.engine.rank]
        try:
            for work, r in works:
                ch.wait(work, msg, r, "announcing optimizer.state_dict() to", TRANSFER_DEADLINE_S)
        except ChannelError as err:
            raise CheckpointSyncError(str(err)) from None

    def _fetch_from(self, src: int, k: int, builder) -> None:
        """Ask rank ``src`` for its slices and add them to ``builder``, ``WINDOW`` messages in flight."""
        ch, e = self.server.channel, self.engine
        request = torch.tensor([self.number, self.version, 0, k, builder.fingerprint], dtype=torch.int64)
        try:
            ch.send(request, src, REQUEST_TAG, TRANSFER_DEADLINE_S)
            why = ch.recv_text(src, request_tag(k, 0), TRANSFER_DEADLINE_S)
            if why:
                raise CheckpointSyncError(f"rank {src} refused to serve its shards to rank {e.rank}: {why}")
            pending = collections.deque()
            for i, (shard, name) in enumerate(builder.slices, start=1):
                buf = torch.empty(shard.layout.shard, dtype=torch.float32)
                pending.append((ch.start_recv(buf, src, request_tag(k, i)), buf, shard, name))
                if len(pending) >= WINDOW or i == len(builder.slices):
                    while pending:
                        work, buf, shard, name = pending.popleft()
                        ch.wait(work, buf, src, "receiving optimizer state from", TRANSFER_DEADLINE_S)
                        builder.add(shard, name, src * shard.layout.shard, buf)
        except ChannelError as err:
            raise CheckpointSyncError(f"optimizer.state_dict() on rank {e.rank}: {err}") from None

    def _await_announcement(self, to: int) -> None:
        """``state_dict(to=r)`` on a rank other than r: wait until r has asked for this version."""
        server, version = self.server, self.version
        deadline = time.monotonic() + JOIN_DEADLINE_S
        with server.cond:
            while True:
                queue = server.announced.get((self.number, to), collections.deque())
                while queue and queue[0][0] < version:
                    queue.popleft()  # an older checkpoint this rank did not take part in
                if queue:
                    theirs, _ = queue.popleft()
                    if theirs == version:
                        return
                    raise CheckpointSyncError(f"rank {to} called optimizer.state_dict() at version {theirs}, this "
                                              f"rank {self.engine.rank} at {version} (steps and loads): " + USAGE)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CheckpointSyncError(
                        f"optimizer.state_dict(to={to}) on rank {self.engine.rank}: rank {to} did not call "
                        f"optimizer.state_dict() within {JOIN_DEADLINE_S:.0f} s. Only rank {to} receives the dict, "
                        f"so it must call it too (or call it on rank {to} alone)")
                server.cond.wait(min(left, 0.5))

    # ------------------------------------------------------------------ the server thread

    def ready_for(self, version: int, fingerprint: int) -> str:
        """Why this rank cannot serve ``version`` ("" once it can), waiting up to JOIN_DEADLINE_S for its
        training thread to publish it."""
        deadline = time.monotonic() + JOIN_DEADLINE_S
        with self._cond:
            self._waiting = True
            try:
                while self.version < version and time.monotonic() < deadline:
                    self._cond.wait(min(deadline - time.monotonic(), 0.5))
            finally:
                self._waiting = False
        mine = self.version
        if mine != version:
            return (f"rank {self.engine.rank} is at version {mine} (completed steps and loads), the requester at "
                    f"{version}" + (f", and it did not get there within {JOIN_DEADLINE_S:.0f} s" if mine < version
                                    else "") + ": " + USAGE)
        if layout_fingerprint(self.engine) != fingerprint:
            return f"rank {self.engine.rank} holds another bucket layout than the requester's at the same version"
        return ""

    def send_slices(self, ch: Channel, dst: int, k: int) -> None:
        """This rank's slice of every sharded state region, in the order the requester's builder takes."""
        e = self.engine
        pending = collections.deque()
        order = sharded_slices(e)
        for i, (shard, name) in enumerate(order, start=1):
            lo, _ = shard.layout.region_slice(e.rank)
            data = self._host(shard.state[name][lo:lo + shard.layout.shard])
            pending.append((ch.start_send(data, dst, request_tag(k, i)), data))
            if len(pending) >= WINDOW or i == len(order):
                while pending:
                    work, data = pending.popleft()
                    ch.wait(work, data, dst, "sending optimizer state to", TRANSFER_DEADLINE_S)

    def _host(self, region: torch.Tensor) -> torch.Tensor:
        """``region`` readable by gloo: itself on the CPU; on CUDA a host copy made on this thread's own
        stream once the last published step's updates are done (module docstring, GPU)."""
        if region.device.type == "cpu":
            return region.contiguous()
        if self._stream is None:
            self._stream = torch.cuda.Stream(region.device)
        with torch.cuda.device(region.device), torch.cuda.stream(self._stream):
            for event in self._events:
                self._stream.wait_event(event)
            return region.to("cpu")
