"""The per-program table every kernel in this package reads.

A flat *shard* (optimizer state and reduced gradients) and a flat *parameter* buffer hold many
parameters back to back, with padding the kernels must never touch. A `Segments` table says which
elements are real: one row per program, each row a run of at most ``BLOCK`` contiguous elements of
one parameter:

    (shard_off, length, param_off, grad_off, pid, elem, vector, block)

``shard_off`` indexes the state (master weights, moments), ``param_off`` the parameter buffer,
``grad_off`` the gradient buffer and ``pid`` the row of the per-parameter coefficient table; ``elem``
is the index, within its parameter, of the row's first element (what stochastic rounding draws its
random bits from, so they depend on no layout), and ``block`` the row's number in the table: 8-bit
moments keep one scale per row, at that index (kernels/_common.py). The three
offsets are separate because the three buffers need not share an origin: the state of one rank covers
every bucket back to back, while the parameter and gradient buffers may be per-bucket, full-size
allocations owned by someone else.

``vector`` marks the rows of the aligned vector path. Callers pass whole parameter pieces (five or six
columns: ``elem`` is 0 where left out); `Segments.build` cuts each into a ragged head, an aligned middle
and a ragged tail. A middle
row starts at a multiple of ``VEC`` elements in all three spaces at once and its length is a multiple
of ``VEC``, so the kernels may tell Triton so (``tl.multiple_of``) and Triton emits vector accesses:
``ld.global.v4.b32`` (16 bytes) for fp32 streams, ``ld.global.v2.b32`` (8 bytes) for 16-bit ones. The
ragged ends (under
``VEC`` elements each) and pieces whose three offsets disagree modulo ``VEC`` take the scalar path of
the same launch. Correctness never depends on the cut; only speed does.

The table is built and checked once on the host; launches only compare its precomputed extents with
the lengths of the tensors they are given, so a bad table is an exception at build or launch time,
never an out-of-bounds access and never a device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 2048
"""Elements per program of a vector row. 2048 x fp32 with 8 warps is 8 elements (two 16-byte vectors)
per thread."""

SCALAR_BLOCK = 256
"""Elements per program of a scalar row: one per thread of the kernels' 8 warps. Rows off the vector
path are cut to this length, so a program covers its row in one masked block and no loop's trip count
depends on a loaded length (Triton 3.6's interpreter cannot take a loaded value as a ``range`` bound
under numpy >= 2.4; the compiled kernels lose a loop and nothing else)."""

VEC = 4
"""Vector width in elements: 16 bytes of an fp32 stream, 8 of a 16-bit one. Every stream of a kernel then
has the same layout, four elements per thread per access; with 8 elements, the 16-bit streams' 16-byte
accesses would give them another layout than the fp32 ones', and Triton converts between the two through
shared memory on every element (checked in the PTX). One width for every dtype also keeps one cut of
the rows per layout."""

PIECE_COLUMNS = ("shard_off", "length", "param_off", "grad_off", "pid", "elem")
COLUMNS = PIECE_COLUMNS + ("vector", "block")
VECTOR, BLOCK_INDEX = COLUMNS.index("vector"), COLUMNS.index("block")


def pieces_table(pieces) -> torch.Tensor:
    """A host ``[n, 6]`` int64 table of pieces given with five or six columns (``elem`` 0 if absent)."""
    host = torch.as_tensor(pieces, dtype=torch.int64, device="cpu")
    if host.numel() == 0:
        return torch.zeros(0, len(PIECE_COLUMNS), dtype=torch.int64)
    if host.dim() == 1:
        host = host.reshape(1, -1)
    if host.shape[1] == len(PIECE_COLUMNS) - 1:
        host = torch.cat([host, torch.zeros(host.shape[0], 1, dtype=torch.int64)], dim=1)
    if host.shape[1] != len(PIECE_COLUMNS):
        raise ValueError(f"pieces need 5 or 6 columns {PIECE_COLUMNS}, got {host.shape[1]}")
    return host


def vector_cut(pieces: torch.Tensor) -> torch.Tensor:
    """Cut ``[n, 6]`` pieces into ``[m, 8]`` rows (``block`` not numbered yet): ragged head, aligned
    middle, ragged tail.

    A piece whose three offsets agree modulo ``VEC`` has a middle from its first ``VEC`` multiple to its
    last; otherwise it is one scalar row. Empty parts are dropped; piece order is kept.
    """
    s, n = pieces[:, 0], pieces[:, 1]
    congruent = ((s - pieces[:, 2]) % VEC == 0) & ((s - pieces[:, 3]) % VEC == 0)
    head = torch.where(congruent, torch.minimum((-s) % VEC, n), n)
    mid = (n - head) // VEC * VEC
    tail = n - head - mid
    parts = []
    for start, length, vector in ((0, head, 0), (head, mid, 1), (head + mid, tail, 0)):
        part = torch.zeros(pieces.shape[0], len(COLUMNS), dtype=torch.int64)
        part[:, :len(PIECE_COLUMNS)] = pieces
        part[:, [0, 2, 3, 5]] += start if isinstance(start, int) else start[:, None]
        part[:, 1] = length
        part[:, VECTOR] = vector
        parts.append(part)
    rows = torch.stack(parts, dim=1).reshape(-1, len(COLUMNS))  # piece-major: head, middle, tail
    return rows[rows[:, 1] > 0]


def vector_elements(pieces) -> tuple[int, int]:
    """``(elements on the vector path, all elements)`` of pieces (anything ``torch.as_tensor`` takes,
    five or six columns): a pure function of the offsets, the share the kernels stream with 16-byte
    accesses."""
    host = pieces_table(pieces)
    rows = vector_cut(host[host[:, 1] > 0])
    return int(rows[rows[:, VECTOR] == 1, 1].sum()), int(host[host[:, 1] > 0, 1].sum())


def row_table(pieces) -> torch.Tensor:
    """The host ``[m, 8]`` row table of pieces, every row numbered (``block``): what `Segments.build`
    puts on the device, and what the CPU path cuts its 8-bit blocks by."""
    host = pieces_table(pieces)
    rows = _split_long_rows(vector_cut(host[host[:, 1] > 0]))
    rows[:, BLOCK_INDEX] = torch.arange(rows.shape[0])
    return rows


@dataclass(frozen=True)
class Segments:
    """A validated row table, on the device the kernels run on.

    Attributes:
        rows: int64 tensor ``[n_rows, 8]`` on the kernel device (columns in ``COLUMNS``).
        shard_extent: one past the largest shard index a row touches (0 for no rows).
        param_extent: same for the parameter buffer.
        grad_extent: same for the gradient buffer; None when the gradient offsets address several
            allocations from one base pointer (the builder checked each row against its own one).
        n_params: one past the largest ``pid`` (rows of the coefficient table needed).
    """

    rows: torch.Tensor
    shard_extent: int
    param_extent: int
    grad_extent: int | None
    n_params: int

    @property
    def n_rows(self) -> int:
        return self.rows.shape[0]

    @staticmethod
    def build(pieces, device: torch.device | str = "cpu", *, grad_across_allocations: bool = False,
              upload=None) -> Segments:
        """Check a host table of pieces (anything ``torch.as_tensor`` takes, ``[n, 5]`` or ``[n, 6]``),
        cut it for the vector path, number its rows and move it.

        Pieces may be whole parameter pieces of any length: rows are split here, vector rows at
        ``BLOCK`` elements, scalar rows at ``SCALAR_BLOCK``.
        ``grad_across_allocations``: the gradient offsets span several allocations from one base
        pointer and the caller has checked each piece against its own allocation; launches then do
        not check them against the base tensor (``grad_extent`` is None).
        ``upload``: how the host table reaches the device (a callable taking and returning a tensor),
        for callers that must not block: ``.to(device)`` from pageable memory waits for the device.
        """
        host = pieces_table(pieces)
        if host.numel() and bool((host < 0).any()):
            bad = host[(host < 0).any(dim=1)][0].tolist()
            raise ValueError(f"segment row {bad} has a negative entry; columns are {PIECE_COLUMNS}")
        host = row_table(host)
        if host.shape[0]:
            ends = host[:, [0, 2, 3]] + host[:, 1:2]
            shard_extent, param_extent, computed_grad = (int(v) for v in ends.max(dim=0).values)
            n_params = int(host[:, 4].max()) + 1
        else:
            shard_extent = param_extent = computed_grad = n_params = 0
        rows = upload(host) if upload is not None else host.to(device)
        return Segments(rows, shard_extent, param_extent,
                        None if grad_across_allocations else computed_grad, n_params)

    def check(self, *, shard: int, param: int, grad: int, coefs: int) -> None:
        """Raise if a row would reach past the given buffer lengths (element counts)."""
        for name, extent, have in (
            ("state/master shard", self.shard_extent, shard),
            ("parameter buffer", self.param_extent, param),
            ("gradient buffer", self.grad_extent, grad),
            ("coefficient table rows", self.n_params, coefs),
        ):
            if extent is not None and extent > have:
                raise ValueError(
                    f"segment table reaches index {extent - 1} of the {name}, which has only "
                    f"{have} entries; rebuild the table for these buffers"
                )


def _split_long_rows(host: torch.Tensor) -> torch.Tensor:
    """Cut vector rows into pieces of at most BLOCK elements and scalar rows into pieces of at most
    SCALAR_BLOCK (vectorised; no Python loop per row), at a grid in each parameter's own element space.

    The cuts fall where ``elem`` is a multiple of the limit (SCALAR_BLOCK for scalar rows; BLOCK plus
    the row's phase ``elem % VEC`` for vector rows, so every piece stays aligned): counted from the
    parameter's element 0, not from the row's start. Two layouts of one parameter then cut it into
    the same rows wherever neither has a shard edge (or another piece boundary) and its vector phase is
    the same, and the 8-bit blocks, one per row, stay the same blocks: a reshard re-encodes only the
    blocks an edge cuts (fused_zero/pipeline/buckets/registry.py). A row gains at most one piece by it.
    """
    if host.shape[0] == 0:
        return host.contiguous()
    vector = host[:, VECTOR] == 1
    limit = torch.where(vector, BLOCK, SCALAR_BLOCK)
    elem = host[:, 5]
    into = (elem - torch.where(vector, elem % VEC, 0)) % limit  # the row's start within its grid cell
    if bool((into + host[:, 1] <= limit).all()):
        return host.contiguous()
    pieces = (into + host[:, 1] + limit - 1) // limit
    rep = torch.repeat_interleave(host, pieces, dim=0)
    rep_limit, rep_into = torch.repeat_interleave(limit, pieces), torch.repeat_interleave(into, pieces)
    first = torch.repeat_interleave(torch.cumsum(pieces, 0) - pieces, pieces)
    k = torch.arange(rep.shape[0]) - first  # index of the piece within its row
    shift = torch.clamp(k * rep_limit - rep_into, min=0)
    end = torch.minimum((k + 1) * rep_limit - rep_into, rep[:, 1])
    out = rep.clone()
    out[:, [0, 2, 3, 5]] += shift[:, None]
    out[:, 1] = end - shift
    return out.contiguous()
