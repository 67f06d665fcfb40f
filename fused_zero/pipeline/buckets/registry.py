"""Which bucket shard holds each parameter's optimizer state, and moving that state when DDP's buckets
change.

At construction the state is laid out as one bucket of every parameter in registration order (per
dtype): what DDP hands the comm hook in its first iteration. When the hook sees a bucket whose
parameters or offsets differ from what is held (DDP rebuilds its buckets after the first iteration, the
second with ``static_graph=True``), the registry builds the new ``BucketLayout``, computes with
``reshard_plan`` which elements of which old regions fill every rank's new region, and moves them in one
``all_to_all_single`` within the shard group (every shard group holds the same state, and moves it
the same way). All ranks see the same buckets, so they compute the same plan with no extra message.
Nothing here knows about iterations, overlap modes or the update.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from ..comm import collectives
from ..comm.profiling import range_push
from .layout import BucketLayout, reshard_plan
from .shard import BucketShard


class ShardRegistry:
    """Attributes:
        where: optimizer parameter index -> (the BucketShard holding its state, its index there).
        by_index: DDP bucket index -> BucketShard (negative keys: the initial layout, before DDP's
            buckets are known).
        layout_changes: how many times state moved to a new bucket layout.
        seen: DDP bucket index -> (weak reference to the bucket's buffer, its shard, layout_changes
            then): what lets the hook skip reading the bucket in full (see ``cached``).
        bucket_reads: how many times a bucket was read in full (``shard_for``); unchanged over an
            iteration means DDP's buckets were all known (arena.py packs the shards then).
        held_decoded: some shard holds 8-bit moments decoded, in fp32, since a load, until DDP's bucket rebuild
            (rebuild.py; set by the load, reset by ``encode_held``).
    """

    def __init__(self, params: list[torch.nn.Parameter], *, state_names: list[list[str]], keeps_master,
                 upload, device: torch.device, topology, members: np.ndarray, state_formats: list[str]):
        """``state_names``: each member's (pipeline/members.py); ``members``, ``state_formats``: each
        parameter's member and moment format (its param group's), by optimizer-wide index."""
        self.params = params
        self.state_names = state_names
        self.members = members
        self.keeps_master = keeps_master
        self.upload = upload  # the kernels' row tables to the device (Triton backend), or None
        self.state_formats = state_formats
        self.device = device
        # the shard group's (topology.py), and which rows count towards global sums (Part.norm_rows)
        self.group, self.world, self.rank = topology.shard_group, topology.shard_size, topology.shard_rank
        self.counts = (topology.counts_slice, topology.counts_tail)
        self.where: dict[int, tuple[BucketShard, int]] = {}
        self.by_index: dict[int, BucketShard] = {}
        self.layout_changes = 0
        self.seen: dict[int, tuple[weakref.ref, BucketShard, int]] = {}
        self.bucket_reads = 0
        self.held_decoded = False

    def install_initial_layout(self, module: torch.nn.Module, pid_of: dict) -> None:
        """State for one bucket per dtype holding every parameter in registration order: what DDP
        hands the hook in its first iteration. Any other bucket reshards from it when it arrives."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for p in module.parameters():  # registration order, as DDP's first bucket
            if p in pid_of:
                by_dtype.setdefault(p.dtype, []).append(pid_of[p])
        for index, pids in enumerate(by_dtype.values()):
            numels = [self.params[i].numel() for i in pids]
            offsets = np.concatenate([[0], np.cumsum(numels)[:-1]]).tolist()
            layout = BucketLayout.build(pids, numels, offsets, self.world, self.rank)
            shard = self._new_shard(layout)
            shard.bind_params()
            shard.init_master_from_params()
            for local, pid in enumerate(pids):
                self.where[pid] = (shard, local)
            self.by_index[-1 - index] = shard  # not a DDP index: replaced as real buckets arrive

    def shards(self) -> list[BucketShard]:
        return list({id(s): s for s, _ in self.where.values()}.values())

    def encode_held(self) -> None:
        """The moments a load held in fp32, encoded in the shards' layouts as they are now (rebuild.py)."""
        for shard in self.shards():
            if shard.held:
                shard.encode_held()
        self.held_decoded = False

    def cached(self, index: int, buffer: torch.Tensor) -> BucketShard | None:
        """The shard of DDP bucket ``index`` if ``buffer`` is the very tensor seen there last time and
        nothing was resharded since; else None (then ``read_bucket`` and ``shard_for``).

        The hook's cheap path. It is safe because DDP allocates new bucket buffers whenever it
        rebuilds its buckets, and a weak reference identifies the tensor itself: a new buffer at the
        address of a freed one is a different object, so it cannot pass for the old bucket.
        """
        seen = self.seen.get(index)
        if seen is not None and seen[0]() is buffer and seen[2] == self.layout_changes:
            return seen[1]
        return None

    @staticmethod
    def read_bucket(bucket, buffer: torch.Tensor, pid_of: dict) -> tuple[list[int], list[int]]:
        """The bucket's parameters (optimizer indices) and their element offsets in its buffer."""
        if buffer.is_sparse:
            raise RuntimeError("fused_zero does not support sparse gradients (nn.Embedding(sparse=True))")
        try:
            pids = [pid_of[p] for p in bucket.parameters()]
        except KeyError:
            raise RuntimeError("DDP reduced a parameter the optimizer does not own") from None
        base, size = buffer.data_ptr(), buffer.element_size()
        return pids, [(g.data_ptr() - base) // size for g in bucket.gradients()]

    def shard_for(self, index: int, pids: list[int], offsets: list[int], buffer: torch.Tensor) -> BucketShard:
        """The shard of DDP bucket ``index``; resharded first if the bucket differs from what is held.
        Remembers ``buffer`` for ``cached``."""
        shard = self._shard_for(index, pids, offsets)
        self.bucket_reads += 1
        self.seen[index] = (weakref.ref(buffer), shard, self.layout_changes)
        return shard

    def _shard_for(self, index: int, pids: list[int], offsets: list[int]) -> BucketShard:
        shard = self.by_index.get(index)
        if shard is not None and shard.layout.same_bucket(pids, offsets):
            return shard
        holder = self.where[pids[0]][0]
        if holder.layout.same_bucket(pids, offsets):  # e.g. the initial layout, guessed right
            self.by_index = {i: s for i, s in self.by_index.items() if s is not holder}
            self.by_index[index] = holder
            return holder
        with range_push("fused_zero.reshard"):
            layout = BucketLayout.build(pids, [self.params[i].numel() for i in pids], offsets,
                                        self.world, self.rank)
            for old in {id(self.where[pid][0]): self.where[pid][0] for pid in pids}.values():
                old.gather.finish()
            new = self._new_shard(layout)
            new.bind_params()
            self._move_state(new)
            for local, pid in enumerate(pids):
                self.where[pid] = (new, local)
            self.by_index[index] = new
            self.by_index = {i: s for i, s in self.by_index.items()
                             if any(self.where[pid][0] is s for pid in s.layout.pids)}
            self.layout_changes += 1
        return new

    def rebuild(self, shards: list[BucketShard]) -> None:
        """Each of ``shards`` built anew over the same bucket, from the parameters' members and the members'
        state names as they are now (an optimizer's ``add_param_group``: parameters no fused_zero optimizer
        updated join one, and their member may keep state it did not before): the parameters bound to it,
        the state of every parameter that had some moved into it (``_move_state``: the same layout, so
        every element keeps its place), a joined parameter's at zero (its masters: the caller's)."""
        for old in shards:
            old.gather.finish()
            new = self._new_shard(old.layout)
            new.bind_params()
            self._move_state(new)
            for local, pid in enumerate(old.layout.pids):
                self.where[pid] = (new, local)
            self.by_index = {i: new if s is old else s for i, s in self.by_index.items()}
        self.layout_changes += 1  # the hook's cached shards are stale

    def _new_shard(self, layout: BucketLayout) -> BucketShard:
        dtype = self.params[layout.pids[0]].dtype
        return BucketShard(
            layout, [self.params[i] for i in layout.pids], state_names=self.state_names,
            master=self.keeps_master(dtype), device=self.device, dtype=dtype,
            members=[int(self.members[i]) for i in layout.pids],
            state_formats=[self.state_formats[i] for i in layout.pids], upload=self.upload,
            counts=self.counts)

    def _move_state(self, new: BucketShard) -> None:
        """Fill ``new``'s region with the state its parameters had, in one all_to_all: decoded to fp32
        from the old shards' formats, encoded into the new shard's (8-bit blocks follow the new rows; a
        block the old layout had too comes out with its codes and scale, see kernels/segments.py)."""
        names = new.names
        if not names:
            return
        plan = [t for t in reshard_plan(new.layout, {pid: (self.where[pid][0].layout, self.where[pid][1])
                                                     for pid in new.layout.pids})
                if self.members[t.pid] >= 0]  # a parameter no fused_zero optimizer updates has no state
        me = self.rank
        sends = sorted((t for t in plan if t.src == me), key=lambda t: t.dst)  # stable: plan order kept
        recvs = sorted((t for t in plan if t.dst == me), key=lambda t: t.src)
        decoded: dict[int, dict[str, torch.Tensor]] = {}

        def old_values(shard: BucketShard) -> dict[str, torch.Tensor]:
            if id(shard) not in decoded:
                decoded[id(shard)] = {n: shard.values(n) for n in names}
            return decoded[id(shard)]

        pieces = [torch.stack([old_values(self.where[t.pid][0])[n][t.src_off:t.src_off + t.length]
                               for n in names], dim=1) for t in sends]
        width = len(names)
        dtype = torch.float32  # the state's dtype, whatever torch's default dtype is
        send = torch.cat(pieces) if pieces else torch.zeros(0, width, dtype=dtype, device=self.device)
        recv = torch.empty(sum(t.length for t in recvs), width, dtype=dtype, device=self.device)
        if self.world == 1:
            recv.copy_(send)
        else:
            send_splits = [sum(t.length for t in sends if t.dst == r) * width for r in range(self.world)]
            recv_splits = [sum(t.length for t in recvs if t.src == r) * width for r in range(self.world)]
            collectives.all_to_all_single(recv.view(-1), send.contiguous().view(-1), recv_splits, send_splits,
                                          self.group)
        filled = {n: torch.zeros(new.layout.region_size, dtype=dtype, device=self.device) for n in names}
        pos = 0
        for t in recvs:
            for f, n in enumerate(names):
                filled[n][t.dst_off:t.dst_off + t.length].copy_(recv[pos:pos + t.length, f])
            pos += t.length
        for n in names:
            new.store_values(n, filled[n])
