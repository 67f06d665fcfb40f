"""The ordering model: streams with vector clocks, memory accesses by byte range, and the hazards.

Each stream counts the operations queued on it; its vector clock says, for every stream, up to which
of that stream's operations it is ordered after (through waits, events and host synchronizations). An
access to memory is recorded with the stream and its count; a later access by another stream that
conflicts with it (either one a write) is a hazard unless the later stream's clock covers the
earlier access. That is the happens-before rule of race detectors (FastTrack), applied to CUDA
streams instead of threads: exact for what the program orders, blind to timing.

Memory is tracked per storage and byte range, so two collectives writing different slices of one
bucket, or an update and a gather touching different slices, do not conflict. A storage's frees are
checked too: the caching allocator hands a freed block to the next allocation on the stream that
allocated it, at once, so every other stream's use of it must be ordered before that stream by then
(else the block is reused while the other stream still reads or writes it; ``record_stream`` is the
usual fix).

Pure: no torch, no devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Access:
    stream: int
    clock: int
    lo: int
    hi: int
    write: bool
    op: str
    where: str


@dataclass
class Storage:
    """What is known of one storage: where it was allocated, whether it is host memory, its accesses."""

    name: str
    stream: int  # the allocating stream (the allocator's pool it returns to)
    host: bool = False
    pinned: bool = False  # host memory a device stream may read (an asynchronous copy's source)
    origin: str = ""  # host memory computed on the host: the name of the storage its values come from
    accesses: list[Access] = field(default_factory=list)


HOST_READ = "host memory read on a device stream"


@dataclass(frozen=True)
class Hazard:
    # "read after write", "write after write", "write after read", "freed while in use", HOST_READ, "deadlock"
    kind: str
    storage: str
    first: Access
    second: Access | None  # None for a free
    streams: tuple[str, str]
    freed_at: str = ""

    def __str__(self) -> str:
        a, b = self.streams
        if self.kind == HOST_READ:
            return (f"{self.kind}: {a} ran {self.first.op} at {self.first.where}, using {self.storage} "
                    f"[{self.first.lo}:{self.first.hi}) bytes, neither pinned nor 0-dim: CUDA refuses a tensor "
                    f"on another device (an index too), or copies it with a host wait")
        if self.kind == "deadlock":
            return f"deadlock: a wait at {self.freed_at} for an event that cannot complete: {self.storage}"
        head = f"{self.kind} on {self.storage} [{self.first.lo}:{self.first.hi}) bytes"
        if self.second is None:
            return (f"{head}: {a} used it in {self.first.op} at {self.first.where}; it was freed into {b}'s "
                    f"pool at {self.freed_at} before {b} was ordered after that use")
        return (f"{head}: {b} ran {self.second.op} at {self.second.where} after {a} ran {self.first.op} at "
                f"{self.first.where}, with no ordering edge from {a} to {b}")


class Clocks:
    """Streams, their vector clocks and the memory they touch.

    Attributes:
        names: stream index -> name.
        vc: stream index -> {stream index: count that stream is ordered after}.
        hazards: every hazard found, in the order found.
    """

    def __init__(self):
        self.names: list[str] = []
        self.vc: list[dict[int, int]] = []
        self.no_free_rule: set[int] = set()
        self.private: set[int] = set()  # streams of another host thread: the training host's syncs skip them
        self.storages: dict[object, Storage] = {}
        self.hazards: list[Hazard] = []

    def stream(self, name: str, *, frees_checked: bool = True, private: bool = False) -> int:
        """A new stream. ``frees_checked=False``: its uses never make a free unsafe (the host, whose
        accesses are synchronous). Communication streams are checked: since torch 2.8 a process group
        no longer ``record_stream``s the tensors handed to its collectives."""
        self.names.append(name)
        self.vc.append({})
        sid = len(self.names) - 1
        if not frees_checked:
            self.no_free_rule.add(sid)
        if private:
            self.private.add(sid)
        return sid

    def tick(self, sid: int) -> int:
        clock = self.vc[sid].get(sid, 0) + 1
        self.vc[sid][sid] = clock
        return clock

    def snapshot(self, sid: int) -> dict[int, int]:
        return dict(self.vc[sid])

    def merge(self, sid: int, snapshot: dict[int, int]) -> None:
        """``sid`` is ordered after everything ``snapshot`` covers (a wait)."""
        self.merge_into(self.vc[sid], snapshot)

    @staticmethod
    def merge_into(mine: dict[int, int], snapshot: dict[int, int]) -> None:
        for k, v in snapshot.items():
            if mine.get(k, 0) < v:
                mine[k] = v

    def host_sync(self, snapshot: dict[int, int]) -> None:
        """The host waited for ``snapshot``: everything it queues from now on, on any stream, follows it
        (not what another host thread queues on its own streams, ``private``)."""
        for sid in range(len(self.vc)):
            if sid not in self.private:
                self.merge(sid, snapshot)

    def ordered(self, access: Access, sid: int) -> bool:
        return access.stream == sid or self.vc[sid].get(access.stream, 0) >= access.clock

    # ------------------------------------------------------------------ memory

    def storage(self, key, name: str, sid: int, host: bool = False, pinned: bool = False) -> Storage:
        st = self.storages.get(key)
        if st is None:
            st = self.storages[key] = Storage(name, sid, host, pinned)
        return st

    def host_read(self, key, lo: int, hi: int, sid: int, op: str, where: str) -> None:
        """Stream ``sid`` (a device stream) runs ``op`` on pageable host memory: reported whatever
        the ordering (the device cannot read it; CUDA refuses the operation or stages a blocking copy)."""
        st = self.storages[key]
        access = Access(sid, self.vc[sid].get(sid, 0), lo, hi, False, op, where)
        self.hazards.append(Hazard(HOST_READ, st.name, access, None, (self.names[sid], "host")))

    def access(self, key, lo: int, hi: int, sid: int, write: bool, op: str, where: str) -> None:
        st = self.storages[key]
        clock = self.tick(sid)
        new = Access(sid, clock, lo, hi, write, op, where)
        for old in st.accesses:
            if old.stream == sid or not (old.write or write) or old.hi <= lo or hi <= old.lo:
                continue
            if not self.ordered(old, sid):
                kind = "write after write" if old.write and write else \
                    "read after write" if old.write else "write after read"
                self.hazards.append(Hazard(kind, st.name, old, new, (self.names[old.stream], self.names[sid])))
        # a stream's later access makes its earlier ones inside the same range redundant for the rule
        # above: a write covers earlier reads and writes, a read covers earlier reads
        st.accesses = [a for a in st.accesses
                       if not (a.stream == sid and lo <= a.lo and a.hi <= hi and (write or not a.write))]
        st.accesses.append(new)
        if len(st.accesses) > 64:
            self._forget_known(st)

    def _forget_known(self, st: Storage) -> None:
        """Drop accesses every stream is ordered after already: no later access can conflict with them."""
        st.accesses = [a for a in st.accesses
                       if not all(self.ordered(a, sid) for sid in range(len(self.vc)))]

    def freed(self, key, where: str) -> None:
        st = self.storages.pop(key, None)
        if st is None or st.host:
            return
        for a in st.accesses:
            if a.stream in self.no_free_rule or a.stream == st.stream:
                continue
            if not self.ordered(a, st.stream):
                self.hazards.append(Hazard("freed while in use", st.name, a, None,
                                           (self.names[a.stream], self.names[st.stream]), where))
