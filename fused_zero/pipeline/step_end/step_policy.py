"""What ``step()`` does with what the user did between the backward and the step: edits of ``param.grad``
(``clip_grad_norm_``, ``scaler.unscale_``, any in-place change) and the way the step was called (through
a GradScaler or not).

The rule: an edit is honored where the update reads ``param.grad`` at ``step()`` (``overlap="step"``
with ``grad_reduce="all_reduce"``: the reduced bucket is what ``param.grad`` views); everywhere else
the update reads its own reduced slices (or already ran in the backward), so an edit would be lost,
and is refused on every rank with an error that names the option doing the same job
(``max_grad_norm``). In step mode the refused step is also skipped on every rank, since the update
has not run yet; in the other modes it ran without the edit.

The same holds for ``param_groups`` (a learning rate set after the backward): read in ``step()``
with ``overlap="step"``, and refused in the other modes, whose update read them at the backward's
first bucket. A second synced backward before ``step()`` is accumulated where the update reads
``param.grad`` at ``step()`` and refused at its first bucket elsewhere (``check_second_backward``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...options import WHOLE_STEP
from ..buckets.strides import strided_view
from ..reducing.grad_watch import GradWatch
from .refusals import Refusals, partial_write_message

if TYPE_CHECKING:
    from ...options import ShardingOptions
    from ..buckets.param_table import ParamTable


class StepPolicy:
    """Attributes:
        watch: the gradients' versions since the backward (reducing/grad_watch.py).
        refusals: what ``step()`` refuses, agreed on by every rank (refusals.py).
    """

    def __init__(self, parameters: ParamTable, options: ShardingOptions, *, local: bool, registry, topology,
                 side):
        """``parameters``: the engine's parameter table (buckets/param_table.py); ``local``: one process without
        DDP (pipeline/local.py); ``registry``: where each parameter's bucket is (buckets/registry.py);
        ``topology``, ``side``: the process groups and the side stream the refusals are agreed on with."""
        self.params, self.members = parameters.tensors, parameters.members
        self.overlap, self.grad_reduce, self.on_nonfinite = options.overlap, options.grad_reduce, options.on_nonfinite
        self.scaled = options.grad_scaler is not None  # a GradScaler scales every member's loss
        self.local, self.registry = local, registry
        self.watch = GradWatch(self.params)
        self.refusals = Refusals(options, topology, side)

    def check_scaler_use(self, member, via_scaler: bool) -> None:
        """A GradScaler steps each optimizer if and only if it was given one."""
        scaler, overlap = member.scaler, self.overlap
        linked = scaler is not None and scaler.enabled
        if via_scaler and not linked:
            raise RuntimeError("scaler.step(optimizer) with a fused_zero optimizer that was not given the "
                               "scaler: build it with grad_scaler=scaler (the loss scale must be known when "
                               "the gradients are reduced)"
                               + (f", and without overlap='bucket': {WHOLE_STEP['scaler']}" if overlap == "bucket"
                                  else ""))
        if linked and not via_scaler:
            raise RuntimeError("this optimizer was built with grad_scaler=scaler: step it through "
                               "scaler.step(optimizer), then scaler.update()")

    def check_stepped_once(self, member, stepped: set) -> None:
        """A member steps once per iteration: a second ``step()`` before the others' would step on the same
        gradients twice, which the update (run once per bucket) cannot do."""
        if member.index in stepped:
            waiting = [m.name for m in self.members if m.index not in stepped]
            raise RuntimeError(f"{member.name}: step() called twice in one iteration, before "
                               f"{', '.join(waiting)} stepped: call each optimizer's step() once after the "
                               "backward")

    def refuse_unstepped(self, stepped: set) -> None:
        """A backward that starts while some member has not stepped since the last one."""
        waiting = [m.name for m in self.members if m.index not in stepped]
        done = [m.name for m in self.members if m.index in stepped]
        ran = "their update ran in the backward" if self.overlap != "step" else \
            "their gradients were reduce-scattered in place, and adding to them would not give their sum"
        raise RuntimeError(f"a backward started before {', '.join(waiting)} called step() (after "
                           f"{', '.join(done)} did): with overlap={self.overlap!r} and "
                           f"grad_reduce={self.grad_reduce!r} {ran}. Step every fused_zero optimizer over the DDP "
                           "module after each synced backward, or use overlap='step' with grad_reduce='all_reduce', "
                           "where an optimizer that does not step keeps its gradients to accumulate, as torch.optim's "
                           "does. Nothing of this backward was reduced or applied")

    def check_second_backward(self, stepped: set) -> None:
        """A synced backward after another one, with no ``step()`` between (gradient accumulation that
        syncs every micro-batch: Accelerate's ``sync_each_batch``, multi-loss loops). DDP + torch.optim
        step on the sum of both averages, which DDP leaves in ``param.grad``; so does overlap="step"
        with grad_reduce="all_reduce", whose update reads that bucket at ``step()`` (nothing to do
        here). Elsewhere the first backward's gradients are gone (updated from in the backward, or
        reduce-scattered in place), and this backward is refused at its first bucket, before anything
        of it is reduced or applied; every rank is at the same bucket, so every rank raises."""
        if self.overlap == "step" and self.grad_reduce == "all_reduce":
            return  # every member that has not stepped accumulates, as torch.optim's would
        if stepped:
            self.refuse_unstepped(stepped)
        done = ("the first backward's update already ran inside it" if self.overlap != "step" else
                "the first backward's gradients were reduce-scattered in place, and adding to them would "
                "not give their sum")
        raise RuntimeError(
            f"a second synced backward before optimizer.step(): with overlap={self.overlap!r} and grad_reduce="
            f"{self.grad_reduce!r} {done}. Accumulate the micro-batches under ddp.no_sync() (all but the "
            "last; Accelerate: accelerator.accumulate() without sync_each_batch), or use overlap='step' with "
            "grad_reduce='all_reduce', which steps on the accumulated gradients as DDP + torch.optim do. "
            "Nothing of this backward was reduced or applied")

    @staticmethod
    def hparams_key(param_groups: list[dict]) -> list:
        """What the update reads of ``param_groups``, comparable later: values as they are, tensors (a
        tensor lr, which schedulers fill in place) by identity and version counter. No host sync."""
        return [[(k, (id(v), v._version) if isinstance(v, torch.Tensor) else v)
                 for k, v in g.items() if k != "params"] for g in param_groups]

    def hparams_changed(self, member, key: list) -> list[str]:
        """The member's param-group entries changed since ``key`` was taken (at the iteration's first
        bucket)."""
        now = self.hparams_key(member.opt.param_groups)
        owner = f"{member.name}: " if len(self.members) > 1 else ""
        return [f"{owner}param group {i}: {k}" for i, (a, b) in enumerate(zip(key, now))
                for k in sorted({k for k, _ in a} | {k for k, _ in b}) if dict(a).get(k) != dict(b).get(k)]

    def refuse_hparams(self, changed: list[str]) -> None:
        """Raise for a hyperparameter set after the update read it (on every rank that learned of it)."""
        where = ", ".join(changed) if changed else "on another rank"
        raise RuntimeError(
            f"param_groups changed between backward and optimizer.step() ({where}), but with overlap="
            f"{self.overlap!r} the update read them at the backward's first bucket and ran in the backward: "
            "this step was applied with the values read then. Set hyperparameters before the backward "
            "(scheduler.step() right after optimizer.step(), as torch's schedulers expect; a warm-up before "
            "the forward), or use overlap='step', which reads param_groups in step()")

    def edits(self, member, via_scaler: bool, grad_scale: torch.Tensor | None, iteration) -> tuple[list[int], bool]:
        """The member's parameters whose ``.grad`` the user changed since the backward, and whether the
        update honors the change. Honored edits are written back into the reduced buckets of iteration
        ``iteration``; the list returned is then empty."""
        edited = [int(i) for i in self.watch.edited(member.pids)]
        if via_scaler and grad_scale is None and self.overlap == "step" and self.scaled:
            # the user's scaler.unscale_(opt) divided param.grad in place, with a fused op that leaves
            # the version counters as they were: every gradient counts as edited
            edited = sorted(set(edited) | {int(i) for i in member.pids if self.params[i].grad is not None})
        honored = bool(edited) and self.overlap == "step" and self.grad_reduce == "all_reduce"
        if honored:
            self._write_back(edited, iteration)  # this mode reads param.grad's values: the edit is honored
            edited = []
        return edited, honored

    def _write_back(self, pids: list[int], iteration) -> None:
        """Make the reduced buckets hold the user's edited ``param.grad`` (with gradient_as_bucket_view
        the edit is there already, unless ``.grad`` was replaced by another tensor)."""
        for item in iteration.reduced():  # reduced in grad_reduce_dtype: DDP's buffer holds the copied-back
            item.shard.reduced_buffer = item.bucket  # average, the fp32 values param.grad views
        buffers = {id(item.shard): item.bucket for item in iteration.reduced()}
        for pid in pids:
            shard, local = self.registry.where[pid]
            g = self.params[pid].grad
            if g is None:
                raise RuntimeError(f"param.grad of parameter {pid} was set to None between backward and step()")
            off, n = shard.layout.offsets[local], shard.layout.numels[local]
            view = strided_view(buffers[id(shard)][off:off + n], self.params[pid])
            if view.data_ptr() != g.data_ptr() or view.stride() != g.stride():
                view.copy_(g)

    def refuse(self, member, edited: bool, changed: list[str], found: torch.Tensor, written: list[int],
               wrote: tuple[bool, ...]) -> None:
        """After ``member``'s ``step()``: raise, on every rank, for what its update could not honor (an
        edit of its ``.grad``, a hyperparameter set or a parameter written after the update read it,
        parameters written on some ranks only: ``wrote``, this rank's bits of the iteration's writes,
        reducing/weight_watch.py; refusals.py agrees on them across ranks), then, with
        ``on_nonfinite="raise"``, for a skipped step (``found``: its flag)."""
        if not self.local:
            honors = self.overlap == "step" and self.grad_reduce == "all_reduce"  # edits, late hyperparameters
            flags = (False, False) if honors else (edited, bool(changed))
            (edited, changed_anywhere, written_anywhere), agreed = self.refusals.agree(
                member, *flags, bool(written), same=wrote)
            if not agreed:
                raise RuntimeError(partial_write_message(member.name))
            if edited:
                self.refuse_edit()
            if changed_anywhere:
                self.refuse_hparams(changed)
            if written_anywhere:
                self.refuse_written(written)
        # a host read of a device flag: a synchronization on CUDA, paid only by on_nonfinite='raise'
        if self.on_nonfinite == "raise" and member.scaler is None and bool(found):
            raise FloatingPointError(
                f"{member.name}: its reduced gradients hold an inf or NaN on some rank; its step was skipped "
                "on every rank (on_nonfinite='raise'; on_nonfinite='skip' skips silently and counts "
                "skipped_steps)")

    def refuse_written(self, written: list[int]) -> None:
        """Raise for parameters written between the backward and ``step()`` in a mode whose update ran in
        the backward (their all-gather may also land after the write)."""
        where = f"parameters {written}" if written else "on another rank"
        raise RuntimeError(
            f"the parameters were written between backward and optimizer.step() ({where}), but with overlap="
            f"{self.overlap!r} the update ran in the backward, from the weights before the write, and its all-gather "
            "may land after it: this step was applied without the write. Write the weights before the forward "
            "(or after step()), or use overlap='step', which updates the weights as they are at step()")

    def refuse_edit(self) -> None:
        """Raise for an edit that the update could not honor (on every rank that learned of it)."""
        raise RuntimeError(
            "param.grad was changed between backward and optimizer.step() (torch.nn.utils."
            "clip_grad_norm_, scaler.unscale_, or another in-place edit), but with overlap="
            f"{self.overlap!r} and grad_reduce={self.grad_reduce!r} the update does not read param.grad"
            + (" (it ran during the backward)" if self.overlap != "step" else "")
            + ". Pass max_grad_norm=... to the optimizer instead of clipping (it clips by the same "
            "global norm, inside the update; no scaler.unscale_ needed either), or use "
            "overlap='step' with grad_reduce='all_reduce', which reads param.grad at step(). "
            + ("This step was skipped on every rank." if self.overlap == "step" else
               "This step was applied without the edit."))
