"""One DDP bucket as this rank holds it: the flat parameter buffer the bucket's parameters are views
of, this rank's region of optimizer state, the kernel rows, and its all-gather (pipeline/gathering/),
which brings the updated parameters back. The gradient is not ours: the reduction runs in place in DDP's
bucket buffer and the kernels read it there.

The region's state is kept in *parts*, one per member and state format of the bucket's parameters: a
*member* is one of the fused_zero optimizers over the DDP module (pipeline/members.py; one in most
programs), with its own algorithm and state names, and ``state_format`` is set per param group. A
bucket of one member and format has one part, region-shaped: slot ``i`` of its tensors is slot ``i`` of
the region. Otherwise each part holds only its parameters' runs, packed back to back: every run
keeps its region offset modulo ``PART_ALIGN``, so its kernel rows are cut (and its 8-bit blocks fall)
exactly as they would in a region-shaped part, and the kernels, which index state by a row's offset,
run unchanged on a part.
``values`` and ``store_values`` translate between the region and the parts: everything outside the
update (checkpoints, resharding) sees region-shaped fp32.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ...algorithms import codecs
from ...algorithms.codecs import DTYPES
from ...kernels import Segments, row_table
from ..gathering.gather import BucketGather
from .layout import BucketLayout
from .strides import strided_view

PART_ALIGN = 32
"""A part's runs keep their region offsets modulo 32 elements (the arena's alignment, a multiple of the
kernels' vector width)."""


@dataclass
class Part:
    """The state of one member's parameters of one format in a shard.

    Attributes:
        member: the member (optimizer) whose parameters these are: its algorithm updates them.
        format: the moments' storage format (algorithms/codecs.py).
        state: state name -> tensor of ``size`` slots in that format (fp32 ``"master"``).
        scales: 8-bit moments' fp32 scales, one per row of ``table``; else empty.
        rows: host kernel pieces indexing ``state`` (the shard's parameter and gradient offsets);
            ``table`` their host row table (kernels.row_table); ``segments`` the same on the device;
            ``blocks`` its 8-bit blocks (codecs.BlockTable), derived once with it.
        spans: ``(region_off, part_off, length)`` runs: where the part's slots sit in the region.
        size: slots of each state tensor.
        region_shaped: the shard's only part: slot ``i`` is region slot ``i``.
        norm_rows / norm_segments: the rows whose gradients count towards the global norm and the
            non-finite count: each element once over DDP's group, so the slice on the first replica only
            and the replicated tail on one rank (``counts``, from pipeline/buckets/topology.py). Gradients only.
    """

    member: int
    format: str
    state: dict
    scales: dict
    rows: list
    table: torch.Tensor
    segments: object
    blocks: codecs.BlockTable
    spans: list
    size: int
    region_shaped: bool
    norm_rows: list
    norm_segments: object

    @property
    def key(self) -> tuple[int, str]:
        """What one launch updates: a member's parameters of one format (arena.py)."""
        return self.member, self.format

    def region_values(self, name: str, out: torch.Tensor) -> None:
        """Write this part's ``name`` decoded to fp32 into its slots of region-shaped ``out``."""
        v = codecs.values(self.state[name], self.scales.get(name), self.blocks, name)
        for lo, at, n in self.spans:
            out[lo:lo + n] = v[at:at + n]

    def stored(self, name: str, region_off: int, n: int) -> torch.Tensor:
        """``name`` as stored (8-bit codes, bf16, fp32) at ``n`` region slots from ``region_off``, which
        lie in one of the part's runs (a view)."""
        for lo, at, m in self.spans:
            if lo <= region_off and region_off + n <= lo + m:
                return self.state[name][at + region_off - lo:at + region_off - lo + n]
        raise ValueError(f"region slots {region_off}..{region_off + n} are not in one run of this part")

    def region_offsets(self, part_offsets: torch.Tensor) -> torch.Tensor:
        """The region offsets of part slots (int64): where ``region_values`` puts them."""
        if self.region_shaped:
            return part_offsets
        spans = torch.tensor(self.spans, dtype=torch.int64, device="cpu").reshape(-1, 3)
        span = torch.searchsorted(spans[:, 1].contiguous(), part_offsets, right=True) - 1
        return part_offsets - spans[span, 1] + spans[span, 0]

    def store_region(self, name: str, x: torch.Tensor) -> None:
        """Encode this part's slots of region-shaped fp32 ``x`` into ``name``."""
        codecs.store_values(self.state[name], self.scales.get(name), self.blocks, name, self._mine(x))

    def _mine(self, x: torch.Tensor) -> torch.Tensor:
        """This part's slots of region-shaped ``x``."""
        if self.region_shaped:
            return x
        mine = torch.zeros(self.size, dtype=torch.float32, device=x.device)
        for lo, at, n in self.spans:
            mine[at:at + n] = x[lo:lo + n]
        return mine

    def hold(self, name: str, x: torch.Tensor) -> None:
        """Keep this part's slots of region-shaped fp32 ``x`` as ``name`` in fp32, unencoded, until
        ``encode_held``: the kernels take the moments' format from their dtype, so the part updates in
        fp32 meanwhile. New dicts: a version published before keeps what it was (checkpoint/serving/published.py)."""
        self.state = {**self.state, name: self._mine(x).clone()}
        self.scales = {k: v for k, v in self.scales.items() if k != name}

    @property
    def held(self) -> bool:
        """Whether some moment is held in fp32 although the part's format is 8-bit."""
        return DTYPES[self.format] == torch.uint8 and any(
            t.dtype == torch.float32 for name, t in self.state.items() if name != "master")

    def encode_held(self) -> None:
        """Encode every held moment into the part's format, in the part's blocks."""
        state, scales = dict(self.state), dict(self.scales)
        for name, t in self.state.items():
            if name != "master" and t.dtype == torch.float32:
                state[name] = torch.zeros(self.size, dtype=torch.uint8, device=t.device)
                scales[name] = torch.zeros(self.table.shape[0], dtype=torch.float32, device=t.device)
                codecs.store_values(state[name], scales[name], self.blocks, name, t)
        self.state, self.scales = state, scales


