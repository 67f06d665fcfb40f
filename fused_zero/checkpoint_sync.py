"""The handshake that lets rank 0 call ``optimizer.state_dict()`` alone, as nanoGPT's ``train.py`` does
under ``if master_process:``, and that makes every other misuse fail fast instead of hanging.

Why it is needed: gathering the state is a collective. Without a handshake, rank 0 waits in
``state_dict()`` while the other ranks train on into their next backward, where the comm hook's
reduce-scatter waits for rank 0: a hang until the process group's timeout (30 minutes by default).

How: at the start of every synced iteration (the comm hook's first bucket, before any collective of
the iteration) and in every ``state_dict()``, the ranks exchange one message through the process
group's c10d store. Rank 0 posts message ``m``: ``go`` from its hook, ``ckpt:<to>`` from its
``state_dict()``. Every other rank waits for message ``m`` (as long as a collective would: the
store's timeout, the process group's when torch built the store) and answers where it is: at its
hook, or in its own ``state_dict()`` (the all-ranks contract). Rank 0 waits for every answer before
it issues a collective:

- ``go``, every rank at its hook: the iteration goes on (the steady state: two store round trips).
- ``ckpt``, every rank at its hook (rank 0 alone): rank 0 posts the verdict ``serve``; the other
  ranks run the same gathers from their hook (``to=0``: only rank 0 materializes the dict), then wait
  for the next message.
- ``ckpt``, every rank in ``state_dict(to)`` with rank 0's ``to``: served as today.
- anything else (a rank in ``state_dict()`` while rank 0 trains on, ranks that disagree on ``to``, some
  ranks in ``state_dict()`` and others training): every rank involved raises at once, naming the fix.
- rank 0 in ``state_dict()`` and some rank never answers (it stopped training, or waits elsewhere):
  rank 0 raises after ``JOIN_DEADLINE_S`` and posts ``abort``, so that a late rank raises too.

Waiting (not polling) is what makes it work: a rank that reaches its hook before rank 0 enters
``state_dict()`` must not already be inside the reduce-scatter.

DDP's forward starts with collectives of its own on some iterations: the bucket rebuild (once, at the
second iteration, the third with ``static_graph``) and the broadcast of module buffers
(``broadcast_buffers=True`` and a model with buffers). A rank that trains on meets them in its forward,
before the hook. So ``state_dict()`` first runs those collectives itself, exactly when the rank's next
forward would have (``_run_ddp_forward_collectives``); that forward then skips them, as it does after
an evaluation forward through the DDP module. The one case left is DDP's own: a rank-0-only forward
through a DDP that broadcasts buffers in the same window as the bucket rebuild mismatches DDP's
collectives with plain torch.optim too.

Keys are deleted once consumed (the last answerer deletes the message and the answers, rank 0 the
summary and, one message later, the verdict): the store holds a bounded handful of keys.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

JOIN_DEADLINE_S = 60.0
"""How long rank 0 waits in ``state_dict()`` for the other ranks to join, whatever the process
group's timeout. They are normally waiting at their hook already; tests lower it."""

_ANSWER_HOOK = 1  # at the iteration start
_ANSWER_IN_STATE_DICT = 1 + (1 << 16)  # in state_dict() with rank 0's ``to``
_ANSWER_WRONG = 1 + (1 << 32)  # in state_dict() while rank 0 trains on, or another ``to``
_MASK = (1 << 16) - 1

_handshakes = itertools.count()  # one key namespace per optimizer, built in the same order on every rank

USAGE = ("call optimizer.state_dict() on every rank, or on rank 0 only (the other ranks then serve it "
         "from their next backward)")


class CheckpointSyncError(RuntimeError):
    """The ranks did not meet in ``state_dict()``; raised on every rank involved."""


def _group_store(group) -> dist.Store:
    getter = getattr(c10d, "_get_process_group_store", None)
    return getter(group) if getter is not None else c10d._get_default_store()


