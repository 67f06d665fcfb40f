"""What ``step()`` refuses, raised on every rank, whichever rank saw it.

A ``step()`` refuses what its update could not honor (step_policy.py): an edit of ``.grad``, a
hyperparameter set after the update read it. Each rank sees its own loop, so a change made on some
ranks only (a scheduler stepped under ``if rank == 0``) is seen there only; a rank that raised alone
would leave the others waiting in their next collective for it. So every rank's flags are all-reduced
at every ``step()`` of a mode that may refuse:

- on the CPU (gloo's host-blocking collectives), at once: every rank raises in the same ``step()``;
- on CUDA, where reading a device value back waits for the device, the flags ride an all-reduce queued
  on the relay stream (not behind the updates) and copied into pinned memory. A rank that saw the change
  raises at once, after queueing its flags; every other rank raises at its next forward, synced
  backward or ``step()``, whichever first finds the copy done (``event.query()``, no wait); a ``step()``
  that finds a copy of an earlier step not done yet waits for it, which bounds the host's run-ahead to
  one step there, so the other ranks raise, at the latest, at the step after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..comm import collectives

if TYPE_CHECKING:
    from ...options import ShardingOptions

FLAGS = ("edited", "changed", "written")
"""What a ``step()`` may refuse: an edit of ``.grad`` it cannot honor, param groups changed after the update
read them, parameters written after the update read them (reducing/weight_watch.py)."""


@dataclass
class _Entry:
    """One ``step()``'s flags on their way to every rank (CUDA)."""

    member: str
    event: object
    host: torch.Tensor  # pinned: every rank's flags and bits, summed, once ``event`` has passed
    mine: tuple[bool, ...]
    step: int
    world: int


class RefusedOnAnotherRank(RuntimeError):
    """A ``step()`` refused on another rank: raised on this one too, so that no rank waits for it."""


class Refusals:
    """Attributes:
        pending: the entries whose flags this rank has not read yet (CUDA), oldest first.
        steps: the ``step()`` calls that queued flags so far.
    """

    def __init__(self, options: ShardingOptions, topology, side):
        """``options``: the modes the messages name; ``topology``: DDP's group the flags are all-reduced
        over (buckets/topology.py); ``side``: the side stream, whose relay stream carries them on CUDA."""
        self.options, self.group, self.world, self.side = options, topology.group, topology.world, side
        self.pending: list[_Entry] = []
        self.steps = 0
        self._spare: list[torch.Tensor] = []  # pinned buffers of the entries read

    def agree(self, member, *flags: bool, same: tuple[bool, ...] = ()) -> tuple[list[bool], bool]:
        """Whether each of ``member``'s ``step()`` flags (``FLAGS``) holds on some rank, and whether every
        rank has the same ``same`` bits (the parameters each wrote: reducing/weight_watch.py): on the CPU,
        every rank's now; on CUDA this rank's now (and True), the others' later (``check``)."""
        if self.world == 1:
            return list(flags), True
        values = torch.tensor([int(f) for f in (*flags, *same)], dtype=torch.int32)
        side = self.side
        if not side.asynchronous:
            collectives.all_reduce(values, self.group).wait()
            sums = values.tolist()
            return [v > 0 for v in sums[:len(flags)]], _agreed(sums[len(flags):], self.world)
        self.steps += 1
        with side.run(follow_current=False, relay=True):
            flags_on_device = side.upload(values, relay=True)
            collectives.all_reduce(flags_on_device, self.group).wait()  # the relay stream waits, not the host
            host = self._spare.pop() if self._spare else side.api.pinned_empty(values.shape, values.dtype)
            side.api.to_host(flags_on_device, host)
            event = side.api.event()
            event.record(side.relay)
        self.pending.append(_Entry(member.name, event, host, tuple(flags), self.steps, self.world))
        return list(flags), True

    def check(self, wait: bool = True) -> None:
        """Raise for a refusal another rank made known: read every entry whose copy is done (no wait);
        with ``wait`` (at ``step()``), wait for the entries of earlier steps than the last one."""
        while self.pending:
            entry = self.pending[0]
            if not entry.event.query():
                if not (wait and entry.step < self.steps):
                    return
                entry.event.synchronize()
            self.pending.pop(0)
            sums = entry.host.tolist()
            self._spare.append(entry.host)
            seen = [v > 0 for v in sums[:len(entry.mine)]]
            if not _agreed(sums[len(entry.mine):], entry.world):
                self.pending.clear()
                raise RuntimeError(partial_write_message(entry.member))
            others = [name for name, s, m in zip(FLAGS, seen, entry.mine) if s and not m]
            if others and not any(entry.mine):
                self.pending.clear()
                raise RefusedOnAnotherRank(_message(entry.member, others, self.options))


def _agreed(sums: list[int], world: int) -> bool:
    """Every rank had the same bits: each bit's sum over the ranks is 0 or ``world``."""
    return all(s in (0, world) for s in sums)


def partial_write_message(member: str) -> str:
    return (f"{member}: the parameters were written (model.load_state_dict, p.copy_, nn.init, p.data = ...) on "
            "some ranks and not on others, or different ones on different ranks, before the last update. Each "
            "rank updates its own slice of every parameter, from its own weights, so the replicas would hold a "
            "mix of both: refused on every rank. Write the weights on every rank alike (load the same state dict "
            "everywhere, or write on rank 0 and torch.distributed.broadcast the parameters before the next "
            "forward)")


def _message(member: str, flags: list[str], options: ShardingOptions) -> str:
    what = {"edited": "param.grad was changed between backward and optimizer.step()",
            "changed": "param_groups changed between backward and optimizer.step()",
            "written": "the parameters were written between backward and optimizer.step()"}
    return (f"{member}: on another rank, {' and '.join(what[f] for f in flags)} in its last step(), which "
            f"overlap={options.overlap!r} with grad_reduce={options.grad_reduce!r} cannot honor, and that rank "
            "raised: this rank raises too, rather than wait for it in the next collective. The change was made "
            "on some ranks only: make it on every rank (a scheduler or a clip under `if rank == 0` makes the "
            "replicas differ under DDP + torch.optim too), and see that rank's error for the option that "
            "honors it")
