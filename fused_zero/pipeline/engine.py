"""One iteration's pipeline behind the optimizer classes: reduce -> update -> gather, driven by DDP's
comm hook, and ``step()`` ending the iteration.

DDP hands every bucket of gradients to the comm hook in bucket order; the hook starts its reduction
(reduce-scatter of the head plus an all-reduce of the small tail, or one all-reduce), and, when the
overlap mode says so, waits for it, runs the fused update on this rank's region and starts the
all-gather of the updated slices into the flat parameter buffer. ``step()`` ends the iteration; the
all-gathers are waited for there or by the forward pre-hooks.

The stages live beside it: the reduction (reduction.py), the update and the all-gather (updates.py),
and what ``step()`` does with a user's edits of ``.grad`` and a GradScaler (step_policy.py); so do
which shard holds which parameter and resharding (registry.py), the side stream (streams.py) and the
hooks (hooks.py). The options and their checks are the public ones (fused_zero/options.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..kernels import Segments
from ..options import ShardingOptions, collect_params, group_state_formats
from ..update.algorithms import Algorithm, UpdateArgs
from ..update.formats import DTYPES
from . import hooks, rebuild
from .amp import ScalerLink
from .arena import SingleLaunch
from .local import LocalModule
from .profiling import range_push
from .reduction import Reduced, Reduction, UsedFlags
from .registry import ShardRegistry
from .shard import BucketShard
from .step_counts import StepCounts
from .step_policy import StepPolicy
from .streams import SideStream
from .topology import Topology
from .updates import Updates


@dataclass
class _Iteration:
    """What one synced backward has done so far; replaced when ``step()`` ends it.

    Attributes:
        hparams: param groups' hyperparameters, read at the iteration's first bucket.
        hparams_key: what they were then, to tell a later change (StepPolicy.hparams_key).
        coefs: the per-parameter coefficient table of this iteration (every parameter active), on the
            update's device; built once, shared by every bucket's launch.
        invoked: buckets handed to the hook.
        last_invoked: the hook has seen DDP's last bucket.
        ready: buckets whose reduction was started but which are not updated yet.
        grad_scale: the loss scale the reduced gradients carry (GradScaler), or None.
        found_inf: one-element device flag, non-zero once an update of this iteration was skipped
            (non-finite gradients on some rank, or a user's edit to ``.grad`` that cannot be honored).
        edited: a user's edit to ``.grad`` (``overlap="step"``: this rank's, then any rank's on CPU).
        staging: the buckets' copies in ``grad_reduce_dtype`` and the used flags' tables (the relay
            stream's), kept alive until ``step()`` has made the streams that allocated them wait for the
            side stream and the reductions using them.
    """

    hparams: list[dict] | None = None
    hparams_key: list | None = None
    coefs: torch.Tensor | None = None
    invoked: int = 0
    last_invoked: bool = False
    ready: list[Reduced] = field(default_factory=list)
    grad_scale: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    edited: bool = False
    staging: list = field(default_factory=list)


class Engine:
    """Everything one fused_zero optimizer does, behind the torch.optim interface (see optimizer.py).

    Attributes (the main ones):
        params, group_of, pid_of: the parameters updated (requiring grad), their param group, their index.
        steps / step_counts: each parameter's step count (replicated on every rank), kept and counted
            on the device; ``steps`` reads it to the host, a wait only checkpoints make (step_counts.py).
        registry: which BucketShard holds each parameter's state (ShardRegistry).
        iteration: this iteration's progress (_Iteration).
        side: the side stream the updates run on (SideStream; inline on CPU).
        scaler: the user's GradScaler (ScalerLink), or None.
        skipped: steps skipped for non-finite gradients, a device counter (read: ``skipped_steps``).
        reduction, updates: the pipeline's stages (reduction.py, updates.py).
        policy: what step() does with the user's edits of ``.grad`` and a GradScaler (step_policy.py).
        grad_sumsq: the global sum of squares of the last update's reduced, unscaled gradients (a device
            scalar; in overlap modes "step" and "backward", where one update covers every bucket: the
            pre-clip norm squared, which the integrations' clip_grad_norm_ returns), or None.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, ddp, algorithm: Algorithm, **options):
        """Validate, then mutate: every check that can refuse runs before the first change to the
        model or the DDP module (rebinding parameters to the flat buffers, registering hooks), so a
        refused optimizer leaves a working model, and a working optimizer, as they were."""
        self.options = ShardingOptions(**options)
        self.opt = optimizer
        self.ddp = ddp
        self.local = isinstance(ddp, LocalModule)  # a plain module: step() hands the buckets (local.py)
        self.algo = algorithm
        self.overlap = self.options.overlap
        self.grad_reduce = self.options.grad_reduce
        self.max_grad_norm = self.options.max_grad_norm
        self.param_sync = self.options.param_sync
        self.on_nonfinite = self.options.on_nonfinite
        scaler = self.options.grad_scaler
        self.scaler = ScalerLink(scaler, optimizer) if scaler is not None else None
        self.params, self.group_of = collect_params(optimizer.param_groups, ddp)
        self.options.check_params(self.params)
        self.pid_of = {p: i for i, p in enumerate(self.params)}
        self.group_formats = group_state_formats(optimizer.param_groups, self.options.state_format)
        self.state_formats = [self.group_formats[g] for g in self.group_of]
        self.device = self.params[0].device
        self.backend = self.options.resolved_backend(self.device)
        hooks.check_no_comm_hook(ddp)
        topo = self.topology = Topology.build(ddp.process_group, self.options.shard_group, self.device)
        self.group, self.world, self.rank = topo.group, topo.world, topo.rank
        topo.check_reduce_dtype(self.options.grad_reduce_dtype, self.device)
        self.side = SideStream(self.device)
        self.step_counts = StepCounts(len(self.params), self.side)
        self.iteration = _Iteration()
        self.skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        self.reduction = Reduction(self, ddp)
        self.updates = Updates(self)
        self.policy = StepPolicy(self)
        self.grad_sumsq: torch.Tensor | None = None
        self.holding = False  # some shard holds 8-bit moments in fp32 since a load (rebuild.py)
        self.registry = ShardRegistry(
            self.params, state_names=algorithm.state_names(), keeps_master=self.options.keeps_master,
            upload=self.side.upload if self.backend == "triton" else None, device=self.device, topology=topo,
            state_formats=self.state_formats)

        # backward and step modes: one launch per step, dtype and state format once DDP's buckets are stable
        self.single = SingleLaunch(self.registry, self.backend) if self.overlap != "bucket" else None
        if self.backend == "triton":
            compile_kernels(self)
        self._handles = []
        self._install()

    def _install(self) -> None:
        """The mutations, once everything is checked: parameters become views of the flat buffers,
        then the hooks are registered, the comm hook last (DDP cannot remove it). Should anything
        fail on the way, the parameters get their own storage back and the hooks are removed."""
        storages = [p.data for p in self.params]
        try:
            self.registry.install_initial_layout(self.ddp.module, self.pid_of)
            hooks.register(self, self._handles)
        except BaseException:
            self.close()
            for p, data in zip(self.params, storages):
                p.data = data
            raise

    @property
    def layout_changes(self) -> int:
        return self.registry.layout_changes

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank's reduced gradients held an inf or NaN (reading it waits
        for the device)."""
        self.side.join()
        return int(self.skipped)

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
        if self.iteration.last_invoked:  # a second synced backward: accumulated (step + all_reduce) or refused
            self.policy.check_second_backward()
            for item in self.iteration.ready:  # reduced again from the buckets DDP accumulated into
                for w in item.works:
                    w.wait()
            previous, self.iteration = self.iteration, _Iteration()  # noqa: F841 (alive until the join)
        it = self.iteration
        if it.hparams is None:
            self._start_iteration(it)  # joins the side stream: the previous iteration's copies may go
        if shard is None:
            shard = self.registry.shard_for(index, pids, offsets, buffer)
        if shard.held and not rebuild.pending(self):  # DDP's buckets are final: encode once, before the update
            shard.encode_held()
        with range_push("fused_zero.reduce"):
            reduced = self.reduction.start(shard, buffer)
        shard.reduced_buffer = reduced.grad  # a staging copy lives until step() joins the side stream:
        it.staging += [reduced.grad] if reduced.grad is not buffer else []
        it.staging += [reduced.active.table] if isinstance(reduced.active, UsedFlags) else []  # the relay's
        it.ready.append(reduced)
        it.invoked += 1
        it.last_invoked = bucket.is_last()
        if it.last_invoked:
            if not self.local:  # handed from step(): the gradients are read as they are then
                self.policy.watch.arm()
            if self.scaler is not None and self.scaler.enabled:
                if self.overlap == "backward":
                    it.grad_scale = self.scaler.scale()
                self.scaler.prepare(it.found_inf)
        if self.overlap == "bucket":
            keep = 0 if (it.last_invoked or self.side.asynchronous) else 1
            self.updates.finish(it, len(it.ready) - keep, each_bucket=True)
        elif self.overlap == "backward" and it.last_invoked:
            self.updates.finish(it, len(it.ready), self.max_grad_norm)
        return self.reduction.future(reduced)

    def _start_iteration(self, it: _Iteration) -> None:
        """The first bucket of a synced backward, before any of its collectives."""
        self.side.join()  # the compute stream after the last iteration's updates (resharding reads them)
        it.hparams = self._read_hparams()
        it.hparams_key = self.policy.hparams_key(self.opt.param_groups)
        # written here, read and maxed into by the side stream's checks: the side stream waits for it
        it.found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        self.side.follow()

    def _read_hparams(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]

    # ------------------------------------------------------------------ user-facing

    def step(self, via_scaler: bool = False, grad_scale: torch.Tensor | None = None) -> None:
        """End the iteration. ``via_scaler``: called by ``GradScaler.step()``, which passes the loss
        scale the gradients still carry (None after the user's ``scaler.unscale_``)."""
        it = self.iteration
        if it.invoked == 0:
            raise RuntimeError("optimizer.step() found no reduced gradients since the last step: run a "
                               "backward outside ddp.no_sync() (with require_backward_grad_sync=True) "
                               "before stepping")
        if not it.last_invoked:
            raise RuntimeError("optimizer.step() called while DDP is still reducing gradients")
        self.policy.check_scaler_use(via_scaler)
        edited, honored = self.policy.edits(via_scaler, grad_scale)
        if self.overlap == "step":  # the updates run now: hyperparameters as they are now
            it.hparams, it.coefs = self._read_hparams(), None
            if self.scaler is not None and self.scaler.enabled:
                it.grad_scale = None if grad_scale is None else grad_scale.reshape(1)
            it.edited = bool(edited)
            self.updates.finish(it, len(it.ready), self.max_grad_norm, follow=honored or it.grad_scale is not None)
            edited_anywhere, changed, changed_anywhere = it.edited, [], False
        else:  # the update ran with the hyperparameters of the first bucket
            changed = self.policy.hparams_changed(it.hparams_key)
            edited_anywhere, changed_anywhere = self.policy.any_rank(bool(edited), bool(changed))
        self._count_skip(it)
        if self.single is not None and self.single.step_ended():
            self.synchronize()  # nothing may be pending on the shards while they move
            self.single.pack()
            with self.side.run(follow_current=True):  # later updates after the moves
                pass
        self.reduction.end_step()
        self.iteration = _Iteration()
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

    def _count_skip(self, it: _Iteration) -> None:
        """The step's skip flag into the skipped-step counter and the GradScaler's found-inf tensors.
        Both read the flag that the side stream's checks wrote, so they are queued there, after the
        current stream (the user's ``scaler.unscale_`` wrote the scaler's tensors on it); ``step()``
        then orders the current stream after the side stream before anyone reads them."""
        with self.side.run(follow_current=True):
            if self.scaler is not None and self.scaler.enabled:
                self.scaler.publish(it.found_inf)
            self.skipped += it.found_inf.to(torch.int64).reshape(())

    def synchronize(self) -> None:
        """Wait for every pending all-gather: parameters are up to date for any reader after this."""
        for shard in self.shards():
            shard.wait_gather()
        self.side.join()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def compile_kernels(e: Engine) -> None:
    """Launch each kernel variant once on a one-element dummy with every parameter inactive, so that
    Triton compiles now and not inside the first backward (tens of ms per variant). On the side
    stream, under the parameters' device guard, like every launch. Per dtype and state format, before
    any shard exists: construction compiles before it changes anything."""
    with e.side.run(follow_current=True):
        for dtype, fmt in sorted({(p.dtype, f) for p, f in zip(e.params, e.state_formats)}, key=str):
            _compile_for(e, dtype, fmt)


def _compile_for(e: Engine, dtype: torch.dtype, fmt: str) -> None:
    one = lambda dt=torch.float32: torch.zeros(1, dtype=dt, device=e.device)  # noqa: E731
    moments = DTYPES[fmt]
    state = {name: one(moments) for name in e.algo.state_names()}
    if e.options.keeps_master(dtype):
        state["master"] = one()
    scales = {name: one() for name in e.algo.state_names()} if moments == torch.uint8 else None
    coefs = e.algo.coefficients(e._read_hparams(), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=bool), 1.0)
    coefs = e.side.upload(coefs)
    rows = [(0, 1, 0, 0, 0)]
    segments = Segments.build(rows, upload=e.side.upload)
    clip = one() if e.max_grad_norm is not None else None
    scale = one() if e.scaler is not None else None
    e.algo.update("triton", rows, segments, coefs, UpdateArgs(
        one(dtype), one(dtype), state, grad_scale=scale, found_inf=one(), clip_coef=clip, scales=scales,
        stochastic=e.options.stochastic_rounding))
    e.algo.grad_sumsq("triton", rows, segments, coefs, one(dtype), scale)
