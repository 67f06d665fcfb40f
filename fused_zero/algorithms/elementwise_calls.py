"""How an elementwise twin's step runs (algorithms/elementwise.py): one call of torch's update function per
param group over a launch's pieces, on the host's way (the CPU: the host reads the table and the skip
flag, torch.optim's non-capturable path, call for call) or on the device's (CUDA: the host reads nothing;
working copies, the counts as device tensors through torch's capturable or fused path, the results
written by ``torch.where`` where the flags allow). algorithms/elementwise.py's docstring says why each."""

from __future__ import annotations

import torch

from . import gradients
from .torch_ops import _Moments, working_weights

COLUMNS = ("active", "grad_div", "step")
"""The coefficient table's columns: the norm pass reads the first two (kernels.grad_sumsq), the update
all three (``step``: the count once this step counts, written on the device by ``fill_steps``)."""


def apply_on_host(algo, rows, coefs, args) -> None:
    """The host's way: the active pieces, one call per param group, torch.optim's non-capturable path."""
    if _skipped(args):
        return
    table = coefs.tolist()
    inv = gradients.inverse_scale(args.grad_scale) if args.grad_scale is not None else None
    master = args.state.get("master")
    calls: dict[int, _Call] = {}
    for so, n, po, go, pid in _runs(rows):
        coef = table[pid]
        if coef[0] == 0.0:
            continue
        call = _call(algo, calls, args, pid)
        hp = call.group
        first = coef[2] == 1.0
        p = working_weights(master, so, args.param, po, n)
        moments = _Moments(args, so, n, 0, 0)
        states = {}
        for name in algo._names:
            if not algo.group_has(name, hp):
                continue
            if first:  # made now, as torch makes it, in its storage format (Adagrad's start in bf16)
                moments.put(name, moments.get(name).fill_(algo.fresh(name, hp)))
            states[name] = moments.get(name)
        scalars = {name: algo.scalar(pid, name, hp, p.device).clone() for name in algo.spec.scalars}
        grad = gradients.gradient(args.grad[go:go + n], coef[1], inv, args.clip_coef)
        call.add(p, grad, states, scalars, torch.tensor(coef[2] - 1, dtype=torch.float32), (moments, states, po, p))
    for call in calls.values():
        call.run(algo.spec.function, algo.keywords(call.group))
        for moments, states, po, p in call.after:
            for name, value in states.items():
                moments.put(name, value)
            if master is not None or args.param.dtype != torch.float32:
                args.param[po:po + p.numel()].copy_(p)


def apply_on_device(algo, rows, coefs, args) -> None:
    """The device's way, where the host must not read the device: every piece runs, on working copies (the
    state made fresh where this is the parameter's first step), with its step count a device tensor;
    what is written back is the result where the parameter got a gradient and the step is not
    skipped, else what was there (``torch.where``: the very bits either way)."""
    runs = _runs(rows)
    if not runs:
        return
    keep = written(coefs, args.found_inf)
    first = coefs[:, COLUMNS.index("step")] == 1
    inv = gradients.inverse_scale(args.grad_scale) if args.grad_scale is not None else None
    master = args.state.get("master")
    steps = counts_before(coefs, [run[4] for run in runs])
    calls: dict[int, _Call] = {}
    for k, (so, n, po, go, pid) in enumerate(runs):
        call = _call(algo, calls, args, pid)
        hp = call.group
        scalars = _scalars_now(algo, pid, hp, first, coefs.device)  # a copy per piece, as the host's way
        held = working_weights(master, so, args.param, po, n)
        moments = _Moments(args, so, n, 0, 0)
        was, states = {}, {}
        for name in algo._names:
            if algo.group_has(name, hp):
                was[name] = moments.get(name)
                states[name] = torch.where(first[pid], algo.fresh(name, hp), was[name])
        grad = gradients.gradient(args.grad[go:go + n], float(args.grad_div[pid]), inv, args.clip_coef)
        call.add(held.clone(), grad, states, scalars, steps[k], (moments, was, states, po, held, pid))
    for call in calls.values():
        call.run(algo.spec.function, algo.keywords(call.group, device_counts=True))
        for (moments, was, states, po, held, pid), p in zip(call.after, call.params):
            ok = keep[pid]
            for name, value in states.items():
                moments.put(name, torch.where(ok, value, was[name], out=was[name]))
            torch.where(ok, p, held, out=held)
            if master is not None or args.param.dtype != torch.float32:
                piece = args.param[po:po + p.numel()]
                piece.copy_(torch.where(ok, held, piece))


def finish_on_host(algo, pids, table: torch.Tensor, args) -> None:
    """The host's way of ``ElementwiseAlgorithm.finish``: the active parameters' scalars advanced, unless
    the step was skipped."""
    if _skipped(args):
        return
    values = table.tolist()
    device = table.device
    calls: dict[int, _Call] = {}
    for pid in pids:
        coef = values[pid]
        if coef[0] == 0.0:
            continue
        call = _call(algo, calls, args, pid)
        states = {name: _empty(device) for name in algo._names if algo.group_has(name, call.group)}
        scalars = {name: algo.scalar(pid, name, call.group, device) for name in algo.spec.scalars}
        call.add(_empty(device), _empty(device), states, scalars, torch.tensor(coef[2] - 1, dtype=torch.float32),
                 None)
    for call in calls.values():
        call.run(algo.spec.function, algo.keywords(call.group))