def _run_ddp_forward_collectives(ddp) -> None:
    """The collectives DDP's next forward would start with (``DistributedDataParallel._pre_forward``):
    the one-time bucket rebuild and the buffer broadcast. Run here, they pair with the same collectives
    in the forward of the ranks that train on, and this rank's next forward skips them."""
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params", False):
        return
    reducer = getattr(ddp, "reducer", None)
    if reducer is not None and reducer._rebuild_buckets():
        ddp._has_rebuilt_buckets = True
    if ddp._check_sync_bufs_pre_fwd():
        ddp._sync_buffers()
        ddp.require_forward_param_sync = False


class CheckpointHandshake:
    """One optimizer's side of the handshake.

    Attributes:
        enabled: whether the per-iteration handshake runs (the ``checkpoint_handshake`` option, and more
            than one rank). Without it, ``state_dict()`` still checks that every rank called it.
        seq: the next message's number (the same on every rank).
        failed: why an earlier handshake failed; every later one raises it again.
    """

    def __init__(self, engine, enabled: bool):
        self.engine = engine
        self.rank, self.world = engine.rank, engine.world
        self.enabled = enabled and self.world > 1
        self.store = None
        if self.world > 1:
            self.store = dist.PrefixStore(f"fused_zero/checkpoint_sync/{next(_handshakes)}/",
                                          _group_store(engine.group))
        self.seq = 0
        self.failed: str | None = None
        self._old_verdict: str | None = None  # rank 0: deleted once every rank answered the next message

    # ------------------------------------------------------------------ the two meeting points

    def at_iteration_start(self, serve: Callable[[int], object]) -> None:
        """The comm hook's first bucket of a synced iteration: rank 0 says go; the others wait for it,
        serving any ``state_dict()`` that rank 0 runs alone meanwhile (``serve(to)`` runs the gathers)."""
        if not self.enabled:
            return
        self._check_alive()
        if self.rank == 0:
            arrived = self._post_and_collect("go", deadline=None)
            if arrived >> 32:
                self._fail("another rank is in optimizer.state_dict() while rank 0 trains on: " + USAGE)
            return
        while True:
            message = self._receive(deadline=None)
            self._answer(_ANSWER_HOOK)
            if message == "go":
                self.seq += 1
                return
            serve(self._verdict())

    def state_dict(self, to: int | None, gather: Callable[[int | None], dict | None]) -> dict | None:
        """Run ``gather(to)`` once every rank joined: in its own ``state_dict(to)``, or (rank 0 alone)
        from its hook."""
        if self.world == 1:
            return gather(to)
        self._check_alive()
        if self.enabled:
            _run_ddp_forward_collectives(self.engine.ddp)
        if self.rank == 0:
            arrived = self._post_and_collect(f"ckpt:{to}", deadline=JOIN_DEADLINE_S)
            plan, error = self._decide(to, arrived)
            self.store.set(self._key("verdict"), error or f"serve:{plan}")
            self._old_verdict = self._key("verdict")
            self.seq += 1
            if error:
                self._fail(error)
            return gather(plan)
        message = self._receive(deadline=None if self.enabled else JOIN_DEADLINE_S)
        if message == "go":
            self._answer(_ANSWER_WRONG)
            self._fail(f"optimizer.state_dict() was called on rank {self.rank} while rank 0 trains on: "
                       + USAGE)
        rank0_to = _parse_to(message)
        if rank0_to != to:
            self._answer(_ANSWER_WRONG)
            self._fail(f"optimizer.state_dict(to={to}) on rank {self.rank}, to={rank0_to} on rank 0: "
                       "pass the same `to` on every rank")
        self._answer(_ANSWER_IN_STATE_DICT)
        return gather(self._verdict())

    # ------------------------------------------------------------------ rank 0

    def _post_and_collect(self, message: str, deadline: float | None) -> int:
        """Post message ``seq``; return the sum of the other ranks' answers. ``deadline``: seconds to wait
        for them (None: the store's timeout, as a collective's wait)."""
        store = self.store
        store.set(self._key("msg"), message)
        summary = self._key("all")
        if deadline is not None:
            try:
                store.wait([summary], datetime.timedelta(seconds=deadline))
            except dist.DistStoreError:
                self.store.set(self._key("verdict"), "abort:rank 0 gave up waiting")
                self._fail(
                    f"rank 0 is in optimizer.state_dict() and the other ranks did not join within "
                    f"{deadline:.0f} s: after a call on rank 0 alone the other ranks must go on training "
                    "(they join from their next backward); otherwise call it on every rank")
        try:
            arrived = int(store.get(summary))
        except dist.DistStoreError:
            self._fail("rank 0 waited for the other ranks to reach their next backward or state_dict() "
                       f"longer than the process group's store timeout ({store.timeout})")
        store.delete_key(summary)
        if self._old_verdict is not None:  # every rank has read it: they answered this message after it
            store.delete_key(self._old_verdict)
            self._old_verdict = None
        if not message.startswith("ckpt"):
            self.seq += 1
        return arrived

    def _decide(self, to: int | None, arrived: int) -> tuple[int | None, str | None]:
        """The gathers' ``to`` for everyone, or why they must not run."""
        others = self.world - 1
        in_state_dict, wrong = (arrived >> 16) & _MASK, arrived >> 32
        if wrong:
            return None, "the ranks called optimizer.state_dict() with different `to`: pass the same `to` on every rank"
        if in_state_dict == others:
            return to, None
        if in_state_dict:
            return None, (f"rank 0 and {in_state_dict} of the {others} other ranks are in optimizer.state_dict(), "
                          f"the rest train on: {USAGE}")
        if to not in (None, 0):
            return None, (f"optimizer.state_dict(to={to}) was called on rank 0 only: rank {to} cannot receive "
                          "the dict from its backward; call it with to=0 (or none) on rank 0 alone, or on every rank")
        return 0, None

    # ------------------------------------------------------------------ the other ranks

    def _receive(self, deadline: float | None) -> str:
        key = self._key("msg")
        try:
            if deadline is not None:
                self.store.wait([key], datetime.timedelta(seconds=deadline))
            return self.store.get(key).decode()
        except dist.DistStoreError:
            where = "in optimizer.state_dict()" if deadline is not None else "at its next backward"
            self._fail(f"rank {self.rank} waited {where} for rank 0, which neither reached its next backward "
                       f"nor called optimizer.state_dict() in time: {USAGE}")

    def _answer(self, code: int) -> None:
        store = self.store
        total = store.add(self._key("ans"), code)
        if total & _MASK == self.world - 1:  # the last to answer: everyone has read the message
            store.set(self._key("all"), str(total))
            store.delete_key(self._key("msg"))
            store.delete_key(self._key("ans"))

    def _verdict(self) -> int | None:
        """Wait for rank 0's verdict on message ``seq`` (it posts one within JOIN_DEADLINE_S)."""
        key = self._key("verdict")
        self.seq += 1
        try:
            self.store.wait([key], datetime.timedelta(seconds=2 * JOIN_DEADLINE_S))
            verdict = self.store.get(key).decode()
        except dist.DistStoreError:
            self._fail(f"rank {self.rank} joined optimizer.state_dict() but rank 0 gave no verdict")
        kind, _, value = verdict.partition(":")
        if kind != "serve":
            self._fail(f"rank 0 abandoned optimizer.state_dict() ({value}): {USAGE}")
        return _parse_to(value)

    # ------------------------------------------------------------------ both

    def _key(self, what: str) -> str:
        return f"{self.seq}/{what}"

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise CheckpointSyncError(f"an earlier optimizer.state_dict() handshake failed ({self.failed}); "
                                      "this optimizer cannot go on: restart from the last checkpoint")

    def _fail(self, why: str):
        self.failed = why
        raise CheckpointSyncError(why)


def _parse_to(text: str) -> int | None:
    value = text.partition(":")[2] if text.startswith("ckpt") else text
    return None if value == "None" else int(value)


__all__ = ["JOIN_DEADLINE_S", "CheckpointHandshake", "CheckpointSyncError", "USAGE"]
