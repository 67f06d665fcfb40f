"""The per-program table every kernel in this package reads.

A flat *shard* (optimizer state and reduced gradients) and a flat *parameter* buffer hold many
parameters back to back, with padding the kernels must never touch. A `Segments` table says which
elements are real: one row per program, each row a run of at most ``BLOCK`` contiguous elements of
one parameter:

    (shard_off, length, param_off, grad_off, pid)

``shard_off`` indexes the fp32 state (master weights, moments), ``param_off`` the parameter buffer,
``grad_off`` the gradient buffer and ``pid`` the row of the per-parameter coefficient table. The three
offsets are separate because the three buffers need not share an origin: the state of one rank covers
every bucket back to back, while the parameter and gradient buffers may be per-bucket, full-size
allocations owned by someone else.

The table is built and checked once on the host; launches only compare its precomputed extents with
the lengths of the tensors they are given, so a bad table is an exception at build or launch time,
never an out-of-bounds access and never a device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 2048
"""Elements per program. 2048 x fp32 with 8 warps is 8 elements (two 16-byte vectors) per thread."""

COLUMNS = ("shard_off", "length", "param_off", "grad_off", "pid")


@dataclass(frozen=True)
class Segments:
    """A validated row table, on the device the kernels run on.

    Attributes:
        rows: int64 tensor ``[n_rows, 5]`` on the kernel device (columns in ``COLUMNS``).
        shard_extent: one past the largest shard index a row touches (0 for no rows).
        param_extent: same for the parameter buffer.
        grad_extent: same for the gradient buffer.
        n_params: one past the largest ``pid`` (rows of the coefficient table needed).
    """

    rows: torch.Tensor
    shard_extent: int
    param_extent: int
    grad_extent: int
    n_params: int

    @property
    def n_rows(self) -> int:
        return self.rows.shape[0]

    @staticmethod
    def build(rows, device: torch.device | str = "cpu") -> Segments:
        """Check a host table (anything ``torch.as_tensor`` takes, shape ``[n, 5]``) and move it.

        Rows longer than ``BLOCK`` are split here, so callers may pass whole parameter pieces.
        """
        host = torch.as_tensor(rows, dtype=torch.int64, device="cpu").reshape(-1, len(COLUMNS))
        if host.numel() and bool((host < 0).any()):
            bad = host[(host < 0).any(dim=1)][0].tolist()
            raise ValueError(f"segment row {bad} has a negative entry; columns are {COLUMNS}")
        host = host[host[:, 1] > 0]
        host = _split_long_rows(host)
        if host.shape[0]:
            ends = host[:, [0, 2, 3]] + host[:, 1:2]
            shard_extent, param_extent, grad_extent = (int(v) for v in ends.max(dim=0).values)
            n_params = int(host[:, 4].max()) + 1
        else:
            shard_extent = param_extent = grad_extent = n_params = 0
        return Segments(host.to(device), shard_extent, param_extent, grad_extent, n_params)

    def check(self, *, shard: int, param: int, grad: int, coefs: int) -> None:
        """Raise if a row would reach past the given buffer lengths (element counts)."""
        for name, extent, have in (
            ("state/master shard", self.shard_extent, shard),
            ("parameter buffer", self.param_extent, param),
            ("gradient buffer", self.grad_extent, grad),
            ("coefficient table rows", self.n_params, coefs),
        ):
            if extent > have:
                raise ValueError(
                    f"segment table reaches index {extent - 1} of the {name}, which has only "
                    f"{have} entries; rebuild the table for these buffers"
                )


def _split_long_rows(host: torch.Tensor) -> torch.Tensor:
    """Cut rows into pieces of at most BLOCK elements (vectorised; no Python loop per row)."""
    if host.shape[0] == 0 or int(host[:, 1].max()) <= BLOCK:
        return host.contiguous()
    pieces = (host[:, 1] + BLOCK - 1) // BLOCK
    rep = torch.repeat_interleave(host, pieces, dim=0)
    first = torch.repeat_interleave(torch.cumsum(pieces, 0) - pieces, pieces)
    k = torch.arange(rep.shape[0]) - first  # index of the piece within its row
    shift = k * BLOCK
    out = rep.clone()
    out[:, 0] += shift
    out[:, 2] += shift
    out[:, 3] += shift
    out[:, 1] = torch.clamp(rep[:, 1] - shift, max=BLOCK)
    return out.contiguous()
