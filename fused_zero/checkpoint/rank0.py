"""The handshake that lets rank 0 call ``optimizer.state_dict()`` alone, as nanoGPT's ``train.py`` does
under ``if master_process:``, and that makes every other misuse fail fast instead of hanging.

Why it is needed: gathering the state is a collective. Without a handshake, rank 0 waits in
``state_dict()`` while the other ranks train on into their next backward, where the comm hook's
reduce-scatter waits for rank 0: a hang until the process group's timeout (30 minutes by default).

How: the ranks exchange one message per synced iteration and per ``state_dict()`` through the process
group's c10d store, numbered ``m`` (the same on every rank). Rank 0 says what it does next: ``go``
(it trains) or ``ckpt:<to>`` (it is in ``state_dict()``). Every other rank says what it does next:
``train`` or ``sd:<to>``. Each side posts as soon as it knows, at its training forward (the DDP
module's forward with grad enabled and a synced backward ahead, in training mode), else at the comm
hook's first bucket, and reads the other side's where it must know, before any collective: the other
ranks read rank 0's message at their hook (blocking, as long as a collective would wait: the store's
timeout), rank 0 reads every answer at its hook. In the steady state the keys are there when read, so
the handshake costs a few store round trips and no wait.

- ``go`` and every answer ``train``: the iteration goes on.
- ``ckpt`` and every answer ``train`` (rank 0 alone): rank 0 posts the verdict ``serve:0``; the other
  ranks, at their hook, run the same gathers (``to=0``: only rank 0 materializes the dict), then
  answer ``train`` again and wait for the next message.
- ``ckpt`` and every answer ``sd`` with rank 0's ``to``: served as today.
- anything else (a rank in ``state_dict()`` while rank 0 trains on, ranks that disagree on ``to``, some
  ranks in ``state_dict()`` and others training): every rank involved raises at once, naming the fix.
- rank 0 in ``state_dict()`` and some rank never answers: rank 0 raises after ``JOIN_DEADLINE_S`` and
  posts the verdict ``abort``, so that a late rank raises too.

Waiting (not polling) is what makes it work: a rank that reaches its hook before rank 0 enters
``state_dict()`` must not already be inside the reduce-scatter. And since a rank commits at its
training forward, ``state_dict()`` between that forward and its backward is refused.

DDP's forward starts with collectives of its own on some iterations: the bucket rebuild (once, at the
second iteration, the third with ``static_graph``) and the broadcast of module buffers
(``broadcast_buffers=True`` and a model with buffers). A rank that trains on meets them in its forward,
before the hook. So ``state_dict()`` first runs those collectives itself, exactly when the rank's next
forward would have (``_run_ddp_forward_collectives``); that forward then skips them, as it does after
an evaluation forward through the DDP module. The one case left is DDP's own: a rank-0-only forward
through a DDP that broadcasts buffers in the same window as the bucket rebuild mismatches DDP's
collectives with plain torch.optim too.

Keys stay bounded: each rank deletes what it posted for message ``m`` once it has read the other side's
post for ``m + 1``, which proves its own was read.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

JOIN_DEADLINE_S = 60.0
"""How long rank 0 waits in ``state_dict()`` for the other ranks to join, whatever the process
group's timeout. They are normally waiting at their hook already; tests lower it."""

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
        seq: the number of the next message (the same on every rank).
        posted: this rank has posted for message ``seq`` from its training forward.
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
        self.posted = False
        self.failed: str | None = None
        self._mine: dict[int, list[str]] = {}  # message number -> the keys this rank posted for it

    # ------------------------------------------------------------------ where the ranks meet

    def at_forward(self, module) -> None:
        """Forward pre-hook of the DDP's module: post for this iteration early, so that the other side
        finds it at its hook without waiting."""
        if (self.enabled and not self.posted and self.failed is None and module.training
                and torch.is_grad_enabled() and self.engine.ddp.require_backward_grad_sync):
            self._post("go" if self.rank == 0 else "train")
            self.posted = True

    def at_iteration_start(self, serve: Callable[[int], object]) -> None:
        """The comm hook's first bucket of a synced iteration, before any collective of it: rank 0 makes
        sure every rank trains; the others wait for rank 0's go, serving any ``state_dict()`` that it
        runs alone meanwhile (``serve(to)`` runs the gathers)."""
        if not self.enabled:
            return
        self._check_alive()
        if not self.posted:
            self._post("go" if self.rank == 0 else "train")
        self.posted = False
        if self.rank == 0:
            answers = self._answers(deadline=None)
            self.seq += 1
            if any(a != "train" for a in answers):
                self._fail("another rank is in optimizer.state_dict() while rank 0 trains on: " + USAGE)
            return
        while True:
            message = self._message(deadline=None)
            self.seq += 1
            if message == "go":
                return
            serve(self._verdict(self.seq - 1))
            self._post("train")

    def state_dict(self, to: int | None, gather: Callable[[int | None], dict | None]) -> dict | None:
        """Run ``gather(to)`` once every rank joined: in its own ``state_dict(to)``, or (rank 0 alone)
        from its hook."""
        if self.world == 1:
            return gather(to)
        self._check_alive()
        if self.posted:
            self._fail("optimizer.state_dict() was called between a training forward and its backward; "
                       "call it before the forward or after optimizer.step() (evaluate under torch.no_grad())")
        if self.enabled:
            _run_ddp_forward_collectives(self.engine.ddp)
        if self.rank == 0:
            self._post(f"ckpt:{to}")
            answers = self._answers(deadline=JOIN_DEADLINE_S)
            plan, error = self._decide(to, answers)
            self._post(f"abort:{error}" if error else f"serve:{plan}", what="verdict")
            self.seq += 1
            if error:
                self._fail(error)
            return gather(plan)
        self._post(f"sd:{to}")
        message = self._message(deadline=None if self.enabled else JOIN_DEADLINE_S)
        self.seq += 1
        if message == "go":
            self._fail(f"optimizer.state_dict() was called on rank {self.rank} while rank 0 trains on: " + USAGE)
        rank0_to = _parse_to(message)
        if rank0_to != to:
            self._fail(f"optimizer.state_dict(to={to}) on rank {self.rank}, to={rank0_to} on rank 0: "
                       "pass the same `to` on every rank")
        return gather(self._verdict(self.seq - 1))

    # ------------------------------------------------------------------ rank 0

    def _answers(self, deadline: float | None) -> list[str]:
        """Every other rank's answer to message ``seq``. ``deadline``: seconds to wait for them (None:
        the store's timeout, as a collective's wait)."""
        keys = [self._key(f"ans{r}") for r in range(1, self.world)]
        try:
            if deadline is not None:
                self.store.wait(keys, datetime.timedelta(seconds=deadline))
            values = [v.decode() for v in self.store.multi_get(keys)]
        except dist.DistStoreError:
            if deadline is None:
                self._fail("rank 0 waited for the other ranks to reach their next backward or state_dict() "
                           f"longer than the process group's store timeout ({self.store.timeout})")
            self._post("abort:rank 0 gave up waiting", what="verdict")
            self._fail(f"rank 0 is in optimizer.state_dict() and the other ranks did not join within "
                       f"{deadline:.0f} s: after a call on rank 0 alone the other ranks must go on training "
                       "(they join from their next backward); otherwise call it on every rank")
        self._read(self.seq)
        return values

    def _decide(self, to: int | None, answers: list[str]) -> tuple[int | None, str | None]:
        """The gathers' ``to`` for everyone, or why they must not run."""
        in_state_dict = [a for a in answers if a != "train"]
        if any(_parse_to(a) != to for a in in_state_dict):
            return None, "the ranks called optimizer.state_dict() with different `to`: pass the same `to` on every rank"
        if len(in_state_dict) == len(answers):
            return to, None
        if in_state_dict:
            return None, (f"rank 0 and {len(in_state_dict)} of the {len(answers)} other ranks are in "
                          f"optimizer.state_dict(), the rest train on: {USAGE}")
        if to not in (None, 0):
            return None, (f"optimizer.state_dict(to={to}) was called on rank 0 only: rank {to} cannot receive "
                          "the dict from its backward; call it with to=0 (or none) on rank 0 alone, or on every rank")
        return 0, None

    # ------------------------------------------------------------------ the other ranks

    def _message(self, deadline: float | None) -> str:
        key = self._key("msg")
        try:
            if deadline is not None:
                self.store.wait([key], datetime.timedelta(seconds=deadline))
            message = self.store.get(key).decode()
        except dist.DistStoreError:
            where = "in optimizer.state_dict()" if deadline is not None else "at its next backward"
            self._fail(f"rank {self.rank} waited {where} for rank 0, which neither reached its next backward "
                       f"nor called optimizer.state_dict() in time: {USAGE}")
        self._read(self.seq)
        return message

    def _verdict(self, seq: int) -> int | None:
        """Rank 0's verdict on ``ckpt`` message ``seq`` (posted within JOIN_DEADLINE_S of the message)."""
        key = f"{seq}/verdict"
        try:
            self.store.wait([key], datetime.timedelta(seconds=2 * JOIN_DEADLINE_S))
            verdict = self.store.get(key).decode()
        except dist.DistStoreError:
            self._fail(f"rank {self.rank} joined optimizer.state_dict() but rank 0 gave no verdict")
        kind, _, why = verdict.partition(":")
        if kind != "serve":
            self._fail(f"rank 0 abandoned optimizer.state_dict() ({why}): {USAGE}")
        return _parse_to(verdict)

    # ------------------------------------------------------------------ both

    def _key(self, what: str) -> str:
        return f"{self.seq}/{what}"

    def _post(self, value: str, what: str | None = None) -> None:
        """Post this rank's side of message ``seq`` (rank 0: the message or its verdict)."""
        key = self._key(what or ("msg" if self.rank == 0 else f"ans{self.rank}"))
        self.store.set(key, value)
        self._mine.setdefault(self.seq, []).append(key)

    def _read(self, seq: int) -> None:
        """The other side's post for ``seq`` was read: it was posted after ours for ``seq - 1`` were read
        (a message follows the answers to the previous one, and an answer the previous message), so
        those can go."""
        for key in self._mine.pop(seq - 1, []):
            self.store.delete_key(key)

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise CheckpointSyncError(f"an earlier optimizer.state_dict() handshake failed ({self.failed}); "
                                      "this optimizer cannot go on: restart from the last checkpoint")

    def _fail(self, why: str):
        self.failed = why
        raise CheckpointSyncError(why)


def _parse_to(text: str) -> int | None:
    value = text.partition(":")[2]
    return None if value == "None" else int(value)


__all__ = ["JOIN_DEADLINE_S", "CheckpointHandshake", "CheckpointSyncError", "USAGE"]
