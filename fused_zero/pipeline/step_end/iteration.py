"""One iteration's progress: what a synced backward and the members' ``step()`` have done so far. The
comm hook (engine.py) fills it bucket by bucket; ``Stepping`` (stepping.py) starts it, ends it and
replaces it; the stages read it as the argument they are called with (``iteration``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..reducing.reduction import Reduced
from ..reducing.weight_watch import WeightWatch


@dataclass
class Iteration:
    """What one synced backward has done so far; replaced when it ends (every member has stepped, or, where
    a member may leave its gradients to accumulate, the next synced backward starts: stepping.py).

    Each member is torch.optim's own optimizer (pipeline/members.py): it steps, scales, skips and refuses
    on its own, from its own gradients. What the members share is the bucket's reduction and all-gather.

    Attributes (per member: indexed by the member's index):
        hparams: each member's param groups' hyperparameters, read at the iteration's first bucket (in
            overlap="step": at the member's ``step()``).
        hparams_key: what they were then, to tell a later change (StepPolicy.hparams_key).
        coefs: member -> its coefficient table of this iteration (every parameter active), on the update's
            device; built once (in overlap="step": at the member's ``step()``), shared by every bucket.
        counting: the step counts' bound counts this iteration (StepCounts.begin_iteration).
        clip: the clip coefficient of this iteration (``max_grad_norm``: the global norm of every member's
            gradients), once computed; in overlap="step" at the first member's ``step()``, as one
            ``clip_grad_norm_(model.parameters())`` before the steps.
        stepped: the members whose ``step()`` has been called.
        invoked: buckets handed to the hook.
        last_invoked: the hook has seen DDP's last bucket.
        ready: buckets whose reduction was started and not waited for yet.
        waited: buckets whose reduction was waited for. Both keep what a bucket's update reads until the
            iteration's end has made the streams that allocated it wait for the side stream: the copies in
            ``grad_reduce_dtype`` and the used flags' tables (the relay stream's).
        grad_scale: the loss scale the reduced gradients carry (GradScaler), read at the last bucket
            (overlap="backward"), or None.
        found_inf: float32 ``[members]`` device flags, non-zero once an update of the member was skipped in
            this iteration (non-finite gradients of the member on some rank, or an edit of its ``.grad``
            that cannot be honored).
        written: the parameters the user wrote before this iteration's updates (reducing/weight_watch.py);
            ``wrote``: their bits, which every rank must agree on.
    """

    hparams: list[list[dict]] | None = None
    hparams_key: list | None = None
    coefs: dict = field(default_factory=dict)
    counting: bool = False
    clip: torch.Tensor | None = None
    stepped: set = field(default_factory=set)
    invoked: int = 0
    last_invoked: bool = False
    ready: list[Reduced] = field(default_factory=list)
    waited: list[Reduced] = field(default_factory=list)
    grad_scale: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    written: list = field(default_factory=list)
    wrote: tuple = WeightWatch.bits([])

    def reduced(self) -> list[Reduced]:
        """Every bucket reduced in this iteration so far, in bucket order."""
        return self.waited + self.ready
