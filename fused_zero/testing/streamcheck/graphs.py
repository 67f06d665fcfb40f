"""A CUDA graph's capture and replay, modeled on the CPU (``ModeledStreams.graph()``), so that
``capturable=True``'s path (pipeline/step_end/step_graph.py) runs under the stream-order checker.

A capture on CUDA records work without running it, and a replay runs exactly what was recorded: the
same kernels on the same addresses with the same scalar arguments. What breaks a graph is therefore
what the host does inside the capture that a replay cannot do again, and what the capture reaches
outside itself. The model reports, as *problems* of the capture (``Capture.problems``):

- a host synchronization (CUDA refuses it while a stream captures);
- an allocation (a graph replays fixed addresses: what the capture allocates lives in a private pool
  of the graph, and a tensor the host makes there each step is not the one the replay writes);
- work on a stream that is not part of the capture (it would run once, now, and never on replay), a
  wait for work queued outside the capture (CUDA's capture isolation error), a stream forked from the
  capture and not joined back before its end (CUDA's unjoined error);
- host work (an operation on host memory only): the replay does not redo it.

The capture runs the code (its operations execute on the CPU, so that shapes and values exist for the
code that follows), records each operation for the replay, and then puts every device storage back
as it was before: as on CUDA, a capture changes nothing. A replay runs the recorded operations again,
on the tensors they ran on, with the arguments they had (a scheduler's new lr reaches the replay only
through device memory); for the checker's clocks it is one operation on the replaying stream that
reads and writes everything the graph touched.
"""

from __future__ import annotations

import contextlib

import torch


class Capture:
    """One capture in progress. Attributes:
        origin: the capturing stream's index.
        problems: ``(kind, what, where)`` of everything a graph cannot hold (see the module docstring).
        operations: what a replay runs, in order (callables).
        reads, writes: the tensors the graph reads and writes (the replay's one operation).
    """

    def __init__(self, checker, origin: int):
        self.checker, self.origin = checker, origin
        self.vc: dict[int, dict[int, int]] = {origin: {origin: 0}}  # each captured stream's clock
        self.problems: list[tuple[str, str, str]] = []
        self.operations: list = []
        self.reads: list[torch.Tensor] = []
        self.writes: list[torch.Tensor] = []

    def problem(self, kind: str, what: str) -> None:
        self.problems.append((kind, what, self.checker.where()))

    def _name(self, sid: int) -> str:
        return self.checker.clocks.names[sid]

    def queued(self, sid: int, op: str, reads=(), writes=()) -> None:
        """An operation queued on stream ``sid`` while capturing."""
        if sid == self.checker.host:
            self.problem("host work", f"{op} on host memory: the replay does not redo it")
        elif sid not in self.vc:
            self.problem("outside the capture", f"{op} queued on the {self._name(sid)}, which is not part of the "
                                                 "capture: it runs once, now, and not on replay")
        else:
            self.vc[sid][sid] = self.vc[sid].get(sid, 0) + 1
        self.reads += list(reads)
        self.writes += list(writes)

    def snapshot(self, sid: int) -> dict[int, int] | None:
        return dict(self.vc[sid]) if sid in self.vc else None

    def point(self, sid: int) -> tuple[Capture, dict[int, int] | None]:
        """Where stream ``sid`` is now in this capture: what an event recorded or a collective issued
        inside it keeps, for a later ``wait``."""
        return self, self.snapshot(sid)

    def clock_of(self, point: tuple | None) -> dict[int, int] | None:
        """A point's clock if it was taken in this capture; None (outside work) otherwise."""
        return point[1] if point is not None and point[0] is self else None

    def wait(self, waiter: int, vc: dict[int, int] | None, what: str) -> None:
        """Stream ``waiter`` waits for a point of a captured stream (``vc``), or for work from outside
        the capture (``vc`` None)."""
        if vc is None:
            self.problem("isolation", f"the {self._name(waiter)} waits for {what}, queued outside the capture")
            return
        mine = self.vc.setdefault(waiter, {})  # a stream that waits for the capture joins it (a fork)
        for sid, tick in vc.items():
            mine[sid] = max(mine.get(sid, 0), tick)

    def end(self) -> None:
        """Every stream forked from the capture must be joined back into the capturing stream."""
        joined = self.vc[self.origin]
        for sid, clock in self.vc.items():
            if sid != self.origin and clock.get(sid, 0) > joined.get(sid, 0):
                self.problem("unjoined", f"the {self._name(sid)} forked from the capture and was not joined "
                                         "back before its end")


class ModeledGraph:
    """``pipeline.comm.streams.CudaGraph`` for the checker. Attributes: ``capture_of`` (the last Capture)."""

    def __init__(self, checker):
        self.checker = checker
        self.capture_of: Capture | None = None

    @contextlib.contextmanager
    def capture(self, stream):
        checker = self.checker
        checker.log_sync("torch.cuda.graph() synchronizes the device before a capture")
        saved = _device_storages(checker)
        capture = Capture(checker, stream.sid)
        before, checker.current = checker.current, stream.sid
        checker.capture = capture
        try:
            yield
        finally:
            checker.capture = None
            checker.current = before
            with checker.paused():
                for view, data in saved:
                    view.copy_(data)
        capture.end()
        self.capture_of = capture
        checker.captures.append(capture)

    def replay(self) -> None:
        capture = self.capture_of
        checker = self.checker
        with checker.paused():
            for operation in capture.operations:
                operation()
        checker.record("CUDA graph replay", reads=capture.reads + capture.writes, writes=capture.writes)


def _device_storages(checker) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A copy of every live device storage the checker knows: what a capture's own run changes is put
    back from it."""
    out = []
    with checker.lock, checker.paused():
        for key, ref in list(checker.memory._refs.items()):
            st = checker.clocks.storages.get(key)
            storage = ref()
            if st is None or st.host or storage is None or not storage.nbytes():
                continue
            view = torch.empty(0, dtype=torch.uint8).set_(storage)
            out.append((view, view.clone()))
    return out


def replayed(func, args, kwargs, out):
    """A recorded operation: run again on the same tensors; what it makes anew is copied into what it
    made at the capture (the graph's pool: the replay's addresses are the capture's)."""
    def again():
        new = func(*args, **kwargs)
        for made, now in zip(_flat(out), _flat(new)):
            if made.untyped_storage().data_ptr() != now.untyped_storage().data_ptr():
                made.copy_(now)
    return again


def _flat(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return []
