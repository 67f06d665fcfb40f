"""One iteration's pipeline behind the optimizer classes: reduce -> update -> gather, driven by DDP's
comm hook, and ``step()`` ending the iteration.

DDP hands every bucket of gradients to the comm hook in bucket order; the hook starts its reduction
(reduce-scatter of the head plus an all-reduce of the small tail, or one all-reduce), and, when the
overlap mode says so, waits for it, runs the fused update on this rank's region and starts the
all-gather of the updated slices into the flat parameter buffer. ``step()`` ends the iteration; the
all-gathers are waited for there or by the forward pre-hooks.

The stages live beside it: the reduction (reduction.py), the update (updates.py), the all-gather
(gathering/gather.py), and what ``step()`` does with a user's edits of ``.grad`` and a GradScaler
(step_policy.py); so do which shard holds which parameter and resharding (registry.py), the side stream
(streams.py) and the hooks (hooks.py). The options and their checks are the public ones (fused_zero/options.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..options import ShardingOptions, group_state_formats
from ..params import NO_MEMBER, collect_params
from .buckets import rebuild
from .buckets.arena import SingleLaunch
from .buckets.registry import ShardRegistry
from .buckets.shard import BucketShard
from .buckets.topology import Topology
from .comm.profiling import range_push
from .comm.scratch import Scratch
from .comm.streams import SideStream
from .local import LocalModule
from .members import Member
from .reducing import hooks
from .reducing.reduction import Reduced, Reduction
from .reducing.weight_watch import WeightWatch
from .step_end.amp import ScalerLink
from .step_end.step_graph import StepGraph, check_capturable
from .step_end.step_policy import StepPolicy
from .step_end.stepping import Stepping
from .updating.step_counts import StepCounts
from .updating.updates import Updates
from .updating.warmup import compile_kernels


@dataclass
class _Iteration:
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


class Engine(Stepping):
    """Everything the fused_zero optimizers over one DDP module do, behind the torch.optim interface (see
    optimizer/): one optimizer in most programs, several (Muon beside AdamW) as *members*
    (pipeline/members.py).

    Attributes (the main ones):
        members: the optimizers (Member), in the order they attached.
        params, member_of, group_of, pid_of: the parameters DDP reduces (requiring grad), their member and
            param group there, their index. A parameter no fused_zero optimizer updates has member
            ``NO_MEMBER`` (params.py): reduced as DDP reduces it, its ``.grad`` DDP's average, and left to
            its owner (a torch.optim optimizer, or none).
        steps / step_counts: each parameter's step count (replicated on every rank), kept and counted
            on the device; ``steps`` reads it to the host, a wait only checkpoints make (step_counts.py).
        registry: which BucketShard holds each parameter's state (ShardRegistry).
        iteration: this iteration's progress (_Iteration).
        side: the side stream the updates run on (SideStream; inline on CPU).
        scaler: the user's GradScaler (the first member's ScalerLink: each member has its own), or None.
        graph: ``step()``'s device work replayed from CUDA graphs, one per member (``capturable=True``,
            step_graph.py), or None.
        scratch: the small tensors that work writes (scratch.py: kept across steps where a graph reads
            them).
        skipped: each member's steps skipped for non-finite gradients, int64 ``[members]`` on the device
            (read: ``skipped_steps``).
        reduction, updates: the pipeline's stages (reduction.py, updates.py).
        policy: what step() does with the user's edits of ``.grad`` and a GradScaler (step_policy.py).
        grad_sumsq: the global sum of squares of the last update's reduced, unscaled gradients (a device
            scalar; in overlap modes "step" and "backward", where one update covers every bucket: the
            pre-clip norm squared, which the integrations' clip_grad_norm_ returns), or None.
    """

    def __init__(self, ddp, members: list[tuple], **options):
        """``members``: ``(optimizer, algorithm, state_format)`` of each fused_zero optimizer over ``ddp``
        (``state_format``: the default of its param groups), which together own every parameter DDP
        reduces. Validate, then mutate: every check that can refuse runs before the first change to the
        model or the DDP module (rebinding parameters to the flat buffers, registering hooks), so a
        refused optimizer leaves a working model, and a working optimizer, as they were."""
        self.options = ShardingOptions(**options)
        self.ddp = ddp
        self.local = isinstance(ddp, LocalModule)  # a plain module: step() hands the buckets (local.py)
        self.overlap = self.options.overlap
        self.grad_reduce = self.options.grad_reduce
        self.max_grad_norm = self.options.max_grad_norm
        self.param_sync = self.options.param_sync
        self.on_nonfinite = self.options.on_nonfinite
        self.params, self.member_of, self.group_of = collect_params([opt.param_groups for opt, _, _ in members], ddp)
        self.options.check_params([p for p, m in zip(self.params, self.member_of) if m != NO_MEMBER])
        self.pid_of = {p: i for i, p in enumerate(self.params)}
        scaler = self.options.grad_scaler
        self.members = [Member(i, opt, algo, np.flatnonzero(self.member_of == i),
                               group_state_formats(opt.param_groups, fmt),
                               ScalerLink(scaler, opt) if scaler is not None else None)
                        for i, (opt, algo, fmt) in enumerate(members)]
        self.scaler = self.members[0].scaler
        self.state_formats = [self.members[m].group_formats[g] if m != NO_MEMBER else "fp32"
                              for m, g in zip(self.member_of, self.group_of)]
        self._group_index = {}
        self.device = self.params[0].device
        self.backend = self.options.resolved_backend(self.device)
        for m in self.members:
            m.algo.check_engine(self, m)
        hooks.check_no_comm_hook(ddp)
        topo = self.topology = Topology.build(ddp.process_group, self.options.shard_group, self.device)
        self.group, self.world, self.rank = topo.group, topo.world, topo.rank
        topo.check_reduce_dtype(self.options.grad_reduce_dtype, self.device)
        self.side = SideStream(self.device)
        capturable = any(m.captured for m in self.members)
        if capturable:
            check_capturable(self, ddp)
        # what the device work writes besides the state: kept across steps where a graph replays it
        self.scratch = Scratch(self.device, kept=capturable)
        self.graph = StepGraph(self.side) if capturable else None
        self.step_counts = StepCounts(len(self.params), self.side)
        self.iteration = _Iteration()
        self.skipped = torch.zeros(len(self.members), dtype=torch.int64, device=self.device)
        self.reduction = Reduction(self, ddp)
        self.updates = Updates(self)
        self.policy = StepPolicy(self)
        self.grad_sumsq: torch.Tensor | None = None
        self.holding = False  # some shard holds 8-bit moments in fp32 since a load (rebuild.py)
        self.registry = ShardRegistry(
            self.params, state_names=[m.algo.state_names() for m in self.members],
            keeps_master=self.options.keeps_master, upload=self.side.upload if self.backend == "triton" else None,
            device=self.device, topology=topo, members=self.member_of, state_formats=self.state_formats)

        # backward and step modes: one launch per step, dtype, member and format once DDP's buckets are stable
        self.single = SingleLaunch(self.registry, self.backend) if self.overlap != "bucket" else None
        if self.backend == "triton":
            compile_kernels(self)  # warmup.py
        self._handles, self._module_handles = [], []
        self._install()
        self.weights = WeightWatch(self.params, [m != NO_MEMBER for m in self.member_of])

    def _install(self) -> None:
        """The mutations, once everything is checked: parameters become views of the flat buffers,
        then the hooks are registered, the comm hook last (DDP cannot remove it). Should anything
        fail on the way, the parameters get their own storage back and the hooks are removed."""
        storages = [p.data for p in self.params]
        try:
            self.registry.install_initial_layout(self.ddp.module, self.pid_of)
            hooks.register(self, self._handles, self._module_handles)
        except BaseException:
            self.close()
            for p, data in zip(self.params, storages):
                p.data = data
            raise

    @property
    def layout_changes(self) -> int:
        return self.registry.layout_changes

    def skipped_steps(self, member: int) -> int:
        """The member's steps skipped because some rank's reduced gradients of it held an inf or NaN
        (reading it waits for the device)."""
        self.side.join()
        return int(self.skipped[member])

    @property
    def steps(self) -> np.ndarray:
        """Each parameter's step count with every update so far counted: a host copy (reading it waits
        for the device; write changes back with ``engine.steps = ...``)."""
        return self.step_counts.host().copy()

    @steps.setter
    def steps(self, value) -> None:  # ``engine.steps += 1`` (on the host copy, then assigned)
        self.step_counts.write(value)

    def shards(self) -> list[BucketShard]:
        return self.registry.shards()

    def group_index(self, member: int) -> np.ndarray:
        """Each parameter's param group in ``member`` (0 for the other members' parameters: their rows
        of the member's table are inactive)."""
        if member not in self._group_index:
            self._group_index[member] = np.where(self.member_of == member, self.group_of, 0)
        return self._group_index[member]

    # ------------------------------------------------------------------ the comm hook

    def on_bucket(self, bucket) -> torch.futures.Future:
        """The comm hook: start this bucket's reduction; update the buckets whose turn has come.

        Every collective is issued here, on the autograd thread, or in ``step()``, in bucket order:
        all ranks then issue the same collectives in the same order, which gloo and NCCL both need
        (callbacks on communication threads would race). On CUDA, waiting for a reduction is a stream
        wait, so a bucket is updated as soon as it is handed over; on CPU a wait blocks the host, so a
        bucket is updated when the next one arrives, and its reduction overlaps the backward between.
        The future returned is the reduction's where the backend has one (``Reduction.future``), as
        DDP's own ``allreduce_hook`` returns: DDP waits for it before it reads the bucket.
        """
        index, buffer = bucket.index(), bucket.buffer()
        shard = self.registry.cached(index, buffer)
        if shard is None:  # a bucket not seen before (DDP's first iterations): read it in full
            pids, offsets = self.registry.read_bucket(bucket, buffer, self.pid_of)
        if self.iteration.invoked == 0 or self.iteration.last_invoked:  # the first bucket of a backward
            self.policy.refusals.check(wait=False)  # one another rank made known, before any collective
        if self.iteration.last_invoked:  # a synced backward before every member stepped after the last one
            self.backward_before_steps()  # accumulated (step + all_reduce) or refused (stepping.py)
        it = self.iteration
        if it.hparams is None:
            self._start_iteration(it)  # joins the side stream: the previous iteration's copies may go
        if shard is None:
            shard = self.registry.shard_for(index, pids, offsets, buffer)
        if shard.held and not rebuild.pending(self):  # DDP's buckets are final: encode once, before the update
            shard.encode_held()
        with range_push("fused_zero.reduce"):
            reduced = self.reduction.start(shard, buffer)
        shard.reduced_buffer = reduced.grad  # a staging copy lives with ``reduced`` until the iteration's end
        it.ready.append(reduced)
        it.invoked += 1
        it.last_invoked = bucket.is_last()
        if it.last_invoked:
            if not self.local:  # handed from step(): the gradients are read as they are then
                self.policy.watch.arm()
            if self.scaler is not None and self.scaler.enabled:
                if self.overlap == "backward":
                    it.grad_scale = self.scaler.scale()
                for m in self.members:
                    m.scaler.prepare(self.device)
        if self.overlap == "bucket":
            keep = 0 if (it.last_invoked or self.side.asynchronous) else 1
            self.updates.finish(it, len(it.ready) - keep, each_bucket=True)
        elif self.overlap == "backward" and it.last_invoked:
            self.updates.finish(it, len(it.ready), self.max_grad_norm)
        return self.reduction.future(reduced)

    def _start_iteration(self, it: _Iteration) -> None:
        """The first bucket of a synced backward, before any of its collectives."""
        self.side.join()  # the compute stream after the last iteration's updates (resharding reads them)
        it.hparams = [self._read_hparams(m) for m in self.members]
        it.hparams_key = [self.policy.hparams_key(m.opt.param_groups) for m in self.members]
        # written here, read and maxed into by the side stream's checks: the side stream waits for it
        it.found_inf = self.scratch.take("found_inf", (len(self.members),), torch.float32).zero_()
        self.side.follow()
        self.written_weights(it)  # weights the user wrote since the last update, before this one reads them

    @staticmethod
    def _read_hparams(member) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in member.opt.param_groups]

    def synchronize(self) -> None:
        """Wait for every pending all-gather: parameters are up to date for any reader after this."""
        for shard in self.shards():
            shard.gather.finish()
        self.side.join()

    def close(self) -> None:
        for h in self._module_handles + self._handles:
            h.remove()
        self._handles, self._module_handles = [], []

