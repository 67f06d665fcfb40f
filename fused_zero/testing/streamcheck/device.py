"""Stand-ins for the CUDA calls the pipeline makes, recording their ordering instead of making it.

``ModeledStreams`` has the interface of ``pipeline.comm.streams.CudaStreams``: the side stream's code runs
unchanged on top of it, with CPU tensors. ``ModeledWork`` wraps a real gloo Work with NCCL's stream
semantics: the collective is queued on its process group's communication stream after the stream that
issued it, and ``wait()`` orders the *calling* stream after it (a stream wait, not a host wait), as
ProcessGroupNCCL's Work does. Events carry a vector clock; ``synchronize()`` is a host wait, which
orders every stream's later work after the event; ``query()`` answers True, as if the device were
always done (but for an event behind a collective another rank has not joined), and counts as the host
observing the event (the same edge).
"""

from __future__ import annotations

import contextlib

import torch

from .clocks import Access, Hazard
from .graphs import ModeledGraph
from .trace import DispatchCalls


class ModeledStream:
    def __init__(self, checker, sid: int):
        self.checker, self.sid = checker, sid

    def wait_stream(self, other: ModeledStream) -> None:
        capture = self.checker.capturing()
        if capture is not None:
            capture.wait(self.sid, capture.snapshot(other.sid), f"the {self.checker.clocks.names[other.sid]}'s work")
            return
        clocks = self.checker.clocks
        clocks.merge(self.sid, clocks.snapshot(other.sid))

    def wait_event(self, event: ModeledEvent) -> None:
        capture = self.checker.capturing()
        if capture is not None:
            capture.wait(self.sid, capture.clock_of(event.captured), "an event")
            return
        if event.pending:
            _deadlock(self.checker, f"{self!r} waits for {event.pending}")
        if event.vc is not None:
            self.checker.clocks.merge(self.sid, event.vc)

    def record_event(self) -> ModeledEvent:
        event = ModeledEvent(self.checker)
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<stream {self.checker.clocks.names[self.sid]}>"


class ModeledEvent:
    def __init__(self, checker, pending: str = ""):
        self.checker = checker
        self.vc: dict[int, int] | None = {} if pending else None
        self.pending = pending  # why it cannot complete yet (StreamChecker.pending_event), or ""
        self.captured = None  # (capture, its clock) where recorded inside a graph's capture (graphs.py)

    def record(self, stream: ModeledStream | None = None) -> None:
        sid = stream.sid if stream is not None else self.checker.current
        capture = self.checker.capturing()
        if capture is not None:
            self.captured = capture.point(sid)
            return
        self.vc = self.checker.clocks.snapshot(sid)

    def query(self) -> bool:
        """True, as if the device were always done, except where it cannot be: behind a collective that
        another rank has not joined (``pending``)."""
        if self.pending:
            return False
        if self.vc is not None:
            self.checker.clocks.host_sync(self.vc)
        return True

    def synchronize(self) -> None:
        if self.pending:
            _deadlock(self.checker, f"the host waits for {self.pending}")
        self.checker.log_sync("event.synchronize()")
        if self.vc is not None:
            self.checker.clocks.host_sync(self.vc)


def finished_serving(checker, sid: int) -> None:
    """The server's thread saw its copies on ``sid`` done (a blocking copy): see ``checker.served``."""
    with checker.lock:
        checker.clocks.merge_into(checker.served, checker.clocks.snapshot(sid))


def _deadlock(checker, why: str) -> None:
    where = checker.where()
    with checker.lock:
        checker.clocks.hazards.append(Hazard("deadlock", why, Access(-1, 0, 0, 0, False, "wait", where), None,
                                             ("", ""), where))


