"""Each parameter's step count, on the host, where the coefficient tables are built (bias correction,
SGD's first step), and how an update's counts reach it without the step path waiting for the device.

Whether an update counted depends on device flags: whether some rank found its gradients non-finite
(then the update wrote nothing and counts no step) and, where DDP may skip parameters, which got a
gradient on some rank. The update starts copying those flags to the host and leaves a ``Pending``
record; the records are settled where the next counts are needed, the iteration's first coefficient
table or a reader of the counts (checkpoints), long after the copies finished.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HOST_RUN_AHEAD = 1
"""How many steps a rank's host can complete beyond the last one every rank has started the next
iteration after. On CUDA the reductions and every wait for them are stream operations, so nothing on
the step path blocks the host but ``settle``: iteration N+2's first coefficient table waits for
iteration N+1's skip flags, which follow N+1's updates, which follow its reductions, which need every
rank of the shard group in iteration N+1. So a rank whose peer stopped after step N (in a rank-0-only
``state_dict()``) publishes step N+1 at most (checkpoint/versions.py keeps what serving N needs)."""


@dataclass
class Pending:
    """The counts one bucket's update adds, once its flags are on the host."""

    pids: np.ndarray
    active: np.ndarray | None  # known on the host, else counted from ``used``
    used: tuple | None  # (host copy of the all-reduced used counts, event to synchronize first)
    found: tuple  # (host copy of the update's skip flag, event to synchronize first)


class StepCounts:
    def __init__(self, n_params: int):
        self._counts = np.zeros(n_params, dtype=np.float64)
        self._pending: list[Pending] = []

    def add(self, pending: Pending) -> None:
        self._pending.append(pending)

    @property
    def settled(self) -> np.ndarray:
        """The counts with every update so far counted (numpy, writable in place)."""
        self.settle()
        return self._counts

    def replace(self, value) -> None:
        self.settle()
        self._counts = np.asarray(value, dtype=np.float64)

    def settle(self) -> None:
        """Count every pending update. One host wait at most: the copies were queued on one stream in
        order, so once the last one's event has passed, every earlier one has (and in the steady state
        it passed long ago: the updates it follows ran before the next forward did)."""
        if not self._pending:
            return
        event = self._pending[-1].found[1]  # the skip flag's copy: queued after its used counts' copy
        if event is not None:
            event.synchronize()
        skipped: dict[int, bool] = {}  # one flag per update call, shared by its buckets: read it once
        pids, counts = [], []
        for pending in self._pending:
            found = pending.found[0]
            skip = skipped.get(id(found))
            if skip is None:
                skip = skipped[id(found)] = bool(found.reshape(-1)[0] != 0)
            if skip:
                continue
            pids.append(pending.pids)
            counts.append(pending.active if pending.used is None else pending.used[0].numpy() > 0)
        if pids:  # a parameter is in one bucket only: no index repeats
            self._counts[np.concatenate(pids)] += np.concatenate(counts)
        self._pending = []

