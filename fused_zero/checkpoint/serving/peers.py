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
  between a backward and the optimizer's ``step()`` is therefore refused, on the caller, at once; after
  it, another optimizer over the module may still step (pipeline/members.py), which changes its own
  state only.
- **GPU.** ``published`` records an event on the training thread's current stream, which ``step()``
  orders after every update (it joins the side stream): the server's reads wait
  for those on a stream of their own, never for the side stream itself, where the next iteration's
  updates may already be queued behind reductions that wait for the requester.
- **No per-iteration cost** beyond the count (and, on CUDA, one event): no store traffic, no message.

Who talks to whom, per ``state_dict()`` call on rank r (``to=None`` or ``to=r``): r leaves an
announcement in every rank's mailbox in the store (inbox.py; their listener records it at once,
server.py), then asks the ranks one at a time, in rank order, for their slices (a mailbox message),
which their server thread sends over the gloo channel (a refusal first, if any); should r fail on the
way, it withdraws the announcement where it did not ask yet. Several requesters at once
(``state_dict()`` on every rank) never deadlock: each holds one server at a time and takes them in the
same order. ``state_dict(to=r)`` on a rank other than r returns None once that rank has served r (so
no rank leaves while r still needs it), or raises if r did not ask within ``JOIN_DEADLINE_S``. A
checkpoint costs the store O(world size) requests; an iteration costs it none.

All deadlines are ``channel``'s (``JOIN_DEADLINE_S`` for a rank to get somewhere, ``TRANSFER_DEADLINE_S``
for a message). Keep every rank alive until a rank-0-only ``state_dict()`` has returned (any collective
does: the training step after it, a barrier before exiting): a rank that exits first leaves part of the
state unreachable, and the call fails, saying so; one that exits while rank 0 is being served waits for
that to finish (server.py).
"""

from __future__ import annotations

import collections
import time

import torch

from . import channel
from .channel import Channel, ChannelError, request_tag
from .published import Published, Versions
from .server import ShardServer, server_for

WINDOW = 8
"""Messages in flight per peer while slices are sent and received."""

USAGE = ("call optimizer.state_dict() between steps (before the backward or after optimizer.step()), on "
         "any rank or ranks; with to=r, rank r must call it too")


class CheckpointSyncError(RuntimeError):
    """``state_dict()`` could not be served; raised on the calling ranks, with what to do."""


def peers_for(view) -> CheckpointPeers:
    """This optimizer's side of ``state_dict()`` across ranks; at ``attach``, on every rank."""
    return CheckpointPeers(view, server_for(view.ranks.group) if view.ranks.world > 1 else None)


