"""``step()``: each fused_zero optimizer's, and the end of the iteration once every one has stepped (the
updates of overlap="step", the refusals of what ``step()`` cannot honor, the skip count, the streams'
joins). A part of the Engine (engine.py), kept apart from the comm hook's path."""

from __future__ import annotations

import torch

from . import rebuild
from .profiling import range_push


class Stepping:
    """The Engine's user-facing step (the Engine's attributes: engine.py)."""

    def step(self, member, via_scaler: bool = False, grad_scale: torch.Tensor | None = None) -> bool:
        """A member's ``step()``; the last member's ends the iteration (returns True then). ``via_scaler``:
        called by ``GradScaler.step()``, which passes the loss scale the gradients still carry (None
        after the user's ``scaler.unscale_``)."""
        if self.side.api is not None and self.side.api.capturing():
            raise RuntimeError(
                "optimizer.step() was called inside a CUDA graph capture: it waits for the reductions issued "
                "in the backward, outside the capture, which CUDA refuses. Call step() eagerly; with "
                "capturable=True and overlap=\"step\" it captures its own device work once and replays it")
        if self.local:
            return self._local_step(member, via_scaler, grad_scale)
        it = self.iteration
        if it.invoked == 0:
            raise RuntimeError("optimizer.step() found no reduced gradients since the last step: run a "
                               "backward outside ddp.no_sync() (with require_backward_grad_sync=True) "
                               "before stepping")
        if not it.last_invoked:
            raise RuntimeError("optimizer.step() called while DDP is still reducing gradients")
        self.policy.check_stepped_once(member, it.stepped)
        self.policy.check_scaler_use(member, via_scaler)
        it.stepped.add(member.index)
        edited, honored = self.policy.edits(member, via_scaler, grad_scale)
        it.edits, it.honored = it.edits or bool(edited), it.honored or honored
        if self.overlap == "step":  # the updates run at the last step(): the hyperparameters as they are now
            it.hparams[member.index] = self._read_hparams(member)
        else:  # the update ran with the hyperparameters of the first bucket
            it.changed += self.policy.hparams_changed(member, it.hparams_key[member.index])
        if len(it.stepped) < len(self.members):
            return False
        self._end_iteration(it, via_scaler, grad_scale)
        return True

    def _local_step(self, member, via_scaler: bool, grad_scale) -> bool:
        """One process without DDP: the members' steps are noted until the last, which hands the buckets
        (local.py) and ends the iteration; False where nothing stepped (no ``.grad`` anywhere)."""
        self.policy.check_stepped_once(member, set(self._waiting))
        self.policy.check_scaler_use(member, via_scaler)
        self._waiting[member.index] = self._read_hparams(member)
        if len(self._waiting) < len(self.members):
            return False
        waiting, self._waiting = self._waiting, {}
        if not self.ddp.drive(self):
            return False  # no parameter has a .grad: torch.optim's step does nothing either
        it = self.iteration
        it.stepped, it.hparams = set(waiting), [waiting[m.index] for m in self.members]
        self._end_iteration(it, via_scaler, grad_scale)
        return True

    def _end_iteration(self, it, via_scaler: bool, grad_scale) -> None:
        """Every member has stepped: the updates of overlap="step", the refusals, the streams' joins."""
        self.policy.watch.clear()
        if self.overlap == "step":
            it.coefs = None
            if self.scaler is not None and self.scaler.enabled:
                it.grad_scale = None if grad_scale is None else grad_scale.reshape(1)
            it.edited = it.edits
            self.updates.finish(it, len(it.ready), self.max_grad_norm, follow=it.honored or it.grad_scale is not None)
            edited_anywhere, changed, changed_anywhere = it.edited, [], False
        else:
            changed = it.changed
            edited_anywhere, changed_anywhere = self.policy.any_rank(it.edits, bool(changed))
        self._count_skip(it)
        if self.single is not None and self.single.step_ended():
            self.synchronize()  # nothing may be pending on the shards while they move
            self.single.pack()
            with self.side.run(follow_current=True):  # later updates after the moves
                pass
        self.reduction.end_step()
        self.iteration = type(it)()  # engine._Iteration
        if self.param_sync == "step":
            with range_push("fused_zero.gather_wait"):  # what param_sync="forward" moves into forward_wait
                self.synchronize()
        else:
            # the compute stream follows the updates (not the all-gathers): whatever runs before the
            # next forward, such as zero_grad(set_to_none=False) or DDP freeing its old buckets when
            # it rebuilds them, must not overwrite what an update still reads
            self.side.join()
        rebuild.encode_if_final(self)
        if edited_anywhere:
            self.policy.refuse_edit()
        if changed_anywhere:
            self.policy.refuse_hparams(changed)
        # a host read of a device flag: a synchronization on CUDA, paid only by on_nonfinite='raise'
        if self.on_nonfinite == "raise" and self.scaler is None and bool(it.found_inf):
            raise FloatingPointError(
                "the reduced gradients hold an inf or NaN on some rank; the step was skipped on every rank "
                "(on_nonfinite='raise'; on_nonfinite='skip' skips silently and counts skipped_steps)")

    def _count_skip(self, it) -> None:
        """The step's skip flag into the skipped-step counter and the GradScaler's found-inf tensors.
        Both read the flag that the side stream's checks wrote, so they are queued there, after the
        current stream (the user's ``scaler.unscale_`` wrote the scaler's tensors on it); ``step()``
        then orders the current stream after the side stream before anyone reads them."""
        with self.side.run(follow_current=True):
            if self.scaler is not None and self.scaler.enabled:
                for m in self.members:
                    m.scaler.publish(it.found_inf)
            self.skipped += it.found_inf.to(torch.int64).reshape(())
