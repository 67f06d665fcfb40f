"""Where the updates run: a side CUDA stream, or inline on the CPU.

On CUDA the updates are queued on one side stream per optimizer, so the backward's own stream never
waits for communication; the side stream waits for each reduction's Work (a stream wait, never a host
wait), and the all-gathers are issued from it (NCCL and gloo then run them on their own streams, after
what the side stream had queued). On the CPU every wait blocks the host and the updates run inline.

Everything queued here runs under the parameters' device guard, whatever the caller's current device
is: a script that never calls ``torch.cuda.set_device`` (``model.to(rank)``) has current device 0 on
every rank, and a kernel launched there with pointers on another GPU faults or computes garbage.
The stream has the highest priority the device offers: the update sits on the path between bucket k's
reduction and its all-gather, and should not queue behind backward kernels.
"""

from __future__ import annotations

import contextlib

import torch


class SideStream:
    """Attributes:
        device: the parameters' device.
        stream: the side stream, or None on the CPU.
        updated: an event recorded after the last update queued (None until one is, and on the CPU).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = None
        self.updated = None
        if device.type == "cuda":
            highest = torch.cuda.Stream.priority_range()[1]  # (lowest, highest): lower is higher
            self.stream = torch.cuda.Stream(device, priority=highest)
        self._staging = _PinnedRing()

    @contextlib.contextmanager
    def run(self, follow_current: bool):
        """Context in which the updates are queued: on the side stream, under the device's guard.
        ``follow_current`` orders the side stream after all work queued so far, needed when no
        collective orders it after the gradients (one rank)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.device(self.device):
            if follow_current:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                yield

    def mark_updated(self) -> None:
        """Record, on the side stream, that every update queued so far is done once reached (called
        after each bucket's update and before its all-gather is issued)."""
        if self.stream is not None:
            self.updated = self.stream.record_event()

    def join_updates(self) -> None:
        """Order the current stream after the updates queued so far, not after the all-gathers issued
        since: the forward pre-hooks wait for those, bucket by bucket."""
        if self.updated is not None:
            torch.cuda.current_stream(self.device).wait_event(self.updated)

    def join(self) -> None:
        """Order the current stream after everything queued on the side stream."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def upload(self, table: torch.Tensor) -> torch.Tensor:
        """A host table on the update's device, copied on the side stream (which reads it first).

        The copy goes through a persistent pinned buffer (``_PinnedRing``), not a new pinned
        allocation per call; the device copy is new each time, since an earlier table may still be
        read by kernels queued after this copy."""
        if self.stream is None:
            return table
        host, copied = self._staging.take(table)
        with self.run(follow_current=False):
            out = host.to(self.device, non_blocking=True)
            copied.record(self.stream)
        return out

    def download(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying ``t`` to host memory on the side stream; return the host tensor and the event
        to synchronize before reading it (None on the CPU: ``t`` itself)."""
        if self.stream is None:
            return t, None
        with self.run(follow_current=False):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            return host, self.stream.record_event()


class _PinnedRing:
    """Pinned host buffers reused across uploads, a few per table shape.

    An asynchronous copy reads its pinned source when the stream gets to it, which may be long after
    the call (the side stream waits for reductions first), so a buffer is refilled only once the
    event recorded after its last copy has completed; when every buffer of the shape is still in
    use a new one is added (at most ``limit``, after which the oldest is waited for on the host).
    """

    def __init__(self, limit: int = 16):
        self.limit = limit
        self.rings: dict[tuple, list[tuple]] = {}  # (shape, dtype) -> [(buffer, event), ...], oldest first

    def take(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A pinned buffer holding ``table``'s values and the event to record after copying it."""
        ring = self.rings.setdefault((tuple(table.shape), table.dtype), [])
        free = next((i for i, (_, event) in enumerate(ring) if event.query()), None)
        if free is not None:
            slot = ring.pop(free)
        elif len(ring) < self.limit:
            slot = (torch.empty_like(table, pin_memory=True), torch.cuda.Event())
        else:
            slot = ring.pop(0)
            slot[1].synchronize()
        ring.append(slot)  # the most recently used last: the next search finds older ones first
        slot[0].copy_(table)
        return slot