class CheckpointPeers:
    """One optimizer's ``state_dict()`` across ranks: its version, what it serves, what it asks for.

    Attributes:
        version: completed steps and loads on this rank (the same on every rank between steps).
        server: the group's ShardServer (None at world size 1); ``number`` this optimizer's there.
    """

    def __init__(self, view, server: ShardServer | None):
        self.view = view
        self.server = server
        self.versions = Versions()  # what serving each recent version needs (published.py)
        self.number = server.register(self) if server is not None else None
        self._stream = None  # CUDA: the server's own stream, made when first needed
        self.published(by_step=False)  # version 0: the state as attach laid it out

    @property
    def version(self) -> int:
        return self.versions.newest

    # ------------------------------------------------------------------ the training thread

    def published(self, by_step: bool = True) -> None:
        """A step (``by_step``) or a load completed on this rank: its state may be served as this version."""
        view = self.view
        if self.server is None:
            return
        # step() has joined the side stream: the current stream is after it
        events = (view.side.api.current().record_event(),) if view.side.stream is not None else ()
        self.versions.publish(view, events, by_step)

    def state_dict(self, to: int | None, make_builder):
        """``make_builder()``: a canonical.StateDictBuilder of this engine, made only where the dict is
        built. Returns the dict, or None on ranks other than ``to``."""
        view = self.view
        if view.iteration.invoked and view.table.member not in view.iteration.stepped:
            raise CheckpointSyncError("optimizer.state_dict() was called between a backward and optimizer.step(): "
                                      "the state is served as it is after a step; " + USAGE)
        if self.server is None:
            return make_builder().local().result()
        topo = view.ranks.topology
        if to is not None and to != view.ranks.rank:
            if topo.position(to)[0] != topo.replica:
                return None  # rank ``to`` builds its dict from its own shard group (pipeline/buckets/topology.py)
            self._await_served(to)
            return None
        k = next(self.server.requests)
        others = [r for r in topo.shards[topo.replica] if r != view.ranks.rank]  # the ranks holding the other slices
        try:
            self._post(others, {"kind": "announce", "number": self.number, "version": self.version, "to": to,
                                "k": k})
            builder = make_builder().local()
            while others:
                self._fetch_from(others[0], k, builder)
                others.pop(0)
            return builder.result()
        finally:
            if others:  # failed on the way: the ranks not asked yet stop waiting for this request
                try:
                    self._post(others, {"kind": "cancel", "k": k})
                except CheckpointSyncError:
                    pass

    def _post(self, ranks: list[int], message: dict) -> None:
        try:
            for r in ranks:
                self.server.inbox.post(r, {**message, "src": self.view.ranks.rank})
        except Exception as err:  # the store is gone: so is whoever hosted it
            raise CheckpointSyncError(f"optimizer.state_dict() on rank {self.view.ranks.rank} cannot reach the other "
                                      f"ranks through the process group's store ({type(err).__name__}: {err})"
                                      ) from None

    def _fetch_from(self, src: int, k: int, builder) -> None:
        """Ask rank ``src`` for its slices and add them to ``builder``, ``WINDOW`` messages in flight."""
        ch, view = self.server.channel, self.view
        self._post([src], {"kind": "serve", "number": self.number, "version": self.version, "k": k,
                           "fingerprint": builder.fingerprint})
        # no gloo message before src has taken the request (and so serves it before it exits): a
        # lazily connecting pair waits forever for a peer that exited in the middle of the handshake
        server = self.server
        with server.cond:
            taken = server.wait(lambda: True if (src, k) in server.acks else None, channel.JOIN_DEADLINE_S)
            server.acks.discard((src, k))
        if taken is None:
            raise CheckpointSyncError(
                f"optimizer.state_dict() on rank {view.ranks.rank}: rank {src} did not take the request within "
                f"{channel.JOIN_DEADLINE_S:.0f} s (its process is gone or stuck). Keep every rank alive until "
                "optimizer.state_dict() has returned (any collective after it, e.g. a dist.barrier() before "
                "exiting): the other ranks hold their shards of the state")
        deadline = channel.TRANSFER_DEADLINE_S
        try:
            why = ch.recv_text(src, request_tag(k, 0), deadline)
            if why:
                raise CheckpointSyncError(f"rank {src} refused to serve its shards to rank {view.ranks.rank}: {why}")
            pending = collections.deque()
            for i, (shard, name) in enumerate(builder.slices, start=1):
                buf = torch.empty(shard.layout.shard, dtype=torch.float32, device="cpu")  # gloo's, host memory
                pending.append((ch.start_recv(buf, src, request_tag(k, i)), buf, shard, name))
                if len(pending) >= WINDOW or i == len(builder.slices):
                    while pending:
                        work, buf, shard, name = pending.popleft()
                        ch.wait(work, buf, src, "receiving optimizer state from", deadline)
                        builder.add(shard, name, view.ranks.topology.position(src)[1] * shard.layout.shard, buf)
        except ChannelError as err:
            raise CheckpointSyncError(f"optimizer.state_dict() on rank {view.ranks.rank}: {err}. Keep every rank alive "
                                      "until optimizer.state_dict() has returned (any collective after it, e.g. a "
                                      "dist.barrier() before exiting): the other ranks hold their shards of the "
                                      "state") from None

    def _await_served(self, to: int) -> None:
        """``state_dict(to=r)`` on a rank other than r: wait until r has asked for this version (up to
        JOIN_DEADLINE_S) and this rank has served it."""
        server, version, me = self.server, self.version, self.view.ranks.rank

        def announcement():
            queue = server.announced.get((self.number, to))
            while queue and queue[0][0] < version:
                queue.popleft()  # an older checkpoint this rank did not take part in
            return queue.popleft() if queue else None

        with server.cond:
            found = server.wait(announcement, channel.JOIN_DEADLINE_S)
            if found is None:
                raise CheckpointSyncError(
                    f"optimizer.state_dict(to={to}) on rank {me}: rank {to} did not call optimizer.state_dict() "
                    f"within {channel.JOIN_DEADLINE_S:.0f} s. Only rank {to} receives the dict, so it must call it "
                    f"too (or call it on rank {to} alone)")
            theirs, _, k = found
            if theirs != version:
                raise CheckpointSyncError(f"rank {to} called optimizer.state_dict() at version {theirs}, rank {me} "
                                          f"at {version} (completed steps and loads): " + USAGE)
            why = server.wait(lambda: server.outcomes.get((to, k)), channel.TRANSFER_DEADLINE_S)
        if why is None:
            raise CheckpointSyncError(f"rank {me} did not finish serving rank {to} within "
                                      f"{channel.TRANSFER_DEADLINE_S:.0f} s")
        if why:
            raise CheckpointSyncError(f"optimizer.state_dict(to={to}) on rank {me}: rank {to} was not served "
                                      f"here: {why}")

    # ------------------------------------------------------------------ the server thread

    def ready_for(self, version: int, fingerprint: int) -> tuple[str, Published | None]:
        """Why this rank cannot serve ``version`` ("" once it can) and the version's record, waiting up
        to JOIN_DEADLINE_S for its training thread to publish it. A version this rank's host has gone
        past is served from its record (published.py: the host runs ahead of the device)."""
        deadline = time.monotonic() + channel.JOIN_DEADLINE_S
        versions = self.versions
        with versions.cond:
            versions.waiting = True
            try:
                while versions.newest < version and time.monotonic() < deadline:
                    versions.cond.wait(min(deadline - time.monotonic(), 0.5))
            finally:
                versions.waiting = False
            mine, record = versions.newest, versions.get(version)
        if record is None:
            late = f", and it did not get there within {channel.JOIN_DEADLINE_S:.0f} s" if mine < version else ""
            return (f"rank {self.view.ranks.rank} is at version {mine} (completed steps and loads), the requester at "
                    f"{version}{late}: " + USAGE), None
        if record.fingerprint != fingerprint:
            return (f"rank {self.view.ranks.rank} holds another bucket layout than the requester's at the same "
                    "version"), None
        return "", record

    def send_slices(self, ch: Channel, dst: int, k: int, record: Published) -> None:
        """This rank's slice of every sharded state region of ``record``'s version, in the order the
        requester's builder takes."""
        pending = collections.deque()
        for i, (shard, name) in enumerate(record.slices, start=1):
            data = self._host(shard, name, record.events)
            pending.append((ch.start_send(data, dst, request_tag(k, i)), data))
            if len(pending) >= WINDOW or i == len(record.slices):
                while pending:
                    work, data = pending.popleft()
                    ch.wait(work, data, dst, "sending optimizer state to", channel.TRANSFER_DEADLINE_S)

    def _host(self, shard, name: str, events: tuple) -> torch.Tensor:
        """This rank's slice of a state region, in fp32 (decoded where the moments are compact) and
        readable by gloo: where work runs inline (the CPU), the region's own elements where stored in
        fp32; on CUDA a host copy made on this thread's own stream once the served version's updates are
        done (``events``: that version's, never a later one's; module docstring, GPU), the decoding
        included."""
        lo, _ = shard.layout.region_slice(shard.layout.rank)
        api = self.view.side.api
        if api is None:
            return shard.values(name)[lo:lo + shard.layout.shard].contiguous()
        if self._stream is None:
            self._stream = api.copy_stream()
        with api.guard(), api.use(self._stream):
            for event in events:
                self._stream.wait_event(event)
            return api.to_host_blocking(shard.values(name)[lo:lo + shard.layout.shard])
