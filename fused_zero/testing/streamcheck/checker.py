"""``StreamChecker``: run the real engine on CPU tensors as if on a GPU, and report every stream-order
hazard and every host synchronization.

Inside ``with StreamChecker() as checker:`` an optimizer built on CPU parameters gets a side stream made
of stand-ins (device.py), so the engine takes its CUDA code path: updates queued on the side stream,
stream waits instead of host waits, pinned uploads. Its collectives (pipeline/comm/collectives.py) are
issued on a communication stream per process group, after the issuing stream, reading and writing what
each declares there (``collectives.FACTS``), and their Works order whoever waits for them; its update
and norm launches are single operations on the stream they are queued on, reading and writing exactly
their rows' elements; every other tensor operation, the model's forward and backward and DDP's own work
included, runs on the compute stream (or, for host memory, on the host). The operations still compute
for real (gloo, torch's CPU ops), so training goes on as usual while the ordering is recorded
(clocks.py).

The checkpoint server's thread (checkpoint/serving/peers.py) is modeled too: whatever it queues inside the
stand-ins' ``use(stream)`` runs on its own stream (``copy_stream``), seen through a dispatch mode of that
thread; a host synchronization of the training thread does not order that stream (only the events it
waits for do), and its own blocking copies are not the step path's synchronizations. A Work's ``wait()``
orders the waiting stream only, never the host (gloo's real wait is only for the values); once the real
wait returned, every rank of the group has joined the collective, so the waiter also follows what this
rank's server had finished serving by then (a requester joins its next collective only once served).
``pending_event`` stands for an event recorded after work that cannot run before a request is answered
(behind a collective the requester has not joined: a host that ran ahead, see checkpoint/serving/published.py):
waiting for it is reported as a deadlock.

What it cannot see: ordering that only timing gives (it assumes none), and DDP's C++ waits other than
on the futures the comm hook returns (modeled: ``finalize_backward`` waits for them).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch
import torch.distributed as dist

from ... import kernels
from ...algorithms.fused import FusedKernel
from ...pipeline.comm import collectives, streams
from ...pipeline.updating import norm_check, warmup
from . import backends, standins
from .clocks import Clocks, Hazard
from .device import ModeledEvent, ModeledStreams, finished_serving
from .graphs import Capture
from .memory import Memory
from .trace import DispatchCalls, function_patches

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # fused_zero/
_KERNELS = os.path.dirname(os.path.abspath(kernels.__file__))  # kernels/ in a source checkout
_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


class StreamChecker:
    """Attributes:
        clocks: the model (streams, clocks, memory, hazards).
        memory: which storages are known, and whether each is host memory, pinned (memory.py).
        compute, host: the compute stream's and the host's stream index.
        current: the stream operations are queued on now, by the calling thread (None in another thread
            than the one that entered the checker, outside a modeled ``use(stream)``: not recorded).
        served: what this rank's checkpoint server had read when its last copy finished (ModeledWork).
        syncs: ``(what, where, phase, ours)`` of every host synchronization seen; ``ours``: fused_zero's
            code is on the stack (else it is the caller's, or DDP's own, C++ reducer included).
        phase: a label the caller sets (``checker.phase = "step 3"``), recorded with each sync.
        backend: the ``init_process_group`` backend string modeled ("nccl", "cpu:gloo,cuda:nccl", or
            None for torch's default): what every process group reports (backends.py).
    """

    def __init__(self, backend: str | None = "nccl"):
        self.backend = backend
        self.clocks = Clocks()
        self.compute = self.clocks.stream("compute stream")
        self.host = self.clocks.stream("host", frees_checked=False)
        self._thread = threading.get_ident()
        self._local = threading.local()
        self.served: dict[int, int] = {}
        self.lock = threading.RLock()  # the model is shared by the training and server threads
        self.comm: dict[int, int] = {}
        self.memory = Memory(self)
        self.callbacks: int | None = None  # the stream future callbacks run on (device._ModeledFuture)
        self.syncs: list[tuple[str, str, str, bool]] = []
        self.phase = ""
        self._patches: list[tuple[object, str, object]] = []
        self._modes = (DispatchCalls(self),)
        self.capture: Capture | None = None  # a CUDA graph's capture in progress (graphs.py)
        self.captures: list[Capture] = []  # every capture made, with its problems

    @property
    def current(self) -> int | None:
        return getattr(self._local, "sid", self.compute if self.in_training_thread() else None)

    @current.setter
    def current(self, sid: int | None) -> None:
        self._local.sid = sid

    def in_training_thread(self) -> bool:
        return threading.get_ident() == self._thread

    def capturing(self) -> Capture | None:
        """The capture the calling code queues into: the training thread's, outside the stand-ins' own
        operations (the checkpoint server's thread is not captured: thread-local capture mode)."""
        if self.capture is None or not self.in_training_thread() or self.is_paused():
            return None
        return self.capture

    def pending_event(self, why: str) -> ModeledEvent:  # one that cannot complete before ``why`` is answered
        return ModeledEvent(self, pending=why)

    # ------------------------------------------------------------------ results

    def hazards(self) -> list[Hazard]:
        """Every hazard once (by kind and the two operations' places)."""
        seen, out = set(), []
        for h in self.clocks.hazards:
            key = (h.kind, h.first.op, h.first.where, h.second.op if h.second else None,
                   h.second.where if h.second else h.freed_at)
            if key not in seen:
                seen.add(key)
                out.append(h)
        return out

    def report(self) -> str:
        lines = [str(h) for h in self.hazards()]
        return "\n".join(lines) if lines else "no stream-order hazard"

    # ------------------------------------------------------------------ context

    def __enter__(self) -> StreamChecker:
        real_streams = streams.device_streams
        self._patch(streams, "device_streams",
                    lambda device: ModeledStreams(self, device) if device.type == "cpu" else real_streams(device))
        for name, facts in collectives.FACTS.items():  # what each reads and writes, declared beside it
            if not facts.objects:  # host objects only: no stream orders them
                self._patch(collectives, name, standins.collective(self, getattr(collectives, name), facts))
        # the code's own backend choices, from what the process groups report on the GPU machine
        for owner, name, value in backends.patches(*backends.modeled_reports(self.backend)):
            self._patch(owner, name, value)
        from_numpy = torch.from_numpy  # no __torch_function__ of its own: seen here instead

        def host_from_numpy(array):
            t = from_numpy(array)
            self.memory.register(t, host=True, name=f"host from_numpy {tuple(t.shape)}")
            return t

        self._patch(torch, "from_numpy", host_from_numpy)
        for owner, name, value in function_patches(self):
            self._patch(owner, name, value)
        for owner, name, value in standins.capturable_on_the_host():
            self._patch(owner, name, value)
        self._patch(FusedKernel, "apply", standins.launch_apply(self, FusedKernel.apply))
        for caller in (norm_check, warmup):  # the norm pass, by the name its callers call it
            self._patch(caller, "grad_sumsq", standins.launch_norm(self, caller.grad_sumsq))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        for owner, name, value in reversed(self._patches):
            setattr(owner, name, value)
        self._patches = []

    def _patch(self, owner, name: str, value) -> None:
        self._patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    @contextlib.contextmanager
    def paused(self):
        """Operations here are the stand-ins' own: not recorded."""
        self._local.paused = self.paused_depth() + 1
        try:
            yield
        finally:
            self._local.paused -= 1

    def paused_depth(self) -> int:
        return getattr(self._local, "paused", 0)  # per thread: the server's pauses are not the training's

    def is_paused(self) -> bool:
        return self.paused_depth() > 0

    def record(self, op: str, reads=(), writes=(), sid: int | None = None, transfer: bool = False) -> None:
        """One operation on ``sid`` (default: the host if it touches host memory only, else the current
        stream), reading ``reads`` and writing ``writes`` (tensors; the bytes each one spans).

        A device-stream operation reading (or writing) pageable host memory (``Memory.is_pageable``; index
        tensors are reads too) is reported, unless it is a ``transfer``: a copy to the device, or a
        blocking one to the host, which CUDA makes with any host memory (a host wait where pageable)."""
        spans = [(t, False) for t in reads] + [(t, True) for t in writes]
        spans = [(t, w) for t, w in spans if t.numel()]
        if not spans or (sid is None and self.current is None):  # another thread's host work: not modeled
            return
        with self.lock:
            self._record(op, spans, sid, transfer)

    def _record(self, op: str, spans: list, sid: int | None, transfer: bool) -> None:
        memory = self.memory
        entries = [(t, w, memory.register(t)) for t, w in spans]  # each tensor's storage looked up once
        if sid is None:
            written = [st for _, w, st in entries if w]
            if written and all(st is not None and st.host for st in written):  # the host writes host memory
                device_reads = [t for t, w, st in entries if not w and not (st is not None and st.host)]
                if device_reads:  # a copy from the device into host memory: the host waits for it
                    self.host_read(device_reads[0], f"{op} of a device tensor into host memory", record=False)
                sid = self.host
            else:
                sid = self.host if all(st is not None and st.host for *_, st in entries) else self.current
        capture = self.capturing()
        if capture is not None:  # nothing runs at a capture: the replay is the graph's one operation
            capture.queued(sid, op, [t for t, w in spans if not w], [t for t, w in spans if w])
            return
        on_device = sid != self.host
        if not on_device and not self.in_training_thread():  # the server's host work: before its next
            sid = self.current  # stream operations, yet still host work (pageable memory is fine there)
        where = self.where()
        if on_device and not transfer:
            for t, _, st in entries:
                if st is not None and st.host and not st.pinned and t.dim() > 0:  # Memory.is_pageable
                    self.clocks.host_read(t.untyped_storage().data_ptr(), *_span(t), sid, op, where)
        for key, lo, hi, write in _coalesce(spans):
            self.clocks.access(key, lo, hi, sid, write, op, where)
        if sid == self.host:  # the host's work is done before anything queued after it
            self.clocks.host_sync(self.clocks.snapshot(self.host))

    def host_read(self, t: torch.Tensor, what: str, record: bool = True) -> None:
        """The host reads a device value: a copy on the current stream, then a host wait for it (in the
        server's thread, off the step path: neither logged nor ordering the training thread's streams)."""
        if record:
            self.record(what, reads=[t])
        if not self.in_training_thread():
            if self.current is not None:
                finished_serving(self, self.current)
            return
        self.log_sync(what)
        if self.capturing() is None:
            self.clocks.host_sync(self.clocks.snapshot(self.current))

    def log_sync(self, what: str) -> None:
        self.syncs.append((what, self.where(), self.phase, _ours(sys._getframe(1))))
        capture = self.capturing()
        if capture is not None:
            capture.problem("host synchronization", what)

    def where(self) -> str:
        """The innermost frame outside torch and this checker: the line that queued the operation."""
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            shown = _SHOWN.get(code.co_filename)
            if shown is None:
                shown = _shown(code.co_filename)
            if shown:
                return f"{shown}:{frame.f_lineno} ({code.co_name})"
            frame = frame.f_back
        return "?"

    # ------------------------------------------------------------------ stand-ins

    def _comm_stream(self, group) -> int:
        group = group if group is not None else dist.group.WORLD
        sid = self.comm.get(id(group))
        if sid is None:
            sid = self.comm[id(group)] = self.clocks.stream(f"communication stream {len(self.comm)}")
        return sid


def _ours(frame) -> bool:
    """Whether fused_zero's code (not this checker, not the demo's rank launcher) is on the stack."""
    while frame is not None:
        path = frame.f_code.co_filename
        ours = path.startswith(_PACKAGE) or path.startswith(_KERNELS)
        if ours and not path.startswith(_HERE) and os.sep + "demo" + os.sep not in path:
            return True
        frame = frame.f_back
    return False


_PLUMBING = ("/contextlib.py", "/weakref.py")
"""Frames that only pass a call on (context managers, finalizers): the line that called them counts."""

_SHOWN: dict[str, str] = {}
"""A frame's file -> how ``where`` shows it ("" for a file it looks past): asked once per file, as
``where`` runs for every operation."""


def _shown(path: str) -> str:
    if path.startswith(_HERE) or path.startswith(_TORCH) or path.endswith(_PLUMBING):
        shown = ""
    elif path.startswith(_PACKAGE) or path.startswith(_KERNELS):
        shown = os.path.relpath(path, os.path.dirname(_PACKAGE))
    else:
        shown = path
    _SHOWN[path] = shown
    return shown

def _span(t: torch.Tensor) -> tuple[int, int]:
    size = t.element_size()
    lo = t.storage_offset()
    if t.is_contiguous():  # its elements end to end (numel > 0: empty tensors are not recorded)
        return lo * size, (lo + t.numel()) * size
    hi = lo + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    return lo * size, hi * size


def _coalesce(spans):
    """``(storage key, lo, hi, write)`` for tensors, adjacent ranges of one storage merged."""
    if len(spans) == 1:
        t, write = spans[0]
        yield (t.untyped_storage().data_ptr(), *_span(t), write)
        return
    by_key: dict[tuple, list[tuple[int, int]]] = {}
    for t, write in spans:
        lo, hi = _span(t)
        by_key.setdefault((t.untyped_storage().data_ptr(), write), []).append((lo, hi))
    for (key, write), ranges in by_key.items():
        ranges.sort()
        lo, hi = ranges[0]
        for a, b in ranges[1:]:
            if a <= hi:
                hi = max(hi, b)
            else:
                yield key, lo, hi, write
                lo, hi = a, b
        yield key, lo, hi, write
