"""Each parameter's step count, kept on the update's device and counted there, so that no host wait is
on the step path (docs/design-streams.md, "Streams", "Step counts on the device").

Whether an update counted depends on device flags: whether some rank found its gradients non-finite
(then the update wrote nothing and counts no step) and, where DDP may skip parameters, which got a
gradient on some rank (column 0 of the coefficient table, set from all-reduced flags on the device).
So the side stream adds each update's counts right after it, from those flags, and the next
coefficient table reads them there (``after``); the host never learns them on the step path. It reads
them only where it is asked to (``host``: a checkpoint, a reader of ``engine.steps``), and writes them
on a load.

What the host still knows is a bound: no count exceeds ``bound`` (each iteration adds one at most, a
load sets them), which sizes the bias-correction tables (algorithms/step_columns.py) without a read.
"""

from __future__ import annotations

import numpy as np
import torch


class StepCounts:
    """Attributes:
        counts: int64 ``[n_params]`` on the device, written on the side stream only.
        bound: the host's upper bound of every count (exact after a load or a read).
    """

    def __init__(self, n_params: int, side):
        self.side = side
        self.counts = torch.zeros(n_params, dtype=torch.int64, device=side.device)
        self.bound = 0
        self._host: np.ndarray | None = None  # the last read, until the counts change

    def begin_iteration(self) -> int:
        """The bound of this iteration's counts, once its updates have counted (the tables need it)."""
        self.bound += 1
        self._host = None  # this iteration's updates may count
        return self.bound

    def after(self, scratch) -> torch.Tensor:
        """Every count as it is once this step counts, as torch.optim's ``state["step"]`` reads during the
        update (queued on the side stream; rows of parameters this step skips are never read)."""
        return torch.add(self.counts, 1, out=scratch.take("after", self.counts.shape, torch.int64))

    def count(self, pids: torch.Tensor, table: torch.Tensor, found: torch.Tensor, scratch) -> None:
        """Add one to the parameters ``pids`` (device indices) whose row of ``table`` is active, unless
        ``found`` (the update's skip flag) is set: on the side stream, after the update read the table."""
        n = pids.shape[0]
        add = torch.index_select(table[:, 0], 0, pids, out=scratch.take("active", (n,), table.dtype))
        add.mul_(torch.eq(found, 0, out=scratch.take("counts", found.shape, torch.bool)))  # column 0: 1.0 where active
        self.counts.index_add_(0, pids, scratch.take("add", (n,), torch.int64).copy_(add))
        self._host = None

    def host(self) -> np.ndarray:
        """The counts on the host, read-only (a host wait on CUDA, once until they change: only a
        checkpoint or a reader of ``engine.steps`` asks)."""
        if self._host is None:
            self.side.join()
            self._host = self.counts.cpu().numpy().astype(np.float64)
            self._host.flags.writeable = False
            self.bound = int(self._host.max()) if self._host.size else 0
        return self._host

    def write(self, values) -> None:
        """Set every count (a load), ordered after every update that counted before."""
        values = np.asarray(values, dtype=np.float64)
        with self.side.run(follow_current=True):
            self.counts.copy_(self.side.upload(torch.from_numpy(values.astype(np.int64))))
        self.bound = int(values.max()) if values.size else 0
        self._host = None