def finish_on_device(algo, pids, table: torch.Tensor, args) -> None:
    """The device's way of ``ElementwiseAlgorithm.finish``: every parameter's scalars advance, in copies
    (made afresh at its first step), and ``torch.where`` keeps the old values of those not written."""
    pids = [int(pid) for pid in pids]
    if not pids:
        return
    device = table.device
    first = table[:, COLUMNS.index("step")] == 1
    steps = counts_before(table, pids)
    works = {name: [] for name in algo.spec.scalars}
    calls: dict[int, _Call] = {}
    for k, pid in enumerate(pids):
        call = _call(algo, calls, args, pid)
        states = {name: _empty(device) for name in algo._names if algo.group_has(name, call.group)}
        scalars = _scalars_now(algo, pid, call.group, first, device)
        for name, value in scalars.items():
            works[name].append(value)
        call.add(_empty(device), _empty(device), states, scalars, steps[k], None)
    for call in calls.values():
        call.run(algo.spec.function, algo.keywords(call.group, device_counts=True))
    keep = written(table, args.found_inf)
    ok = torch.stack([keep[pid] for pid in pids])
    for name, values in works.items():
        kept = [algo.scalars[name][pid] for pid in pids]
        torch._foreach_copy_(kept, list(torch.where(ok, torch.stack(values), torch.stack(kept)).unbind(0)))


def _scalars_now(algo, pid: int, group: dict, first: torch.Tensor, device) -> dict[str, torch.Tensor]:
    """Engine parameter ``pid``'s kept scalars as this step's function reads them, copies: made afresh
    (as torch makes them, from the group as it is now) where this is the parameter's first step
    (``first``, a device flag per parameter), else the kept values."""
    return {name: torch.where(first[pid], _lr(algo.spec.initial[name](group, algo.defaults)),
                              algo.scalar(pid, name, group, device))
            for name in algo.spec.scalars}


def _call(algo, calls: dict, args, pid: int) -> _Call:
    """The call of torch's function for engine parameter ``pid``'s param group (made at its first
    parameter), with the group's values as this step reads them."""
    g = int(args.group_of[pid])
    if g not in calls:
        calls[g] = _Call(algo, args.hparams[g])
    return calls[g]


def _skipped(args) -> bool:
    """Whether this step is skipped on every rank (some rank's gradients were not finite): a host read."""
    return args.found_inf is not None and float(args.found_inf) != 0.0


def written(table: torch.Tensor, found_inf: torch.Tensor | None) -> torch.Tensor:
    """Per engine parameter, on the device: whether its update is written this step (it got a gradient,
    column ``active``, and the step is not skipped on every rank)."""
    keep = table[:, COLUMNS.index("active")] != 0
    return keep if found_inf is None else keep & (found_inf == 0)


def counts_before(table: torch.Tensor, pids: list[int]) -> tuple[torch.Tensor, ...]:
    """The step count of each of ``pids`` before this step, a float32 device tensor each (the function
    adds one to it in place: views of one new tensor, apart), from the table's ``step`` column."""
    column = COLUMNS.index("step")
    return torch.stack([table[pid, column] for pid in pids]).sub_(1).unbind(0)


def _lr(value) -> float:
    """A param group's number (a tensor ``lr`` read as torch.optim reads it)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else value


def _empty(device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=device)


class _Call:
    """One call of torch's function over the pieces of one param group."""

    def __init__(self, algo, group: dict):
        self.algo, self.group = algo, group
        self.params, self.grads = [], []
        self.lists = {arg: [] for arg in algo.spec.lists}
        self.after = []  # what to store back once the function ran: (moments, states, param offset, piece)

    def add(self, p, grad, states: dict, scalars: dict, step_before: torch.Tensor, after) -> None:
        """``step_before``: the parameter's count before this step, a tensor of its own (the function adds
        one to it in place)."""
        self.params.append(p)
        self.grads.append(grad)
        for arg, name in self.algo.spec.lists.items():
            if name == "step":
                self.lists[arg].append(step_before)
            elif name in scalars:
                self.lists[arg].append(scalars[name])
            elif name in states:
                self.lists[arg].append(states[name])
        if after is not None:
            self.after.append(after)

    def run(self, function, keywords: dict) -> None:
        if self.params:
            function(self.params, self.grads, **self.lists, **keywords)


def _runs(rows):
    """``(so, n, po, go, pid)``: the rows, a parameter's adjacent pieces merged (its piece of the rank's
    slice and of the replicated tail sit back to back in every buffer). Pieces of one parameter could
    also go apart: each reads the step and a copy of the scalars as they were before the step."""
    runs = []
    for so, n, po, go, pid, *_ in rows:
        if runs:
            rso, rn, rpo, rgo, rpid = runs[-1]
            if pid == rpid and so == rso + rn and po == rpo + rn and go == rgo + rn:
                runs[-1] = (rso, rn + n, rpo, rgo, rpid)
                continue
        runs.append((so, n, po, go, pid))
    return runs


__all__ = ["COLUMNS", "counts_before", "finish_on_device", "finish_on_host", "apply_on_device", "apply_on_host",
           "written"]
