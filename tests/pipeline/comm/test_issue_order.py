"""What each communicator runs, in the order it runs it, checked on the CPU in every overlap mode, flat
and in shard groups, with and without ``find_unused_parameters``.

A process group's NCCL communicator runs its collectives one after another, in issue order, each after
the stream that issued it. So a reduction issued after a collective that waits for an update (the
all-gather of an updated slice, the overflow / norm check's all-reduce) on the same communicator
starts only once that update has run; and one issued from a stream with an update queued on it starts
after that update. Either way the backward's communication serializes behind the updates
(``overlap="bucket"``: ``reduce_scatter(k+1)`` behind ``update(k)``).

Under the stream-order checker every reduction (the collectives reduction.py issues) is checked when
it is queued: its communication stream's clock must not cover an update or norm launch of the same
iteration. The clock covers exactly what NCCL makes the collective wait for (its stream's earlier
collectives, and what the issuing stream had queued).
"""

from __future__ import annotations

import itertools
import os
import sys
import traceback

import torch.distributed as dist
from distributed import run_ranks
from test_stream_order import train

from fused_zero.pipeline.comm import collectives
from fused_zero.testing.streamcheck import StreamChecker

REDUCTION = os.path.join("fused_zero", "pipeline", "reducing", "reduction.py")


def _reduction_line() -> str | None:
    """``reduction.py:LINE (function)`` where reduction.py issued the collective; else None."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(REDUCTION):
            return f"reduction.py:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return None


def _engine_line() -> str:
    frame = sys._getframe(2)
    while frame is not None and os.sep.join(("fused_zero", "pipeline")) not in frame.f_code.co_filename:
        frame = frame.f_back
    return "?" if frame is None else f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


class IssueOrder:
    """Wraps the checker's modeled collectives: every reduction queued behind an update is noted."""

    def __init__(self, checker: StreamChecker):
        self.checker = checker
        self.launches: list[tuple[int, int, str]] = []  # this iteration's (stream, clock, op)
        self.found: list[str] = []
        self.reductions = 0
        record = checker.record

        def noting(op, *args, **kwargs):  # the checker's own signature passed on whole (transfer=...)
            record(op, *args, **kwargs)
            if op in ("update kernel", "norm kernel"):
                s = checker.current
                self.launches.append((s, checker.clocks.vc[s][s], f"{op} at {_engine_line()}"))
        checker.record = noting
        for name in ("all_reduce", "reduce_scatter"):
            checker._patch(collectives, name, self._checked(name, getattr(collectives, name)))

    def _checked(self, name: str, modeled):
        def collective(*args, **kwargs):
            work = modeled(*args, **kwargs)
            line = _reduction_line()
            if line:
                self.reductions += 1
                group = kwargs.get("group", args[-1] if isinstance(args[-1], dist.ProcessGroup) else None)
                sid = self.checker._comm_stream(group)
                vc = self.checker.clocks.vc[sid]
                behind = [op for s, c, op in self.launches if vc.get(s, 0) >= c]
                if behind:
                    self.found.append(f"{self.checker.phase}: {name} at {line} is "
                                      f"queued on {self.checker.clocks.names[sid]} behind {behind[-1]}")
            return work
        return collective


def configs():
    """Every overlap mode x {flat, shard groups of 2}, each with both reductions, and with
    ``find_unused_parameters`` (the used flags' all-reduce) in one of the two."""
    out = []
    for overlap, shard, (reduce, unused) in itertools.product(
            ("bucket", "backward", "step"), (None, 2), (("reduce_scatter", True), ("all_reduce", False))):
        out.append(dict(overlap=overlap, grad_reduce=reduce, scaler=False, param_sync="forward",
                        find_unused=unused, shard=shard))
    return out


def check(rank, world, cfgs):
    failures = {}
    for cfg in cfgs:
        try:
            with StreamChecker() as checker:
                order = IssueOrder(checker)
                train(rank, cfg, _NewIteration(checker, order), steps=3)
            if not order.reductions:
                order.found.append("no reduction was seen")
            if order.found:
                failures[str(cfg)] = "\n".join(dict.fromkeys(order.found))
        except Exception:
            failures[str(cfg)] = traceback.format_exc()
    return failures


class _NewIteration:
    """The checker as ``train`` sees it: setting ``phase`` (once per iteration) starts a new iteration."""

    def __init__(self, checker, order):
        object.__setattr__(self, "_checker", checker)
        object.__setattr__(self, "_order", order)

    def __setattr__(self, name, value):
        if name == "phase":
            self._order.launches.clear()
        setattr(self._checker, name, value)

    def __getattr__(self, name):
        return getattr(self._checker, name)


def test_no_reduction_is_queued_behind_an_update():
    cfgs = configs()
    assert len(cfgs) == 12
    for rank, failures in enumerate(run_ranks(check, 4, cfgs)):
        assert not failures, f"rank {rank}, {len(failures)} of {len(cfgs)} configurations:\n" + "\n\n".join(
            f"{cfg}:\n{what}" for cfg, what in list(failures.items())[:4])
