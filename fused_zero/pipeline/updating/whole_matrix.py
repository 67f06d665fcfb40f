"""Updates that need each matrix whole (Muon's Newton-Schulz), over state sharded by element slices.

A bucket is cut into equal slices (layout.py), so most matrices straddle ranks. Each matrix gets one
*owner* in its shard group, chosen once from the shapes alone (longest-processing-time first over the
Newton-Schulz cost, ``m n min(m, n)``): the same on every rank, whatever the buckets. A step is five
phases, every one of them issued on every rank of the shard group in the same order:

1. each rank advances the momentum of its pieces (its slice of each matrix, and the replicated tail)
   and casts Newton-Schulz's input to bf16, as torch does before its first op;
2. one ``all_to_all`` brings every slice piece to its matrix's owner (the owner holds the tail itself);
3. each owner orthogonalizes its matrices, assembled in the parameters' own memory order;
4. one ``all_to_all`` sends every rank the result for its pieces (the tail to every rank);
5. each rank applies the weight decay and the step to its pieces, and the usual all-gather follows.

So each matrix's Newton-Schulz runs once per shard group and step, the momentum stays 1/S per rank,
and the exchange moves each slice element twice in bf16 (4 bytes) beyond ZeRO-1's reduce-scatter and
all-gather (docs/design-optimizers.md, "Muon, sharded", weighs the alternatives). A step whose gradients are not finite
changes nothing (the skip flag is the same on every rank); a parameter with no gradient this step is
skipped, as torch skips ``p.grad is None``.

Both flags stay on the device: the host never reads them, so the phases can run inside DDP's comm hook
(overlap="bucket") without making the backward wait for the device. Every phase runs for every matrix
of the buckets, whatever the flags (the exchange's sizes are the host's), and the two writes, the
momentum and the parameter, take the new value only where the matrix's flags allow it
(``torch.where``: the same bits as the update in place). A skipped step, or a matrix without a gradient
(``find_unused_parameters``), costs its exchange and its Newton-Schulz all the same.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import torch

from ...algorithms import gradients, muon
from ..buckets.layout import REPLICATED
from ..buckets.strides import strided_view
from ..comm import collectives
from ..comm.profiling import range_push

if TYPE_CHECKING:
    from ..buckets.param_table import ParamTable


def owners(shapes: list[tuple[int, int]], world: int) -> list[int]:
    """The owning rank of each matrix: longest processing time first by Newton-Schulz FLOPs (costliest
    first, to the least loaded rank, lower rank on ties), a balance within 4/3 of the best possible.
    bench/muon_scale_model.py tables it for real models up to W=8192."""
    cost = [muon.ns_flops(shape, 1) for shape in shapes]
    order = sorted(range(len(shapes)), key=lambda i: (-cost[i], i))
    loads = [(0, r) for r in range(world)]
    out = [0] * len(shapes)
    for i in order:
        load, r = heapq.heappop(loads)
        out[i] = r
        heapq.heappush(loads, (load + cost[i], r))
    return out


class WholeMatrix:
    """One phased member's step over the buckets the pipeline hands it."""

    def __init__(self, parameters: ParamTable, reduction, member, group):
        """``parameters``: the engine's parameter table (buckets/param_table.py); ``reduction``: the stage that
        reduced the gradients in the shard group (reducing/reduction.py: its topology, divisors and
        device); ``group``: the process group of the phases' collectives (updates.py)."""
        self.member, self.group = member, group
        self.params, self.group_of = parameters.tensors, parameters.group_of
        self.grad_div, self.device = reduction.grad_div, reduction.device
        world = reduction.topology.shard_size
        self.rank = reduction.topology.shard_rank
        pids = [int(p) for p in member.pids]
        shapes = [tuple(self.params[p].shape) for p in pids]
        self.owner = dict(zip(pids, owners(shapes, world)))
        self.world = world
        self.ns_flops = 0  # this rank's Newton-Schulz matmul FLOPs so far (bench/, tests)

    def step(self, iteration, items, tables: list[torch.Tensor], units, args: dict) -> None:
        """The member's update of ``items``; ``tables``: its coefficient table for each item (their
        column 0: which parameters got a gradient); ``units``: its launches of them on this rank (one
        per part: the rows of this rank's region)."""
        found = args.get("found_inf")
        mats = self._matrices(items, tables, found)
        live = {pid for pid, _, _ in mats}
        rows = {}  # pid -> [(unit, row)] in element order
        for unit in units:
            for row in unit.rows:
                if row[4] in live:
                    rows.setdefault(row[4], []).append((unit, row))
        hp = iteration.hparams[self.member.index]
        with range_push("fused_zero.muon"):
            inputs, sends = self._momentum(mats, rows, hp, args)
            incoming = self._incoming(mats)
            sizes = [0] * self.world
            for src, _, a, b in incoming:
                sizes[src] += b - a
            self._receive(incoming, inputs, self._exchange(sends, sizes))
            results = self._orthogonalize(mats, inputs, hp)
            back = self._exchange(self._results_out(mats, results), self._back_sizes(mats))
            self._apply(mats, rows, results, back, hp)

    def _matrices(self, items, tables: list[torch.Tensor], found: torch.Tensor | None) -> list[tuple]:
        """``(pid, layout, local)`` of every matrix of ``items``, in bucket order (every rank's order,
        whatever its region holds); ``self.ok[pid]``: whether its update is written (a device flag: the
        step is not skipped, and the matrix got a gradient, column 0 of its bucket's table)."""
        out, self.ok = [], {}
        for item, table in zip(items, tables):
            lay = item.shard.layout
            for local in sorted(range(len(lay.pids)), key=lay.offsets.__getitem__):
                pid = lay.pids[local]
                if item.shard.members[local] == self.member.index:
                    out.append((pid, lay, local))
                    active = table[pid:pid + 1, 0] != 0
                    self.ok[pid] = active if found is None else active & (found == 0)
        return out

    def _momentum(self, mats, rows, hp, args) -> tuple[dict, list]:
        """Phase 1: the momentum of this rank's pieces; the owner's own pieces go into its inputs
        (flat bf16, the parameter's memory order), the others' slice pieces to their owners."""
        grad_scale = args.get("grad_scale")
        inv = gradients.inverse_scale(grad_scale) if grad_scale is not None else None
        group_of = self.group_of
        inputs = {pid: torch.empty(self.params[pid].numel(), dtype=torch.bfloat16, device=self.device)
                  for pid, _, _ in mats if self.owner[pid] == self.rank}
        sends = [[] for _ in range(self.world)]
        for pid, lay, _ in mats:
            g = hp[group_of[pid]]
            for unit, (so, n, _, go, _, elem) in rows.get(pid, ()):
                grad = gradients.gradient(unit.grad[go:go + n], float(self.grad_div[pid]), inv, args.get("clip_coef"))
                piece = muon.momentum_update(grad, unit.state["momentum_buffer"][so:so + n], g["momentum"],
                                             g["nesterov"], self.ok[pid])
                if self.owner[pid] == self.rank:
                    inputs[pid][elem:elem + n] = piece
                elif go < lay.head:
                    sends[self.owner[pid]].append(piece)
        return inputs, sends

    def _incoming(self, mats) -> list[tuple[int, int, int, int]]:
        """``(src, pid, a, b)``: the slice runs of this rank's own matrices that the other ranks send it in
        phase 2, in matrix then element order: each source's send order."""
        return [(who, pid, a, b) for pid, lay, local in mats if self.owner[pid] == self.rank
                for a, b, who, _ in lay.owners(local, self.rank) if who not in (self.rank, REPLICATED)]

    def _receive(self, incoming, inputs, recv: list[torch.Tensor]) -> None:
        at = [0] * self.world
        for src, pid, a, b in incoming:
            inputs[pid][a:b] = recv[src][at[src]:at[src] + b - a]
            at[src] += b - a

    def _orthogonalize(self, mats, inputs, hp) -> dict:
        """Phase 3: Newton-Schulz of each owned matrix, in its parameter's shape and strides; the
        result flat in the same memory order."""
        out, flops = {}, 0
        for pid, _, _ in mats:
            if self.owner[pid] != self.rank:
                continue
            p, g = self.params[pid], hp[self.group_of[pid]]
            ortho = muon.newton_schulz(strided_view(inputs[pid], p), g["ns_coefficients"], int(g["ns_steps"]),
                                       g["eps"])
            flat = torch.empty(p.numel(), dtype=torch.bfloat16, device=self.device)
            strided_view(flat, p).copy_(ortho)
            out[pid] = flat
            flops += muon.ns_flops(p.shape, int(g["ns_steps"]))
        self.ns_flops += flops
        return out

    def _results_out(self, mats, results) -> list:
        """Phase 4's sends: each rank's slice pieces of this owner's results, and the tail's to every rank."""
        sends = [[] for _ in range(self.world)]
        for pid, lay, local in mats:
            if self.owner[pid] == self.rank:
                for a, b, who, _ in lay.owners(local, self.rank):
                    for dst in range(self.world) if who == REPLICATED else (who,):
                        if dst != self.rank:
                            sends[dst].append(results[pid][a:b])
        return sends

    def _back_sizes(self, mats) -> list[int]:
        """Elements each owner sends this rank in phase 4: its pieces (slice and tail) of their matrices."""
        sizes = [0] * self.world
        for pid, lay, local in mats:
            if self.owner[pid] != self.rank:
                sizes[self.owner[pid]] += sum(b - a for a, b, who, _ in lay.owners(local, self.rank)
                                              if who in (self.rank, REPLICATED))
        return sizes

    def _apply(self, mats, rows, results, back, hp) -> None:
        """Phase 5: weight decay and step on this rank's pieces, the masters' pieces rounded into the
        parameters. A matrix's pieces are this rank's rows of it, in element order: the order of its
        runs the owner sent."""
        at = [0] * self.world
        for pid, _, _ in mats:
            owner = self.owner[pid]
            g = hp[self.group_of[pid]]
            step_lr = muon.adjusted_lr(g["lr"], g["adjust_lr_fn"], self.params[pid].shape)
            for unit, (so, n, po, _, _, elem) in rows.get(pid, ()):
                if owner == self.rank:
                    ortho = results[pid][elem:elem + n]
                else:
                    ortho = back[owner][at[owner]:at[owner] + n]
                    at[owner] += n
                master = unit.state.get("master")
                target = master[so:so + n] if master is not None else unit.param[po:po + n]
                muon.apply(target, ortho, g["lr"], g["weight_decay"], step_lr, self.ok[pid])
                if master is not None:
                    unit.param[po:po + n].copy_(target)

    def _exchange(self, sends: list[list[torch.Tensor]], in_sizes: list[int]) -> list[torch.Tensor]:
        """One all_to_all of bf16 pieces over the shard group (moved as bytes: gloo has no 16-bit
        all_to_all); returns what came from each rank."""
        if self.world == 1:
            return [torch.empty(0, dtype=torch.bfloat16, device=self.device)]
        out_sizes = [sum(t.numel() for t in pieces) for pieces in sends]
        flat = [t for pieces in sends for t in pieces]
        send = torch.cat(flat) if flat else torch.empty(0, dtype=torch.bfloat16, device=self.device)
        recv = torch.empty(sum(in_sizes), dtype=torch.bfloat16, device=self.device)
        collectives.all_to_all_single(recv.view(torch.uint8), send.view(torch.uint8), [2 * k for k in in_sizes],
                                      [2 * k for k in out_sizes], self.group)
        return list(recv.split(in_sizes))
