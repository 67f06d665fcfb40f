"""One iteration's pipeline behind the optimizer classes: reduce -> update -> gather, driven by DDP's
comm hook, and ``step()`` ending the iteration.

DDP hands every bucket of gradients to the comm hook in bucket order; the hook starts its reduction
(reduce-scatter of the head plus an all-reduce of the small tail, or one all-reduce), and, when the
overlap mode says so, waits for it, runs the fused update on this rank's region and starts the
all-gather of the updated slices into the flat parameter buffer. ``step()`` ends the iteration; the
all-gathers are waited for there or by the forward pre-hooks.

The engine builds the stages and wires them; each is built with what it uses, never with the engine:
the parameter table (buckets/param_table.py), the options, and the objects it calls (the side stream, the
registry, the stage before it). The reduction (reduction.py), the update (updates.py), the all-gather
(gathering/gather.py), what ``step()`` does with a user's edits of ``.grad`` and a GradScaler
(step_policy.py), and the members' ``step()`` with the iteration's start and end (stepping.py) live in
the rooms below; so do which shard holds which parameter and resharding (registry.py), the side stream
(streams.py) and the hooks (hooks.py, built with ``HookTargets``). The options and their checks are the
public ones (fused_zero/options.py).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..options import ShardingOptions, group_state_formats
from ..params import NO_MEMBER, collect_params
from . import added_groups
from .buckets import rebuild
from .buckets.arena import SingleLaunch
from .buckets.param_table import ParamTable
from .buckets.registry import ShardRegistry
from .buckets.shard import BucketShard
from .buckets.topology import Topology
from .comm.profiling import range_push
from .comm.scratch import Scratch
from .comm.streams import SideStream
from .local import LocalModule
from .members import Member, MemberView, Ranks, StateLayout
from .reducing import hooks
from .reducing.reduction import Reduction
from .reducing.weight_watch import WeightWatch
from .step_end.amp import ScalerLink
from .step_end.iteration import Iteration
from .step_end.step_graph import StepGraph, check_capturable
from .step_end.step_policy import StepPolicy
from .step_end.stepping import Stepping
from .updating.step_counts import StepCounts
from .updating.updates import Updates
from .updating.warmup import compile_kernels


class Engine:
    """Everything the fused_zero optimizers over one DDP module do, behind the torch.optim interface (see
    optimizer/): one optimizer in most programs, several (Muon beside AdamW) as *members*
    (pipeline/members.py).

    Attributes (the main ones):
        members: the optimizers (Member), in the order they attached.
        params, member_of, group_of, pid_of, state_formats: the parameters DDP reduces (requiring grad),
            their member and param group there, their index, their state format. A parameter no
            fused_zero optimizer updates has member ``NO_MEMBER`` (fused_zero/params.py): reduced as DDP
            reduces it, its ``.grad`` DDP's average, and left to its owner (a torch.optim optimizer, or
            none); ``parameters`` holds them, the one table the stages read (buckets/param_table.py).
        steps / step_counts: each parameter's step count (replicated on every rank), kept and counted
            on the device; ``steps`` reads it to the host, a wait only checkpoints make (step_counts.py).
        registry: which BucketShard holds each parameter's state (ShardRegistry).
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
        stepping: the members' ``step()``, the iteration's start and end (stepping.py; ``iteration``).
        max_grad_norm: what the next update clips to (``clip_to`` changes it for a step).
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
        self.parameters = ParamTable(self.params, self.pid_of, self.member_of, self.group_of, self.state_formats,
                                     self.members)
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
            check_capturable(self.options, self.side, ddp)
        # what the device work writes besides the state: kept across steps where a graph replays it
        self.scratch = Scratch(self.device, kept=capturable)
        self.graph = StepGraph(self.side) if capturable else None
        self.step_counts = StepCounts(len(self.params), self.side)
        self.skipped = torch.zeros(len(self.members), dtype=torch.int64, device=self.device)
        self.reduction = Reduction(ddp, self.params, topo, self.options, self.side)
        self.registry = ShardRegistry(
            self.params, state_names=[m.algo.state_names() for m in self.members],
            keeps_master=self.options.keeps_master, upload=self.side.upload if self.backend == "triton" else None,
            device=self.device, topology=topo, members=self.member_of, state_formats=self.state_formats)
        # backward and step modes: one launch per step, dtype, member and format once DDP's buckets are stable
        self.single_launch = SingleLaunch(self.registry, self.backend) if self.overlap != "bucket" else None
        self.updates = Updates(self.parameters, self.options, topology=topo, reduction=self.reduction,
                               side=self.side, scratch=self.scratch, step_counts=self.step_counts, graph=self.graph,
                               single_launch=self.single_launch, backend=self.backend)
        self.policy = StepPolicy(self.parameters, self.options, local=self.local, registry=self.registry,
                                 topology=topo, side=self.side)
        if self.backend == "triton":
            compile_kernels(self.parameters, self.options, self.side)  # warmup.py
        self._rebuild_pending = functools.partial(rebuild.pending, ddp, self.local)
        # what the hooks reach, held weakly by them (hooks.py)
        self._targets = hooks.HookTargets(
            on_bucket=self.on_bucket, synchronize=self.synchronize,
            check_refusals=functools.partial(self.policy.refusals.check, wait=False), side=self.side,
            registry=self.registry, watch=self.policy.watch)
        self._handles, self._module_handles = [], []
        self._install()
        self.weights = WeightWatch(self.params, [m != NO_MEMBER for m in self.member_of])
        self.stepping = Stepping(
            self.parameters, self.options, side=self.side, scratch=self.scratch, skipped=self.skipped,
            registry=self.registry, weights=self.weights, single_launch=self.single_launch, reduction=self.reduction,
            updates=self.updates, policy=self.policy,
            encode_if_final=functools.partial(rebuild.encode_if_final, self.registry, ddp, self.local),
            drive=functools.partial(ddp.drive, self.parameters, self.reduction.used_local, self.on_bucket)
            if self.local else None)

    def _install(self) -> None:
        """The mutations, once everything is checked: parameters become views of the flat buffers,
        then the hooks are registered, the comm hook last (DDP cannot remove it). Should anything
        fail on the way, the parameters get their own storage back and the hooks are removed."""
        storages = [p.data for p in self.params]
        try:
            self.registry.install_initial_layout(self.ddp.module, self.pid_of)
            self._hook_modules()
            hooks.register(self.ddp, self._targets, self._handles)
        except BaseException:
            self.close()
            for p, data in zip(self.params, storages):
                p.data = data
            raise

    def _hook_modules(self) -> None:
        """The hooks on the module and its parameters (hooks.register_module_hooks), made anew for the
        parameters a fused_zero optimizer updates."""
        for handle in self._module_handles:
            handle.remove()
        self._module_handles = []
        gathered = {p: pid for p, pid in self.pid_of.items() if self.member_of[pid] != NO_MEMBER}
        used = self.reduction.used_local if self.reduction.track_used else None
        hooks.register_module_hooks(self.ddp.module, self._targets, gathered, used, self._module_handles)

    @property
    def layout_changes(self) -> int:
        return self.registry.layout_changes

    @property
    def iteration(self) -> Iteration:
        """This iteration's progress (step_end/iteration.py)."""
        return self.stepping.iteration

    @property
    def grad_sumsq(self) -> torch.Tensor | None:
        """The global sum of squares of the last update's reduced, unscaled gradients (Updates.grad_sumsq)."""
        return self.updates.grad_sumsq

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

    def view(self, member: Member) -> MemberView:
        """``member``'s share as the checkpoint side reads it (members.py), made from the table as it is now."""
        layout = StateLayout(member, self.registry, self.weights, self._rebuild_pending)
        ranks = Ranks(self.world, self.rank, self.group, self.device, self.topology)
        return MemberView(member, self.parameters, ranks, layout, step_counts=self.step_counts, side=self.side,
                          stepping=self.stepping)

    # ------------------------------------------------------------------ the members' calls

    def step(self, member: Member, via_scaler: bool = False, grad_scale: torch.Tensor | None = None) -> None:
        """A member's ``step()`` (stepping.py), clipped to ``max_grad_norm`` as it is now."""
        self.stepping.step(member, self.max_grad_norm, via_scaler, grad_scale)

    def state_init_step(self, member: Member) -> None:
        """torch.distributed.checkpoint's state initialization of ``member`` (Stepping.state_init_step)."""
        self.stepping.state_init_step(member, self.max_grad_norm)

    def clip_to(self, max_norm: float | None) -> None:
        """The ``max_grad_norm`` the next updates clip to (overlap="step": from the next ``step()``)."""
        self.max_grad_norm = max_norm

    def check_joining(self, member: Member, params: list) -> list[int]:
        """The indices of ``params``, a param group joining ``member``, once checked (added_groups.py)."""
        return added_groups.check_joining(self.parameters, self.iteration, self.options, member, params)

    def join_group(self, member: Member, pids: list[int], default_format: str) -> None:
        """``pids`` join ``member`` (added_groups.py), once every all-gather is waited for."""
        self.synchronize()
        added_groups.join(self.parameters, member, pids, default_format, ddp=self.ddp, registry=self.registry,
                          weights=self.weights, updates=self.updates)
        self._hook_modules()

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
        stepping = self.stepping
        if stepping.iteration.invoked == 0 or stepping.iteration.last_invoked:  # the first bucket of a backward
            self.policy.refusals.check(wait=False)  # one another rank made known, before any collective
        if stepping.iteration.last_invoked:  # a synced backward before every member stepped after the last one
            stepping.backward_before_steps()  # accumulated (step + all_reduce) or refused (stepping.py)
        iteration = stepping.iteration
        if iteration.hparams is None:
            stepping.start_iteration(iteration)  # joins the side stream: the previous iteration's copies may go
        if shard is None:
            shard = self.registry.shard_for(index, pids, offsets, buffer)
        if shard.held and not self._rebuild_pending():  # DDP's buckets are final: encode once, before the update
            shard.encode_held()
        with range_push("fused_zero.reduce"):
            reduced = self.reduction.start(shard, buffer)
        shard.reduced_buffer = reduced.grad  # a staging copy lives with ``reduced`` until the iteration's end
        iteration.ready.append(reduced)
        iteration.invoked += 1
        iteration.last_invoked = bucket.is_last()
        if iteration.last_invoked:
            if not self.local:  # handed from step(): the gradients are read as they are then
                self.policy.watch.arm()
            if self.scaler is not None and self.scaler.enabled:
                if self.overlap == "backward":
                    iteration.grad_scale = self.scaler.scale()
                for m in self.members:
                    m.scaler.prepare(self.device)
        if self.overlap == "bucket":
            keep = 0 if (iteration.last_invoked or self.side.asynchronous) else 1
            self.updates.finish(iteration, len(iteration.ready) - keep, each_bucket=True)
        elif self.overlap == "backward" and iteration.last_invoked:
            self.updates.finish(iteration, len(iteration.ready), self.max_grad_norm)
        return self.reduction.future(reduced)

    def synchronize(self) -> None:
        """Wait for every pending all-gather: parameters are up to date for any reader after this."""
        self.stepping.synchronize()

    def close(self) -> None:
        for h in self._module_handles + self._handles:
            h.remove()
        self._handles, self._module_handles = [], []
