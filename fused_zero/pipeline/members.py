"""Several fused_zero optimizers over one DDP module: each is a *member* of the module's one engine.

DDP takes one comm hook, and its buckets mix the parameters of every optimizer (Muon's matrices beside
AdamW's embeddings, norms and biases), so the reduction stays one per bucket, and so does the step
count per parameter. Everything a user can observe per optimizer is its own, as torch.optim's
optimizers are independent objects: its parameters, param groups, algorithm and state (a shard keeps one
part per member and state format, shard.py), its coefficient table and launches, its ``step()`` (in
overlap="step" its update runs then: stepping.py), its overflow skip and skip count, its GradScaler state
(amp.py), its ``state_dict()`` and schedulers. ``max_grad_norm`` clips by the norm of every member's
gradients, as one ``clip_grad_norm_(model.parameters())`` before the steps does (docs/design-optimizers.md,
"Several optimizers, each torch.optim's own").

``MemberView`` is one member's share as the checkpoint side reads it (checkpoint/*): its parameters in
its own order (local indices ``i``, as its state dict numbers them), its groups and algorithm, the shards
holding its state and its state names there; the rest is the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .step_end.amp import ScalerLink


@dataclass
class Member:
    """One fused_zero optimizer of an engine.

    Attributes:
        index: its position among the engine's members (the order they attached in).
        opt: the optimizer (its ``param_groups`` are read at every step).
        algo: its algorithm (update/algorithms.py, update/muon.py).
        pids: the engine's indices of its parameters, in its own order.
        group_formats: each of its param groups' state format.
        scaler: its link to the user's GradScaler (GradScaler keeps a state per optimizer), or None.
    """

    index: int
    opt: object
    algo: object
    pids: np.ndarray
    group_formats: list[str]
    scaler: ScalerLink | None = None

    @property
    def name(self) -> str:
        return f"{type(self.opt).__name__} (optimizer {self.index} over this DDP module)"


class MemberView:
    """One member's share of an engine (module docstring). ``params``, ``steps``, ``group_of`` and
    ``state_formats`` are indexed by the member's own parameter order."""

    def __init__(self, engine, member: Member):
        self.engine = engine
        self.member = member
        self.opt, self.algo = member.opt, member.algo
        self.pids = member.pids
        self.params = [engine.params[pid] for pid in member.pids]
        self.local_of = {int(pid): i for i, pid in enumerate(member.pids)}
        self.group_of = engine.group_of[member.pids]
        self.group_formats = member.group_formats
        self.state_formats = [engine.state_formats[pid] for pid in member.pids]

    # the engine's, unchanged
    world = property(lambda self: self.engine.world)
    rank = property(lambda self: self.engine.rank)
    group = property(lambda self: self.engine.group)
    device = property(lambda self: self.engine.device)
    topology = property(lambda self: self.engine.topology)
    side = property(lambda self: self.engine.side)
    iteration = property(lambda self: self.engine.iteration)
    ddp = property(lambda self: self.engine.ddp)
    local = property(lambda self: self.engine.local)

    @property
    def holding(self) -> bool:
        return self.engine.holding

    @holding.setter
    def holding(self, value: bool) -> None:
        self.engine.holding = value

    def synchronize(self) -> None:
        self.engine.synchronize()

    def where(self, i: int):
        """``(shard, index in the bucket)`` of the member's parameter ``i``."""
        return self.engine.registry.where[int(self.pids[i])]

    def shards(self) -> list:
        """The shards of the buckets holding some of the member's parameters, in the engine's order: the
        same on every rank, whether or not its region holds rows of them (collectives follow this order)."""
        return [s for s in self.engine.shards() if (s.members == self.member.index).any()]

    def parts(self, shard) -> list:
        return [p for p in shard.parts if p.member == self.member.index]

    def names(self, shard) -> list[str]:
        """The member's state names in ``shard`` (its algorithm's, then ``"master"`` where kept)."""
        return self.algo.state_names() + (["master"] if "master" in shard.names else [])

    def counts(self) -> np.ndarray:
        """The member's step counts on the host (a wait for the device, once until they change)."""
        return self.engine.step_counts.host()[self.pids]

    @property
    def steps(self) -> np.ndarray:
        return self.counts().copy()

    @steps.setter
    def steps(self, value) -> None:
        full = self.engine.steps
        full[self.pids] = value
        self.engine.steps = full
