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

Every stream, event and pinned-memory call goes through one small object (``CudaStreams``), so that the
stream-order checker (fused_zero/testing/streamcheck) can stand in for it on the CPU and run this very code
with its ordering recorded. Host-to-device copies are all asynchronous, from pinned memory, on the side
stream (``upload``): a pageable copy would block the host on the step path.
"""

from __future__ import annotations

import contextlib

import torch


class CudaStreams:
    """The CUDA calls the side stream makes, for one device."""

    asynchronous = True  # queued work runs later: waits are stream waits, not host waits

    def __init__(self, device: torch.device):
        self.device = device

    def side_stream(self):
        highest = torch.cuda.Stream.priority_range()[1]  # (lowest, highest): lower is higher
        return torch.cuda.Stream(self.device, priority=highest)

    def copy_stream(self):
        """A stream of default priority for copies off the step path (the checkpoint server's)."""
        return torch.cuda.Stream(self.device)

    def current(self):
        return torch.cuda.current_stream(self.device)

    def use(self, stream):
        return torch.cuda.stream(stream)

    def guard(self):
        return torch.cuda.device(self.device)

    def event(self):
        return torch.cuda.Event()

    def pinned_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of pinned ``host``, queued on the current stream."""
        return host.to(self.device, non_blocking=True)

    def to_host(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """Queue a copy of device ``t`` into pinned ``out`` on the current stream."""
        out.copy_(t, non_blocking=True)

    def to_host_blocking(self, t: torch.Tensor) -> torch.Tensor:
        """A pageable host copy of device ``t``, made on the current stream; the calling thread waits for
        it (the checkpoint server's thread, never the training thread)."""
        return t.to("cpu")

    def graph(self) -> CudaGraph:
        return CudaGraph()

    def capturing(self) -> bool:
        """Whether the current stream is being captured into a CUDA graph (the caller's own)."""
        return torch.cuda.is_current_stream_capturing()


class CudaGraph:
    """One CUDA graph: ``capture(stream)`` records what is queued on ``stream`` (and on the streams that
    fork from it and join it again: NCCL's) without running it; ``replay()`` runs it on the current
    stream. Captured in ``thread_local`` mode, so that the checkpoint server's thread may go on making
    its own CUDA calls meanwhile (``global`` mode would fail them)."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, stream):
        return torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local")

    def replay(self) -> None:
        self.graph.replay()


def device_streams(device: torch.device) -> CudaStreams | None:
    """The stream calls for ``device``: CUDA's, or None where work runs inline (the CPU)."""
    return CudaStreams(device) if device.type == "cuda" else None


class SideStream:
    """Attributes:
        device: the parameters' device.
        api: the stream calls (``CudaStreams``), or None on the CPU.
        stream: the side stream, or None on the CPU.
        relay: a second stream that issues the reductions queued after the backward's own (the
            all-reduce across replicas, the used flags' all-reduce): on the side stream they would
            wait for the updates already queued there (docs/design-pipeline.md "Issue order per communicator").
        asynchronous: whether queued work runs later (CUDA), so that waits order streams instead of
            blocking the host; the engine's CPU shortcuts apply only where it is False.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.api = device_streams(device)
        self.asynchronous = self.api is not None and self.api.asynchronous
        self.stream = self.api.side_stream() if self.api is not None else None
        self.relay = self.api.side_stream() if self.api is not None else None
        self._staging = _PinnedRing(self.api) if self.api is not None else None

    @contextlib.contextmanager
    def run(self, follow_current: bool, relay: bool = False):
        """Context in which the updates are queued: on the side stream (``relay``: the relay stream),
        under the device's guard. ``follow_current`` orders that stream after all work queued so far,
        needed when no collective orders it after the gradients (one rank)."""
        if self.stream is None:
            yield
            return
        stream = self.relay if relay else self.stream
        with self.api.guard():
            if follow_current:
                stream.wait_stream(self.api.current())
            with self.api.use(stream):
                yield

    def follow(self) -> None:
        """Order the side stream after everything queued so far on the current stream."""
        if self.stream is not None:
            with self.api.guard():
                self.stream.wait_stream(self.api.current())

    def join(self) -> None:
        """Order the current stream after everything queued on the side stream (the all-gathers run on
        the communication stream: the forward pre-hooks and ``synchronize()`` wait for those)."""
        if self.stream is not None:
            self.api.current().wait_stream(self.stream)
            self.relay.wait_stream(self.stream)  # what the relay allocated may go once the side read it

    def upload(self, table: torch.Tensor, relay: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """A host table on the update's device, copied on the side stream (which reads it first).

        The copy goes through a persistent pinned buffer (``_PinnedRing``), not a new pinned
        allocation per call; the device copy is new each time, since an earlier table may still be
        read by kernels queued after this copy, unless ``out`` is given (a tensor of the side stream's
        own, pipeline/comm/scratch.py: what a CUDA graph reads every replay)."""
        if self.stream is None:
            return table if out is None else out.copy_(table)
        with self.run(follow_current=False, relay=relay):
            host, copied = self._staging.take(table)
            out = self.api.to_device(host) if out is None else out.copy_(host, non_blocking=True)
            copied.record(self.relay if relay else self.stream)
        return out

    def upload_kept(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A host table that stays on the device as long as its layout (a shard's parameter indices):
        copied on the side stream from a pinned buffer of its own, returned with it (keep both), so
        that no ring buffer is waited for: the ring's ``event.query()`` observes the side stream's
        progress up to the update kernels already queued there."""
        if self.stream is None:
            return table, None
        with self.run(follow_current=False):
            host = self.api.pinned_empty(table.shape, table.dtype)
            host.copy_(table)
            return self.api.to_device(host), host


class _PinnedRing:
    """Pinned host buffers reused across uploads, a few per table shape.

    An asynchronous copy reads its pinned source when the stream gets to it, which may be long after
    the call (the side stream waits for reductions first), so a buffer is refilled only once the event
    recorded after its last copy has completed. When every buffer of the shape is still in use a new
    one is added: the host never waits here. (A bound with a host wait on the oldest buffer stalled the
    backward as soon as more same-shaped tables were in flight than the bound, e.g. the used flags of a
    transformer's identical layers with ``find_unused_parameters``.) Idle buffers beyond ``keep`` per
    shape are dropped, so the ring shrinks back once the burst is over, and so are the rings of shapes
    no longer uploaded (``_drop_stale``).
    """

    def __init__(self, api, keep: int = 16, stale: int = 256):
        self.api = api
        self.keep = keep
        self.stale = stale
        self.rings: dict[tuple, list[tuple]] = {}  # (shape, dtype) -> [(buffer, event), ...], oldest first
        self._used: dict[tuple, int] = {}  # (shape, dtype) -> the take that used it last
        self._takes = 0

    def take(self, table: torch.Tensor) -> tuple[torch.Tensor, object]:
        """A pinned buffer holding ``table``'s values and the event to record after copying it."""
        key = (tuple(table.shape), table.dtype)
        self._takes += 1
        self._used[key] = self._takes
        if self._takes % 64 == 0:
            self._drop_stale()
        ring = self.rings.setdefault(key, [])
        idle = [i for i, (_, event) in enumerate(ring) if event.query()]
        if idle:
            slot = ring.pop(idle[0])
            for i in reversed(idle[1:][self.keep - 1:]):
                ring.pop(i - 1)  # one index down: the slot taken above came first
        else:
            slot = (self.api.pinned_empty(table.shape, table.dtype), self.api.event())
        ring.append(slot)  # the most recently used last: the next search finds older ones first
        slot[0].copy_(table)
        return slot

    def _drop_stale(self) -> None:
        """Drop the rings of shapes no upload used in the last ``stale`` takes once their copies are done
        (a table that grew leaves its old shape behind), so the pinned bytes are those of the shapes
        in use, whatever the number of steps."""
        for key, last in list(self._used.items()):
            if self._takes - last > self.stale and all(event.query() for _, event in self.rings[key]):
                del self.rings[key], self._used[key]
