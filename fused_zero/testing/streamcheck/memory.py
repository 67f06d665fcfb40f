"""``Memory``: which storages the checker knows, and of what kind each one's memory is.

Split from the checker (checker.py) because it answers one question the ordering rules keep asking,
"what is this tensor's memory?": device memory a stream owns, host memory (pinned or pageable), and
for host values computed from other host values, the tensor they were first made in (so a report
names where the data came from, not the temporary a device operation read). A storage is known by its
address together with a weak reference to it: the allocator reuses an address once its storage is
dead, possibly before the weak reference's callback that records the free has run, and the weak
reference tells the two apart.

It knows the checker only as ``Owner``: what it asks of it (its lock, its clocks, its streams, where an
operation was queued), so memory.py imports nothing of checker.py.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    import threading

    from .clocks import Clocks, Storage
    from .graphs import Capture


class Owner(Protocol):
    """What ``Memory`` asks of the checker it belongs to (``StreamChecker``, checker.py)."""

    lock: threading.RLock  # held while the model changes (training and server threads)
    clocks: Clocks  # the storages' entries and their frees
    host: int  # the host's stream index

    @property
    def current(self) -> int | None: ...  # the stream the calling thread queues on (None: not recorded)

    def capturing(self) -> Capture | None: ...  # the CUDA graph capture the calling code queues into

    def where(self) -> str: ...  # the line that queued the operation


class Memory:
    """The storages of one ``StreamChecker`` (its clocks hold their accesses; this holds their
    identities)."""

    def __init__(self, checker: Owner):
        self.checker = checker
        self._refs: dict = {}  # storage key -> weak reference to the storage registered there

    def register(self, t: torch.Tensor, host: bool = False, name: str | None = None, pinned: bool = False,
                 origin: str = "", fresh: bool = False) -> Storage | None:
        """Know ``t``'s storage (allocated now, on the current stream, unless known already); returns its
        entry (None for a storage without memory). ``origin``: the host tensor a host-computed one derives
        from (named in reports: where the data was made). ``fresh``: the storage was allocated by the
        operation that returns it, so an entry at its address is a dead storage's, not looked up by its
        weak reference; inside a CUDA graph's capture, an allocation the capture reports (graphs.py)."""
        checker = self.checker
        storage = t.untyped_storage()
        key = storage.data_ptr()
        with checker.lock:
            if key == 0:
                return None
            ref = self._refs.get(key)
            if ref is not None and not fresh and ref() is storage:
                known = checker.clocks.storages.get(key)
                if known is not None:
                    return known
            if key in checker.clocks.storages:  # a freed storage's memory, reused before its callback ran
                self._freed(key)
            capture = checker.capturing()
            if fresh and capture is not None:
                capture.problem("allocation", f"{name or t.dtype} of {storage.nbytes()} B made inside the capture")
            sid = checker.host if host or checker.current is None else checker.current
            label = name or f"{'host' if host else 'device'} {t.dtype} storage of {storage.nbytes()} B"
            label = f"{label} (made at {checker.where()}{f', from {origin}' if origin else ''})"
            st = checker.clocks.storage(key, label, sid, host, pinned)
            st.origin = origin
            # the weak reference's callback records the free (kept alive here; one replaced by a newer
            # storage at the same address would only have found that one registered)
            self._refs[key] = weakref.ref(storage, lambda ref, key=key: self._freed(key, ref))
        return st

    def known(self, t: torch.Tensor) -> Storage | None:
        """``t``'s storage as registered, or None: unknown, or a dead storage's entry at the same address."""
        storage = t.untyped_storage()
        key = storage.data_ptr()
        with self.checker.lock:
            ref = self._refs.get(key)
            if ref is None or ref() is not storage:
                return None
            return self.checker.clocks.storages.get(key)

    def origin(self, t: torch.Tensor) -> str:
        """The host tensor ``t``'s values were first made in (itself, if not computed from another)."""
        st = self.known(t)
        if st is None:
            return ""
        return st.origin or st.name

    def _freed(self, key, ref=None) -> None:
        checker = self.checker
        with checker.lock:
            if ref is not None and self._refs.get(key) is not ref:
                return  # its address was registered again already
            self._refs.pop(key, None)
            if key in checker.clocks.storages:
                checker.clocks.freed(key, checker.where())

    def is_host(self, t: torch.Tensor) -> bool:
        st = self.known(t)
        return st is not None and st.host

    def is_pageable(self, t: torch.Tensor) -> bool:
        """Host memory a device stream cannot read: not pinned, not a 0-dim value (CUDA takes a 0-dim
        CPU tensor as a scalar argument)."""
        st = self.known(t)
        return st is not None and st.host and not st.pinned and t.dim() > 0