def _part_spans(pieces: list, size: int, only_part: bool) -> tuple[list, list, int]:
    """``(rows, spans, size)`` of one part from its region pieces ``(region_off, length, ...)`` in
    region order: the region itself where the part is the shard's only one, else the pieces' runs
    packed, each at its region offset modulo PART_ALIGN."""
    if only_part:
        return list(pieces), [(0, 0, size)], size
    rows, spans, at = [], [], 0
    for piece in pieces:
        so, n = piece[0], piece[1]
        if spans and spans[-1][0] + spans[-1][2] == so:  # contiguous with the previous run
            lo, start, m = spans[-1]
            spans[-1] = (lo, start, m + n)
            new = start + m
        else:
            new = at + (so - at) % PART_ALIGN
            spans.append((so, new, n))
        rows.append((new, n, *piece[2:]))
        at = new + n
    return rows, spans, at


def _runs(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` pieces sorted, the adjacent ones merged."""
    out: list[list[int]] = []
    for off, n in sorted(pieces):
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += n
        else:
            out.append([off, n])
    return [tuple(r) for r in out]


class BucketShard:
    """Attributes:
        layout: the bucket's BucketLayout (offsets, slices, rows).
        params: the bucket's parameters, in bucket order; ``pids`` their optimizer indices (numpy),
            ``members`` their members' (``member_set``: those members, the same on every rank).
        all_active: read-only all-True flags, one per parameter (a bucket where every parameter got a
            gradient, without a new array per bucket and step).
        param_buffer: flat, ``layout.numel`` elements of the parameters' dtype; each parameter's
            ``.data`` is a view of it, so the all-gather writes parameters in place.
        names: every state name some part holds (``"master"`` last, with master weights).
        parts: the state, one Part per member and format of the bucket's parameters (module docstring).
        gather: the bucket's all-gather (gathering/gather.py): started after an update, finished where
            the parameters are read next.
        reduced_buffer: this iteration's reduced gradient, from the reduction to the update: DDP's buffer,
            or its copy in ``grad_reduce_dtype`` (indexed like the bucket either way).
        held: some 8-bit moment is held in fp32 since a load, until ``encode_held``.
        foreign: ``(bucket offset, length)`` runs of the parameters no fused_zero optimizer updates
            (params.NO_MEMBER), adjacent ones merged: reduced to DDP's average, kept out of the parameter
            buffer (an empty one where the bucket holds no other parameter), the state and the updates.
    """

    def __init__(self, layout: BucketLayout, params: list[torch.nn.Parameter], *, state_names: list[list[str]],
                 master: bool, device: torch.device, dtype: torch.dtype, members: list[int], state_formats: list[str],
                 upload=None, counts: tuple[bool, bool] | None = None):
        """``state_names``: each member's; ``members``, ``state_formats``: each parameter's, in bucket order."""
        self.layout = layout
        self.params = params
        self.pids = np.asarray(layout.pids)  # indexes the optimizer's per-parameter host arrays
        self.members = np.asarray(members, dtype=np.int64)
        self.member_set = frozenset(int(m) for m in np.unique(self.members) if m >= 0)
        self._device_pids: dict[int, tuple] = {}  # member -> (device pids, their pinned source)
        self.all_active = np.ones(len(self.pids), dtype=bool)  # shared, read-only: every parameter active
        self.all_active.flags.writeable = False
        self.held = False  # some 8-bit moment held in fp32 since a load (load_values)
        # a bucket of parameters no fused_zero optimizer updates only is reduced, never updated or gathered
        self.param_buffer = torch.zeros(layout.numel if self.member_set else 0, dtype=dtype, device=device)
        present = sorted(self.member_set)
        self.names = list(dict.fromkeys(n for m in present for n in state_names[m])) + \
            (["master"] if master and present else [])
        self.foreign = _runs([(off, n) for off, n, m in zip(layout.offsets, layout.numels, members) if m < 0])
        counts_slice, counts_tail = counts if counts is not None else (True, layout.rank == 0)
        tail_at = layout.region_tail(layout.rank)[0]
        # the kernels index the optimizer-wide coefficient table: the row's pid is the global one
        by_key: dict[tuple[int, str], list] = {}
        for so, n, po, go, local, elem in layout.rows():
            if members[local] < 0:
                continue  # no fused_zero optimizer's: no state
            counted = counts_slice if so < tail_at else counts_tail
            by_key.setdefault((members[local], state_formats[local]), []).append(
                ((so, n, po, go, layout.pids[local], elem), counted))
        self.parts = [self._part(key, pieces, len(by_key) == 1, state_names[key[0]], master, device, upload)
                      for key, pieces in by_key.items()]
        self.gather = BucketGather(layout, self.members, self.member_set)
        self._completed: tuple | None = None  # (weak reference to DDP's buffer, completed Future of it)
        self.reduced_buffer: torch.Tensor | None = None  # kept until the step has run

    def _part(self, key: tuple[int, str], pieces: list, only_part: bool, state_names: list[str], master: bool,
              device, upload) -> Part:
        member, fmt = key
        rows, spans, size = _part_spans([row for row, _ in pieces], self.layout.region_size, only_part)
        norm_rows = [row for row, (_, counted) in zip(rows, pieces) if counted]
        moments = DTYPES[fmt]
        state = {name: torch.zeros(size, dtype=moments, device=device) for name in state_names}
        if master:
            state["master"] = torch.zeros(size, dtype=torch.float32, device=device)
        table = row_table(rows)
        scales = {name: torch.zeros(table.shape[0], dtype=torch.float32, device=device)
                  for name in state_names} if moments == torch.uint8 else {}
        segments = Segments.build(rows, upload=upload) if upload is not None else None
        norm_segments = Segments.build(norm_rows, upload=upload) if upload is not None else None
        blocks = codecs.BlockTable(table, size, device, upload)
        return Part(member, fmt, state, scales, rows, table, segments, blocks, spans, size, only_part, norm_rows,
                    norm_segments)

    @property
    def device(self) -> torch.device:
        return self.param_buffer.device

    def bind_params(self) -> None:
        """Copy the parameters' current values into the flat buffer and make them views of it, each
        with its own strides (strides.py: the bucket holds its gradient in that memory order)."""
        for p, off, n, m in zip(self.params, self.layout.offsets, self.layout.numels, self.members):
            if m < 0:
                continue  # no fused_zero optimizer's: it keeps its storage (its owner updates it)
            view = strided_view(self.param_buffer[off:off + n], p.data)
            view.copy_(p.data)
            p.data = view

    def relocate(self, parts: list[tuple[dict, dict]], param_buffer: torch.Tensor) -> None:
        """Move each part's state and scales into the given tensors (``(state, scales)`` per part: views
        of an arena, see arena.py) and the parameter buffer into ``param_buffer``, values included, and
        make the parameters views of the new buffer. No gather or update of this shard may be pending."""
        for part, (state, scales) in zip(self.parts, parts):
            for name, view in state.items():
                view.copy_(part.state[name])
            for name, view in scales.items():
                view.copy_(part.scales[name])
            part.state, part.scales = state, scales
        self.param_buffer = param_buffer
        self.bind_params()

    def init_master_from_params(self, member: int | None = None) -> None:
        """Each part's masters from the parameters (``member``: that member's parts only)."""
        for part in self.parts:
            master = part.state.get("master") if member in (None, part.member) else None
            if master is not None:
                for so, n, po, *_ in part.rows:
                    master[so:so + n].copy_(self.param_buffer[po:po + n])

    def completed(self, buffer: torch.Tensor) -> torch.futures.Future:
        """A completed Future of ``buffer``, what the comm hook returns where DDP need not wait: made once
        per buffer and returned every iteration (DDP only waits on it and reads its value)."""
        done = self._completed
        if done is None or done[0]() is not buffer:
            fut = torch.futures.Future()
            fut.set_result(buffer)
            self._completed = done = (weakref.ref(buffer), fut)
        return done[1]

    def device_pids(self, member: int, side) -> torch.Tensor:
        """The member's ``pids`` of the bucket, int64 on the device, uploaded at first use
        (``side.upload_kept``): the step counts are added there (step_counts.py), on every rank, whether or
        not this rank's region holds a row of them."""
        if member not in self._device_pids:
            mine = self.pids[self.members == member].astype(np.int64)
            self._device_pids[member] = side.upload_kept(torch.from_numpy(mine))
        return self._device_pids[member][0]

    def live(self, name: str, member: int | None = None) -> torch.Tensor | None:
        """The region-shaped fp32 tensor that holds ``name`` itself, where there is one (one part, of
        ``member`` where given, and ``name`` stored in fp32); else None."""
        one = self.parts[0] if len(self.parts) == 1 and member in (None, self.parts[0].member) else None
        t = one.state.get(name) if one is not None else None
        return t if t is not None and t.dtype == torch.float32 else None

    def holding(self, name: str, member: int | None = None) -> list[Part]:
        """The parts that hold ``name`` (``member``: of that member only)."""
        return [p for p in self.parts if name in p.state and member in (None, p.member)]

    def values(self, name: str) -> torch.Tensor:
        """One state name's region decoded to fp32, from every part holding it (``live(name)`` itself
        where there is one; slots no such part covers: 0)."""
        live = self.live(name)
        if live is not None:
            return live
        out = torch.zeros(self.layout.region_size, dtype=torch.float32, device=self.device)
        for part in self.holding(name):
            part.region_values(name, out)
        return out

    def store_values(self, name: str, x: torch.Tensor, member: int | None = None) -> None:
        """Encode fp32 region values ``x`` into one state name, as an update would (``member``: into that
        member's parts only; the others keep theirs)."""
        for part in self.holding(name, member):
            part.store_region(name, x)

    def load_values(self, name: str, x: torch.Tensor, hold: bool, member: int | None = None) -> None:
        """A checkpoint's fp32 region values ``x`` of one state name (``member``: of that member's
        parameters, the others' state untouched). ``hold``: 8-bit parts keep them in fp32 until
        ``encode_held``, so that they are encoded once, in the blocks of the layout that DDP's coming
        bucket rebuild makes (docs/compact-state.md, "An exact resume")."""
        for part in self.holding(name, member):
            if hold and name != "master" and DTYPES[part.format] == torch.uint8:
                part.hold(name, x)
                self.held = True
            else:
                part.store_region(name, x)

    def encode_held(self) -> None:
        for part in self.parts:
            if part.held:
                part.encode_held()
        self.held = False

    def frozen(self) -> BucketShard:
        """A copy whose ``values`` read this shard's state tensors as they are now, whatever the shard
        holds later (``relocate`` gives its parts new tensors): what a version published now is served
        from (checkpoint/serving/published.py). It keeps those tensors alive; it shares the layout and
        parameters, and is never updated."""
        out = copy.copy(self)
        out.parts = [copy.copy(part) for part in self.parts]
        return out

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of optimizer state this shard holds: each part's state and scales."""
        return [t for part in self.parts for t in (*part.state.values(), *part.scales.values())]

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
