"""``capturable=True``: ``step()``'s device work captured once in a CUDA graph, then replayed.

With ``overlap="step"`` the updates run in ``step()``. What the host does there per step is mostly
launching: the step columns, the non-finite / norm check and its all-reduce, the counts, one update
per dtype and format, one all-gather per bucket. A CUDA graph replays all of it in one launch.

What stays on the host, every step (``Updates._update``): the waits for the reductions and the previous
gathers (a capture may not wait for work queued outside it), the coefficient tables' host columns and
``-lr`` copied into tensors kept across steps (Scratch, ``kept=True``), so that a scheduler's lr, or any
param-group value, takes effect on the next replay with no recapture, the counts' host bound, and,
after the replay, the skip count and the GradScaler's flags.

What the graph holds: everything ``Updates._device_work`` queues. It reads device memory only, writes
only tensors that outlive it, makes no host synchronization and allocates nothing (the stream-order
checker's capture model, testing/streamcheck/graphs.py, reports any of these on the CPU). Its gathers are
joined inside it: the forward then waits for the side stream, not for each bucket.

Whose: the members built with ``capturable=True`` (AdamW, Adam: the fused kernel, its tables and checks
in tensors kept across steps). The other optimizers over the same DDP module (SGD, Muon, torch.optim's
twins, Adafactor: torch ops that make new tensors every step, which a graph would hold in a pool of its
own) step eagerly beside them, each ``step()`` its own, with no host synchronization either
(algorithms/elementwise.py).

When: the device work of a step is described by its *key*: every tensor it reads or writes (address,
shape, dtype), every Python value it bakes into a launch (``max_norm``, an edit's flag), every layout
object. A step whose key is the graph's replays it. Otherwise the step runs eagerly, and the next step
with the same key captures (the eager run made every kept tensor, so the capture allocates nothing).
Keys change with DDP's bucket rebuild, the arenas' packing, a bias table's growth and a GradScaler
stepped without ``unscale_`` after steps with it: a few captures per run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..comm.profiling import range_push
from ..updating.launches import identity

if TYPE_CHECKING:
    from ...options import ShardingOptions


class StepGraph:
    """The graphs of one engine's steps: one per member (each optimizer's ``step()`` is its own device
    work, pipeline/updating/updates.py), each captured and replayed on its own key.

    Attributes:
        captures, replays: how many times a graph was captured, replayed, over every member (read by
            tests and benches).
    """

    def __init__(self, side):
        self.side = side
        self._graphs: dict[int, _Graph] = {}
        self.captures = self.replays = 0

    def run(self, member: int, objects: tuple, work) -> None:
        """Queue ``work()``'s device work (``member``'s step) on the side stream: by replaying the graph
        captured from an earlier ``work`` of the same key, by capturing it now (then replaying), or
        eagerly."""
        g = self._graphs.setdefault(member, _Graph())
        key = identity(objects)
        if g.graph is not None and key == g.key:
            self._replay(g)
            return
        if key != g.seen:
            g.graph, g.key, g.seen, g.kept = None, None, key, objects
            with range_push("fused_zero.step_eager"):
                work()
            return
        graph = self.side.api.graph()
        with range_push("fused_zero.step_capture"), graph.capture(self.side.stream):
            work()
        g.graph, g.key, g.kept = graph, key, objects
        self.captures += 1
        self._replay(g)

    def _replay(self, g: _Graph) -> None:
        with range_push("fused_zero.step_replay"), self.side.run(follow_current=False):
            g.graph.replay()
        self.replays += 1


class _Graph:
    """One member's graph: the captured work's key, the last eager work's (to capture the next step that
    matches it), and the objects whose ids the key holds (kept alive with the graph)."""

    def __init__(self):
        self.graph = self.key = self.seen = self.kept = None


def check_capturable(options: ShardingOptions, side, ddp) -> None:
    """Refuse, at construction, what a graph of ``step()``'s device work cannot hold, naming the option
    (``side``: the side stream the graph would capture, comm/streams.py)."""
    why = []
    if options.overlap != "step":
        why.append(f'overlap={options.overlap!r}: the updates run inside the backward (DDP\'s comm hook), which '
                   'a graph of step() cannot hold; use overlap="step"')
    if getattr(ddp, "find_unused_parameters", False):
        why.append("find_unused_parameters=True: which parameters got a gradient is all-reduced into a new "
                   "table every iteration; build DDP without it")
    if options.grad_reduce_dtype is not None:
        why.append("grad_reduce_dtype: the gradients are reduced in copies made anew every iteration; leave it "
                   "None")
    if options.stochastic_rounding:
        why.append('master_weights="stochastic": its rounding keys are hashed from the step with temporaries; '
                   "use master weights")
    if side.api is None:
        why.append(f"the parameters are on {side.device.type}: a CUDA graph needs CUDA parameters (torch.optim's "
                   "capturable=True refuses them too)")
    if why:
        raise ValueError("capturable=True (step() replayed from a CUDA graph) cannot be honored: " + "; ".join(why))