class ModeledStreams:
    """``pipeline.comm.streams.CudaStreams`` for a CPU device, under a ``StreamChecker``."""

    asynchronous = True

    def __init__(self, checker, device: torch.device):
        self.checker, self.device = checker, device

    def side_stream(self) -> ModeledStream:
        return ModeledStream(self.checker, self.checker.clocks.stream("side stream"))

    def copy_stream(self) -> ModeledStream:
        """The checkpoint server's stream: queued on by its thread only (``private``)."""
        return ModeledStream(self.checker, self.checker.clocks.stream("checkpoint server stream", private=True))

    def current(self) -> ModeledStream:
        return ModeledStream(self.checker, self.checker.current)

    @contextlib.contextmanager
    def use(self, stream: ModeledStream):
        """In another thread than the training one (the checkpoint server's), its tensor operations are
        seen here too: a dispatch mode of that thread for the duration."""
        checker = self.checker
        before, checker.current = checker.current, stream.sid
        mode = contextlib.nullcontext() if checker.in_training_thread() else DispatchCalls(checker)
        try:
            with mode:
                yield
        finally:
            checker.current = before

    def guard(self):
        return contextlib.nullcontext()

    def event(self) -> ModeledEvent:
        return ModeledEvent(self.checker)

    def graph(self) -> ModeledGraph:
        return ModeledGraph(self.checker)

    def capturing(self) -> bool:
        return self.checker.capturing() is not None

    def pinned_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        with self.checker.paused():
            t = torch.empty(shape, dtype=dtype)
        self.checker.memory.register(t, host=True, name=f"pinned {dtype} {tuple(t.shape)}", pinned=True, fresh=True)
        return t

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """An asynchronous copy on the current stream: it reads the pinned source when it runs."""
        checker = self.checker
        with checker.paused():
            out = torch.empty_like(host)
            out.copy_(host)
        capture = checker.capturing()
        if capture is not None:  # the graph's copy reads the pinned buffer as it is at each replay
            capture.operations.append(lambda: out.copy_(host))
        checker.memory.register(out, host=False, name=f"upload {tuple(out.shape)}", fresh=True)
        checker.record("copy host->device (non_blocking)", reads=[host], writes=[out])
        return out

    def to_host_blocking(self, t: torch.Tensor) -> torch.Tensor:
        """A copy on the current stream that the calling thread waits for (the server's reads)."""
        checker = self.checker
        with checker.paused():
            out = t.clone()
        checker.memory.register(out, host=True, name=f"host copy {tuple(out.shape)}", fresh=True)
        # a transfer: CUDA makes a blocking copy into any host memory, pageable too (unlike to_host's)
        checker.record("copy device->host (blocking)", reads=[t], writes=[out], sid=checker.current,
                       transfer=True)
        if checker.in_training_thread():
            checker.host_read(t, "blocking copy to the host", record=False)
        else:
            finished_serving(checker, checker.current)
        return out

    def to_host(self, t: torch.Tensor, out: torch.Tensor) -> None:
        checker = self.checker
        with checker.paused():
            out.copy_(t)
        capture = checker.capturing()
        if capture is not None:
            capture.operations.append(lambda: out.copy_(t))
        checker.record("copy device->host (non_blocking)", reads=[t], writes=[out], sid=checker.current)


class ModeledWork:
    """A real gloo Work, with NCCL's ordering: see the module docstring."""

    def __init__(self, checker, work, vc: dict[int, int], outputs: list[torch.Tensor], captured: tuple | None = None):
        self.checker, self.work, self.vc, self.outputs = checker, work, vc, outputs
        self.captured = captured  # its stream's point in the capture it was issued in (graphs.py), or None

    def wait(self, timeout=None) -> bool:
        checker = self.checker
        if self.work is not None:
            with checker.paused():  # gloo's own copies when it finishes (its output) are not ours
                self.work.wait()
        capture = checker.capturing()
        if capture is not None:
            capture.wait(checker.current, capture.clock_of(self.captured), "a collective")
            return True
        with checker.lock:  # every rank joined it: the requesters this rank served had been served
            checker.clocks.merge(checker.current, self.vc)
            checker.clocks.merge(checker.current, checker.served)
        return True

    def get_future(self) -> _ModeledFuture:
        """The Work's future, waited for by DDP at the end of the backward (``finalize_backward``): the
        stream that finishes the backward is ordered after the collective then. gloo's reduce-scatter
        has no future; NCCL's has, so one is made here from the finished Work. Its ``then`` callbacks
        run as a CUDA future runs them: on a stream ordered after the collective (see _ModeledFuture)."""
        checker = self.checker
        with checker.paused():
            try:
                fut = self.work.get_future()
            except RuntimeError:
                self.work.wait()
                fut = torch.futures.Future()
                fut.set_result(self.outputs)
        return _ModeledFuture(self, fut)


class _ModeledFuture:
    """A Work's future as CUDA runs it: ``then(fn)`` runs ``fn`` once the collective is done, on a stream
    that waits for it (a CUDA future's callbacks run on streams synchronized with its events), and the
    future it returns, when DDP waits for it at the end of the backward, orders the compute stream after
    that stream. Here ``fn`` runs at once, on the checker's "future callbacks" stream."""

    def __init__(self, work: ModeledWork, fut: torch.futures.Future):
        self.work, self.fut = work, fut

    def then(self, fn) -> torch.futures.Future:
        checker = self.work.checker
        with checker.paused():
            self.fut.wait()
        sid = checker.clocks.stream("future callbacks") if checker.callbacks is None else checker.callbacks
        checker.callbacks = sid
        checker.clocks.merge(sid, self.work.vc)
        before, checker.current = checker.current, sid
        try:
            value = fn(self.fut)
        finally:
            checker.current = before
        done = checker.clocks.snapshot(sid)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: checker.clocks.merge(checker.current, done))
        out = torch.futures.Future()
        out.set_result(value)
        return out
