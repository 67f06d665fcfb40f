"""``step()``: each fused_zero optimizer's own, as torch.optim's optimizers are independent objects.

A member's ``step()`` applies its update now (overlap="step": from its gradients as they are when it is
called; the other modes ran it in the backward, with the gradients then), skips on its own overflow,
publishes its own GradScaler flag and skip count, and refuses what it cannot honor, on every rank. The
iteration (iteration.py) ends once every member has stepped, or, where a member may leave its gradients
to accumulate (overlap="step" with grad_reduce="all_reduce"), when the next synced backward starts.

``Stepping`` is an object the engine owns (engine.py), built with the stages it drives and the few
settings it reads, never with the engine: it starts the iteration at the comm hook's first bucket
(``start_iteration``) and ends it, kept apart from the comm hook's path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..comm.profiling import range_push
from ..reducing.reduction import Reduced
from ..reducing.weight_watch import refresh_masters
from .iteration import Iteration

if TYPE_CHECKING:
    from ...options import ShardingOptions
    from ..buckets.param_table import ParamTable


class Stepping:
    """The members' ``step()`` and the iteration's start and end.

    Attributes:
        iteration: this iteration's progress (Iteration), replaced when it ends.
    """

    def __init__(self, parameters: ParamTable, options: ShardingOptions, *, side, scratch, skipped: torch.Tensor,
                 registry, weights, single_launch, reduction, updates, policy, encode_if_final: Callable,
                 drive: Callable | None):
        """``side``, ``scratch``: the side stream and the tensors the device work writes (comm/);
        ``skipped``: each member's skipped steps on the device; ``registry``, ``single_launch``: the shards and,
        in overlap modes "backward" and "step", their arenas (buckets/); ``weights``: the user's writes of
        the parameters (reducing/weight_watch.py); ``reduction``, ``updates``, ``policy``: the stages;
        ``encode_if_final``: the moments a load held in fp32, encoded at a step's end once DDP will not
        rebuild its buckets (buckets/rebuild.py); ``drive``: one process without DDP, hands a member's
        gradients to the comm hook (local.py), else None."""
        self.members = parameters.members
        self.overlap, self.param_sync = options.overlap, options.param_sync
        self.side, self.scratch, self.skipped = side, scratch, skipped
        self.registry, self.weights, self.single_launch = registry, weights, single_launch
        self.reduction, self.updates, self.policy = reduction, updates, policy
        self.encode_if_final, self.drive = encode_if_final, drive
        self.iteration = Iteration()

    def step(self, member, max_norm: float | None, via_scaler: bool = False,
             grad_scale: torch.Tensor | None = None) -> None:
        """A member's ``step()``. ``max_norm``: the ``max_grad_norm`` its update clips to (overlap="step").
        ``via_scaler``: called by ``GradScaler.step()``, which passes the loss scale the gradients still
        carry (None after the user's ``scaler.unscale_``)."""
        if self.side.api is not None and self.side.api.capturing():
            raise RuntimeError(
                "optimizer.step() was called inside a CUDA graph capture: it waits for the reductions issued "
                "in the backward, outside the capture, which CUDA refuses. Call step() eagerly; with "
                "capturable=True and overlap=\"step\" it captures its own device work once and replays it")
        self.policy.refusals.check()  # a refusal another rank made known since (step_policy.py)
        if self.drive is not None:
            self._local_step(member, max_norm, via_scaler, grad_scale)
            return
        iteration = self.iteration
        if iteration.invoked == 0:
            raise RuntimeError("optimizer.step() found no reduced gradients since the last step: run a "
                               "backward outside ddp.no_sync() (with require_backward_grad_sync=True) "
                               "before stepping")
        if not iteration.last_invoked:
            raise RuntimeError("optimizer.step() called while DDP is still reducing gradients")
        self.policy.check_stepped_once(member, iteration.stepped)
        self.policy.check_scaler_use(member, via_scaler)
        iteration.stepped.add(member.index)
        edited, honored = self.policy.edits(member, via_scaler, grad_scale, iteration)
        changed, late = [], self.written_weights(iteration)
        if self.overlap == "step":  # the update runs now: the hyperparameters and the weights as they are now
            self._step_member(iteration, member, max_norm, grad_scale, bool(edited), honored)
            late = []
        else:  # the update ran in the backward, with the hyperparameters and weights of the first bucket
            changed = self.policy.hparams_changed(member, iteration.hparams_key[member.index])
        self._count_skip(iteration, member)
        if len(iteration.stepped) == len(self.members):
            self._end_iteration(iteration)
        else:
            self._join()
        self.policy.refuse(member, bool(edited), changed, iteration.found_inf[member.index:member.index + 1], late,
                           iteration.wrote)

    def _step_member(self, iteration, member, max_norm, grad_scale, edited: bool, honored: bool) -> None:
        """overlap="step": the member's update, now."""
        iteration.hparams[member.index] = member.hparams()
        iteration.coefs.pop(member.index, None)  # its table is made from its param groups as they are now
        scale = grad_scale.reshape(1) if grad_scale is not None and member.scaler is not None \
            and member.scaler.enabled else None
        self.updates.step_member(iteration, member, max_norm, scale, edited, follow=honored or scale is not None)

    def _local_step(self, member, max_norm, via_scaler: bool, grad_scale) -> None:
        """One process without DDP: the member's gradients are handed to the comm hook as they are now
        (local.py), and its update runs, as one iteration of its own; nothing where none of its
        parameters has a ``.grad`` (torch.optim's step does nothing either)."""
        self.policy.check_scaler_use(member, via_scaler)
        if not self.drive(member):
            return
        iteration = self.iteration
        iteration.stepped.add(member.index)
        self.written_weights(iteration)
        self._step_member(iteration, member, max_norm, grad_scale, False, True)
        self._count_skip(iteration, member)
        self._end_iteration(iteration)
        self.policy.refuse(member, False, [], iteration.found_inf[member.index:member.index + 1], [], iteration.wrote)

    def state_init_step(self, member, max_norm: float | None) -> None:
        """torch.distributed.checkpoint's state initialization of ``member`` (checkpoint/canonical.py's
        ``is_state_init_step``: DCP sets every gradient to zeros and every lr to 0, then steps): torch.optim's
        step on zero gradients at lr 0, which makes the state as a first step makes it (not always zero:
        Adam's coupled weight decay, SGD's momentum with weight decay) and leaves the parameters as they
        are. Run here as that very step: the member's update of every bucket from zero gradients, every
        parameter active, as overlap="step" runs it (every rank runs it: DCP's helpers are collective)."""
        iteration = self.iteration
        self.start_iteration(iteration)
        for shard in self.registry.shards():
            if member.index in shard.member_set:
                zeros = torch.zeros(shard.layout.numel, dtype=shard.param_buffer.dtype, device=self.side.device)
                shard.reduced_buffer = zeros
                iteration.ready.append(Reduced(shard, shard.all_active, [], zeros, zeros))
        iteration.invoked, iteration.last_invoked = len(iteration.ready), True
        iteration.stepped.add(member.index)
        self._step_member(iteration, member, max_norm, None, False, True)
        self._count_skip(iteration, member)
        self._end_iteration(iteration)

    def start_iteration(self, iteration: Iteration) -> None:
        """The first bucket of a synced backward, before any of its collectives (the comm hook, engine.py)."""
        self.side.join()  # the compute stream after the last iteration's updates (resharding reads them)
        iteration.hparams = [m.hparams() for m in self.members]
        iteration.hparams_key = [self.policy.hparams_key(m.opt.param_groups) for m in self.members]
        # written here, read and maxed into by the side stream's checks: the side stream waits for it
        iteration.found_inf = self.scratch.take("found_inf", (len(self.members),), torch.float32).zero_()
        self.side.follow()
        self.written_weights(iteration)  # weights the user wrote since the last update, before this one reads them

    def backward_before_steps(self) -> None:
        """The first bucket of a synced backward that starts before every member stepped after the last
        one: accumulated where the update reads ``param.grad`` at ``step()`` (overlap="step" with
        grad_reduce="all_reduce": the members that did not step leave their gradients in the buckets,
        which this backward adds to and reduces again, as DDP does), refused elsewhere, on every rank,
        before anything of it is reduced (step_policy.py)."""
        iteration = self.iteration
        self.policy.check_second_backward(iteration.stepped)
        for item in iteration.ready:  # reduced again from the buckets DDP accumulated into
            for w in item.works:
                w.wait()
        if iteration.stepped:
            self._end_iteration(iteration)
        else:
            self.side.join()  # the compute stream after the waits above, before the buckets are reused
            self.iteration = Iteration()

    def _end_iteration(self, iteration: Iteration) -> None:
        """Every member has stepped (or the next backward starts): the arenas' packing once DDP's buckets
        are stable, the streams' joins."""
        for item in iteration.reduced():
            item.shard.reduced_buffer = None  # every member has read it
        self.policy.watch.clear()
        if self.single_launch is not None and self.single_launch.step_ended():
            self.synchronize()  # nothing may be pending on the shards while they move
            self.single_launch.pack()
            with self.side.run(follow_current=True):  # later updates after the moves
                pass
        self.reduction.end_step()
        self.iteration = Iteration()
        self._join()
        self.encode_if_final()

    def _join(self) -> None:
        """The end of a ``step()``: with param_sync="step" every all-gather started is waited for;
        otherwise the compute stream follows the updates (not the all-gathers): whatever runs before
        the next forward, such as zero_grad(set_to_none=False) or DDP freeing its old buckets when it
        rebuilds them, must not overwrite what an update still reads."""
        if self.param_sync == "step":
            with range_push("fused_zero.gather_wait"):  # what param_sync="forward" moves into forward_wait
                self.synchronize()
        else:
            self.side.join()

    def synchronize(self) -> None:
        """Wait for every pending all-gather: parameters are up to date for any reader after this."""
        for shard in self.registry.shards():
            shard.gather.finish()
        self.side.join()

    def written_weights(self, iteration: Iteration) -> list[int]:
        """The parameters the user wrote since the update last looked (reducing/weight_watch.py): their
        masters taken afresh from them, on the side stream after the write (queued on the current
        stream), before any update reads them; ``iteration.wrote``: this iteration's bits for the ranks'
        agreement (step_policy.refuse). Returns them."""
        pids = self.weights.written(self._buffer_of)
        if pids:
            shards = {id(self.registry.where[pid][0]): self.registry.where[pid][0] for pid in pids}
            with self.side.run(follow_current=True):
                for shard in shards.values():
                    refresh_masters(shard, pids)
            iteration.written = sorted(set(pids) | set(iteration.written))
            iteration.wrote = self.weights.bits(iteration.written)
        return pids

    def _buffer_of(self, pid: int):
        """Where parameter ``pid``'s data lies: its bucket's parameter buffer and its offset there."""
        shard, local = self.registry.where[pid]
        return shard.param_buffer, shard.layout.offsets[local]

    def _count_skip(self, iteration: Iteration, member) -> None:
        """The member's skip flag into its skipped-step counter and its GradScaler's found-inf tensors.
        Both read the flag that the side stream's checks wrote, so they are queued there, after the
        current stream (the user's ``scaler.unscale_`` wrote the scaler's tensors on it); ``step()``
        then orders the current stream after the side stream before anyone reads them."""
        m = member.index
        flag = iteration.found_inf[m:m + 1]
        with self.side.run(follow_current=True):
            if member.scaler is not None and member.scaler.enabled:
                member.scaler.publish(flag)
            self.skipped[m:m + 1] += flag.to(torch.int64)
