"""One DDP bucket as this rank holds it: the flat parameter buffer the bucket's parameters are views
of, this rank's region of optimizer state, the kernel rows, and the handle of the all-gather that
brings the updated parameters back. The gradient is not ours: the reduction runs in place in DDP's
bucket buffer and the kernels read it there."""

from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.distributed as dist

from ..kernels import Segments, row_table
from ..update.formats import DTYPES, store_values, values
from .layout import BucketLayout
from .strides import strided_view


class BucketShard:
    """Attributes:
        layout: the bucket's BucketLayout (offsets, slices, rows).
        params: the bucket's parameters, in bucket order; ``pids`` their optimizer indices (numpy).
        all_active: read-only all-True flags, one per parameter (a bucket where every parameter got a
            gradient, without a new array per bucket and step).
        param_buffer: flat, ``layout.numel`` elements of the parameters' dtype; each parameter's
            ``.data`` is a view of it, so the all-gather writes parameters in place.
        state: region-shaped tensors, one per state name, in the moments' storage format
            (update/formats.py), and fp32 ``"master"`` with master weights.
        scales: 8-bit moments' fp32 scales, one per row of the kernel table (``table``); else empty.
        rows: host kernel pieces; ``table`` their host row table (kernels.row_table); ``segments`` the
            same on the device (Triton backend only).
        norm_rows / norm_segments: the rows whose gradients count towards the global norm and the
            non-finite count: each element once over DDP's group, so the slice on the first replica only
            and the replicated tail on one rank (``counts``, from pipeline/topology.py).
        gather: the pending all-gather's Work, or None.
        reduced_buffer: this iteration's reduced gradient, from the reduction to the update: DDP's buffer,
            or its copy in ``grad_reduce_dtype`` (indexed like the bucket either way).
    """

    def __init__(self, layout: BucketLayout, params: list[torch.nn.Parameter], *, state_names: list[str],
                 master: bool, device: torch.device, dtype: torch.dtype, state_format: str = "fp32",
                 upload=None, counts: tuple[bool, bool] | None = None):
        self.layout = layout
        self.params = params
        self.pids = np.asarray(layout.pids)  # indexes the optimizer's per-parameter host arrays
        self.all_active = np.ones(len(self.pids), dtype=bool)  # shared, read-only: every parameter active
        self.all_active.flags.writeable = False
        self.param_buffer = torch.zeros(layout.numel, dtype=dtype, device=device)
        moments = DTYPES[state_format]
        self.state = {name: torch.zeros(layout.region_size, dtype=moments, device=device) for name in state_names}
        if master:
            self.state["master"] = torch.zeros(layout.region_size, dtype=torch.float32, device=device)
        # the kernels index the optimizer-wide coefficient table: the row's pid is the global one
        self.rows = [(so, n, po, go, layout.pids[local], elem)
                     for so, n, po, go, local, elem in layout.rows()]
        self.table = row_table(self.rows)
        self.scales = {name: torch.zeros(self.table.shape[0], dtype=torch.float32, device=device)
                       for name in state_names} if moments == torch.uint8 else {}
        counts_slice, counts_tail = counts if counts is not None else (True, layout.rank == 0)
        tail_at = layout.region_tail(layout.rank)[0]
        self.norm_rows = [r for r in self.rows if (counts_slice if r[0] < tail_at else counts_tail)]
        self.segments = Segments.build(self.rows, upload=upload) if upload is not None else None
        self.norm_segments = Segments.build(self.norm_rows, upload=upload) if upload is not None else None
        self.gather: dist.Work | None = None
        self._completed: tuple | None = None  # (weak reference to DDP's buffer, completed Future of it)
        self.reduced_buffer: torch.Tensor | None = None  # kept until the step has run

    def bind_params(self) -> None:
        """Copy the parameters' current values into the flat buffer and make them views of it, each
        with its own strides (strides.py: the bucket holds its gradient in that memory order)."""
        for p, off, n in zip(self.params, self.layout.offsets, self.layout.numels):
            view = strided_view(self.param_buffer[off:off + n], p.data)
            view.copy_(p.data)
            p.data = view

    def relocate(self, state: dict[str, torch.Tensor], scales: dict[str, torch.Tensor],
                 param_buffer: torch.Tensor) -> None:
        """Move the state, the scales and the parameter buffer into the given tensors (views of an
        arena, see arena.py), values included, and make the parameters views of the new buffer. No
        gather or update of this shard may be pending."""
        for name, view in state.items():
            view.copy_(self.state[name])
        for name, view in scales.items():
            view.copy_(self.scales[name])
        self.state, self.scales = state, scales
        self.param_buffer = param_buffer
        self.bind_params()

    def init_master_from_params(self) -> None:
        master = self.state.get("master")
        if master is None:
            return
        for so, n, po, *_ in self.layout.rows():
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

    def wait_gather(self) -> None:
        """Make the caller wait for the all-gather (a stream wait with NCCL, a host wait with gloo)."""
        work, self.gather = self.gather, None
        if work is not None:
            work.wait()

    def values(self, name: str) -> torch.Tensor:
        """One state tensor's region decoded to fp32 (the tensor itself when stored in fp32)."""
        return values(self.state[name], self.scales.get(name), self.table, name)

    def store_values(self, name: str, x: torch.Tensor) -> None:
        """Encode fp32 region values ``x`` into one state tensor, as an update would."""
        store_values(self.state[name], self.scales.get(name), self.table, name, x)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.state.values(), *self.scales.values()))
