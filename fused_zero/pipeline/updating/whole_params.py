"""Updates that need each parameter whole on every rank (Adafactor's rows, columns and norms:
algorithms/adafactor.py), over gradients and masters sharded by element slices.

For each bucket holding parameters of the member, in bucket order, on every rank of the shard group:

1. the reduced gradient, whole: the bucket's buffer as it is where one all-reduce reduced it
   (``grad_reduce="all_reduce"``, and gloo's plan for a reduce-scatter: reduction.one_all_reduce), else
   one all-gather of the ranks' reduced slices (the tail is reduced on every rank already);
2. the fp32 weights, whole: the parameters themselves when they are fp32, else one all-gather of the
   ranks' fp32 master slices (the tail is every rank's);
3. torch's update over the member's parameters of the bucket, one call per param group, on every rank
   alike (the same inputs, the same ops, the same results);
4. each rank writes its pieces of the masters and the parameters; the usual all-gather follows.

Collectives are issued by every rank in the same order whatever its flags; a skipped step or a
parameter without a gradient is then not updated, on every rank. On the CPU the host reads the flags and
the counts and runs torch's function; where the device runs later (CUDA) the host reads nothing: every
parameter of the member is updated in copies, with the counts on the device (algorithms/adafactor.py's
``device_step``), and ``torch.where`` writes the results where the flags allow (as algorithms/elementwise.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...algorithms import gradients
from ...algorithms.elementwise_calls import COLUMNS, written
from ...algorithms.torch_ops import working_weights
from ..buckets.strides import strided_view
from ..comm import collectives
from ..comm.profiling import range_push

if TYPE_CHECKING:
    from ..buckets.param_table import ParamTable


class WholeParams:
    """One member's whole-parameter step over the buckets the pipeline hands it (updates.py)."""

    def __init__(self, parameters: ParamTable, reduction, member, group):
        """``parameters``: the engine's parameter table (buckets/param_table.py); ``reduction``: the stage that
        reduced the gradients (reducing/reduction.py: its divisors, and whether one all-reduce left each
        bucket whole); ``group``: the process group of the all-gathers (updates.py)."""
        self.member, self.group = member, group
        self.params, self.group_of = parameters.tensors, parameters.group_of
        self.grad_div, self.one_all_reduce = reduction.grad_div, reduction.one_all_reduce

    def step(self, iteration, items, tables: list[torch.Tensor], units, args: dict) -> None:
        """The member's update of ``items``; ``tables``: its coefficient table for each item (columns
        ``active``, ``grad_div``, ``step``: algorithms/elementwise.COLUMNS); ``units``: its launches on this
        rank (the rows of its region, for the masters' write-back)."""
        m = self.member.index
        found = args.get("found_inf")
        on_device = bool(args.get("asynchronous"))
        skip = not on_device and found is not None and float(found) != 0.0
        inv = gradients.inverse_scale(args["grad_scale"]) if args.get("grad_scale") is not None else None
        hp = iteration.hparams[m]
        rows: dict[int, list] = {}
        for unit in units:
            for row in unit.rows:
                rows.setdefault(row[4], []).append((unit, row))
        with range_push("fused_zero.whole_params"):
            for item, table in zip(items, tables):
                shard = item.shard
                mine = [local for local in range(len(shard.layout.pids)) if shard.members[local] == m]
                if mine and on_device:
                    self._bucket_on_device(shard, mine, table, found, inv, args.get("clip_coef"), hp, rows)
                elif mine:
                    self._bucket(shard, mine, table.tolist(), skip, inv, args.get("clip_coef"), hp, rows)

    def _bucket(self, shard, mine: list[int], table: list, skip: bool, inv, clip, hp: list[dict], rows) -> None:
        algo = self.member.algo
        lay = shard.layout
        grads = self._whole(shard.reduced_buffer, lay, reduced=self.one_all_reduce)
        masters = None
        if "master" in shard.names:
            region = shard.values("master")
            masters = self._whole_region(region, lay)
        calls: dict[int, tuple] = {}
        for local in mine:
            pid = lay.pids[local]
            coef = table[pid]
            if skip or coef[0] == 0.0:
                continue
            p, off, n = self.params[pid], lay.offsets[local], lay.numels[local]
            grad = gradients.gradient(grads[off:off + n], coef[1], inv, clip)
            weight = working_weights(masters, off, shard.param_buffer, off, n)  # both bucket-indexed
            call = calls.setdefault(int(self.group_of[pid]), ([], [], [], [], []))
            for out, value in zip(call, (strided_view(weight, p), strided_view(grad, p), pid, coef[2] - 1,
                                         (weight, off, n))):
                out.append(value)
        for g, (params, grads_, pids, steps, where) in calls.items():
            algo.step(params, grads_, pids, steps, hp[g])
            for pid, (weight, off, n) in zip(pids, where):
                if weight.data_ptr() != shard.param_buffer[off:off + n].data_ptr():
                    shard.param_buffer[off:off + n].copy_(weight)  # rounded to the parameters' dtype
                for unit, (so, length, _, _, _, elem) in rows.get(pid, ()):
                    master = unit.state.get("master")
                    if master is not None:
                        master[so:so + length].copy_(weight[elem:elem + length])

    def _bucket_on_device(self, shard, mine: list[int], table: torch.Tensor, found, inv, clip, hp: list[dict],
                          rows) -> None:
        """``_bucket`` where the host must not read the device (module docstring)."""
        algo = self.member.algo
        lay = shard.layout
        grads = self._whole(shard.reduced_buffer, lay, reduced=self.one_all_reduce)
        masters = self._whole_region(shard.values("master"), lay) if "master" in shard.names else None
        keep = written(table, found)
        after = table[:, COLUMNS.index("step")]
        calls: dict[int, tuple] = {}
        for local in mine:
            pid = lay.pids[local]
            p, off, n = self.params[pid], lay.offsets[local], lay.numels[local]
            grad = gradients.gradient(grads[off:off + n], float(self.grad_div[pid]), inv, clip)
            held = working_weights(masters, off, shard.param_buffer, off, n)  # both bucket-indexed
            weight = held.clone()
            call = calls.setdefault(int(self.group_of[pid]), ([], [], [], [], [], []))
            for out, value in zip(call, (strided_view(weight, p), strided_view(grad, p), pid, after[pid], keep[pid],
                                         (held, weight, off, n))):
                out.append(value)
        for g, (params, grads_, pids, steps, oks, where) in calls.items():
            algo.step_on_device(params, grads_, pids, steps, oks, hp[g])
            for pid, ok, (held, weight, off, n) in zip(pids, oks, where):
                torch.where(ok, weight, held, out=held)
                piece = shard.param_buffer[off:off + n]
                if held.data_ptr() != piece.data_ptr():
                    piece.copy_(torch.where(ok, held, piece))  # rounded to the parameters' dtype
                for unit, (so, length, _, _, _, elem) in rows.get(pid, ()):
                    master = unit.state.get("master")
                    if master is not None:
                        master[so:so + length].copy_(held[elem:elem + length])

    def _whole(self, buffer: torch.Tensor, lay, reduced: bool) -> torch.Tensor:
        """The bucket's reduced gradient on every rank: ``buffer`` where it is reduced whole, else its
        slices all-gathered (the tail is reduced everywhere)."""
        if reduced or lay.world_size == 1 or lay.shard == 0:
            return buffer
        whole = torch.empty(lay.numel, dtype=buffer.dtype, device=buffer.device)
        lo = lay.rank * lay.shard
        collectives.all_gather(whole[:lay.head], buffer[lo:lo + lay.shard], self.group, async_op=False)
        whole[lay.head:].copy_(buffer[lay.head:lay.numel])
        return whole

    def _whole_region(self, region: torch.Tensor, lay) -> torch.Tensor:
        """A region-shaped fp32 state (the masters) of the whole bucket, in bucket order, on every rank."""
        whole = torch.empty(lay.numel, dtype=region.dtype, device=region.device)
        lo, hi = lay.region_slice(lay.rank)
        if lay.shard:
            if lay.world_size == 1:
                whole[:lay.head].copy_(region[lo:hi])
            else:
                collectives.all_gather(whole[:lay.head], region[lo:hi].contiguous(), self.group, async_op=False)
        a, b = lay.region_tail(lay.rank)
        whole[lay.head:].copy_(region[a:b])
        return whole
