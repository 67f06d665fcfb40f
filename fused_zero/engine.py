"""One iteration's pipeline behind the optimizer classes: reduce -> update -> gather, driven by DDP's
comm hook, and ``step()`` ending the iteration.

DDP hands every bucket of gradients to the comm hook in bucket order; the hook starts its reduction
(reduce-scatter of the head plus an all-reduce of the small tail, or one all-reduce), and, when the
overlap mode says so, waits for it, runs the fused update on this rank's region and starts the
all-gather of the updated slices into the flat parameter buffer. ``step()`` ends the iteration; the
all-gathers are waited for there or by the forward pre-hooks.

The rest lives beside it: the options and their checks (options.py), which shard holds which
parameter and resharding (registry.py), the side stream (streams.py), the hooks (hooks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from . import checkpoint, hooks
from .algorithms import Algorithm, UpdateArgs, clip_coefficient
from .amp import ScalerLink
from .arena import SingleLaunch
from .checkpoint_sync import CheckpointHandshake
from .collectives import all_gather, reduce_scatter
from .grad_watch import GradWatch
from .kernels import Segments
from .options import ShardingOptions, collect_params
from .profiling import range_push
from .registry import ShardRegistry
from .shard import BucketShard
from .step_counts import Pending, StepCounts
from .streams import SideStream


@dataclass
class _UsedFlags:
    """A bucket's "got a gradient on some rank" flags, being all-reduced on the update's device.

    ``table`` is int64 ``[2, k]``: row 0 the bucket's parameter indices, row 1 how many ranks produced
    a gradient for each (all-reduced in place; the Work is among the bucket's Works). The update folds
    row 1 into column 0 ("active") of the coefficient table on the device: no host sync in the backward.
    """

    table: torch.Tensor


@dataclass
class _Reduced:
    """A bucket whose reduction has been started: its shard, the parameters that got a gradient (known
    on the host, or being all-reduced) and the Works to wait for."""

    shard: BucketShard
    active: np.ndarray | _UsedFlags
    works: list


@dataclass
class _Unit:
    """One update launch: its rows (and norm rows), coefficient table and buffers, and the buckets it
    updates with their device-side used flags (or None)."""

    rows: list
    segments: object
    norm_rows: list
    norm_segments: object
    table: torch.Tensor
    grad: object
    param: torch.Tensor
    state: dict
    items: list


@dataclass
class _Iteration:
    """What one synced backward has done so far; replaced when ``step()`` ends it.

    Attributes:
        hparams: param groups' hyperparameters, read at the iteration's first bucket.
        coefs: the per-parameter coefficient table of this iteration (every parameter active), on the
            update's device; built once, shared by every bucket's launch.
        invoked: buckets handed to the hook.
        last_invoked: the hook has seen DDP's last bucket.
        ready: buckets whose reduction was started but which are not updated yet.
        grad_scale: the loss scale the reduced gradients carry (GradScaler), or None.
        found_inf: one-element device flag, non-zero once an update of this iteration was skipped
            (non-finite gradients on some rank, or a user's edit to ``.grad`` that cannot be honored).
        edited: a user's edit to ``.grad`` (``overlap="step"``: this rank's, then any rank's on CPU).
    """

    hparams: list[dict] | None = None
    coefs: torch.Tensor | None = None
    invoked: int = 0
    last_invoked: bool = False
    ready: list[_Reduced] = field(default_factory=list)
    grad_scale: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    edited: bool = False


class Engine:
    """Everything one fused_zero optimizer does, behind the torch.optim interface (see optimizer.py).

    Attributes (the main ones):
        params, group_of, pid_of: the parameters updated (requiring grad), their param group, their index.
        steps / step_counts: each parameter's step count, on the host (replicated on every rank);
            the last updates' counts are settled from device flags when next needed (step_counts.py).
        registry: which BucketShard holds each parameter's state (ShardRegistry).
        iteration: this iteration's progress (_Iteration).
        side: the side stream the updates run on (SideStream; inline on CPU).
        scaler: the user's GradScaler (ScalerLink), or None.
        skipped: steps skipped for non-finite gradients, a device counter (read: ``skipped_steps``).
        watch: notices a user's edits to ``.grad`` between backward and step() (GradWatch).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, ddp, algorithm: Algorithm, **options):
        """Validate, then mutate: every check that can refuse runs before the first change to the
        model or the DDP module (rebinding parameters to the flat buffers, registering hooks), so a
        refused optimizer leaves a working model, and a working optimizer, as they were."""
        self.options = ShardingOptions(**options)
        self.opt = optimizer
        self.ddp = ddp
        self.algo = algorithm
        self.overlap = self.options.overlap
        self.grad_reduce = self.options.grad_reduce
        self.max_grad_norm = self.options.max_grad_norm
        self.param_sync = self.options.param_sync
        self.on_nonfinite = self.options.on_nonfinite
        scaler = self.options.grad_scaler
        self.scaler = ScalerLink(scaler, optimizer) if scaler is not None else None
        self.group = ddp.process_group
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)

        self.params, self.group_of = collect_params(optimizer.param_groups, ddp)
        self.pid_of = {p: i for i, p in enumerate(self.params)}
        self.device = self.params[0].device
        self.backend = self.options.resolved_backend(self.device)
        hooks.check_no_comm_hook(ddp)
        self.step_counts = StepCounts(len(self.params))
        # what the kernel divides each parameter's reduced gradient by: 1 where the reduction averaged
        self.grad_div = np.array([1.0 if self._pre_divides(p.dtype) else float(self.world) for p in self.params])
        self.side = SideStream(self.device)
        self.iteration = _Iteration()
        self.skipped = torch.zeros((), dtype=torch.int64, device=self.device)
        self.watch = GradWatch(self.params)
        self.registry = ShardRegistry(
            self.params, state_names=algorithm.state_names(), keeps_master=self.options.keeps_master,
            build_segments=self.backend == "triton", device=self.device, group=self.group,
            world=self.world, rank=self.rank)

        self.track_used = bool(ddp.find_unused_parameters or getattr(ddp, "static_graph", False))
        self.used_local = np.zeros(len(self.params), dtype=bool)
        self.used_static: np.ndarray | None = None  # static graph: the global used map, once known
        self.checkpoint_sync = CheckpointHandshake(self, self.options.checkpoint_handshake)
        # backward and step modes: one launch per step and dtype once DDP's buckets are stable
        self.single = SingleLaunch(self.registry, self.backend) if self.overlap != "bucket" else None
        if self.backend == "triton":
            self._compile_kernels()
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
        return int(self.skipped)

    @property
    def steps(self) -> np.ndarray:
        """Each parameter's step count (numpy, writable in place), with every update so far counted."""
        return self.step_counts.settled

    @steps.setter
    def steps(self, value) -> None:  # ``engine.steps += 1`` (in place on the array, then assigned)
        self.step_counts.replace(value)

    def shards(self) -> list[BucketShard]:
        return self.registry.shards()

    def _compile_kernels(self) -> None:
        """Launch each kernel variant once on a one-element dummy with every parameter inactive, so that
        Triton compiles now and not inside the first backward (tens of ms per variant). On the side
        stream, under the parameters' device guard, like every launch. Per dtype, before any shard
        exists: construction compiles before it changes anything."""
        with self.side.run(follow_current=True):
            for dtype in {p.dtype for p in self.params}:
                self._compile_for(dtype)

    def _compile_for(self, dtype: torch.dtype) -> None:
        one = lambda dt=torch.float32: torch.zeros(1, dtype=dt, device=self.device)  # noqa: E731
        names = self.algo.state_names() + (["master"] if self.options.keeps_master(dtype) else [])
        state = {name: one() for name in names}
        coefs = self.algo.coefficients(self._read_hparams(), np.zeros(1, dtype=np.int64), np.ones(1),
                                       np.zeros(1, dtype=bool), 1.0).to(self.device)
        rows = [(0, 1, 0, 0, 0)]
        segments = Segments.build(rows, self.device)
        clip = one() if self.max_grad_norm is not None else None
        scale = one() if self.scaler is not None else None
        self.algo.update("triton", rows, segments, coefs, UpdateArgs(
            one(dtype), one(dtype), state, grad_scale=scale, found_inf=one(), clip_coef=clip))
        self.algo.grad_sumsq("triton", rows, segments, coefs, one(dtype), scale)

    # ------------------------------------------------------------------ the comm hook

    def on_bucket(self, bucket) -> torch.futures.Future:
        """The comm hook: start this bucket's reduction; update the buckets whose turn has come.

        Every collective is issued here, on the autograd thread, or in ``step()``, in bucket order:
        all ranks then issue the same collectives in the same order, which gloo and NCCL both need
        (callbacks on communication threads would race). On CUDA, waiting for a reduction is a stream
        wait, so a bucket is updated as soon as it is handed over; on CPU a wait blocks the host, so a
        bucket is updated when the next one arrives, and its reduction overlaps the backward between.
        With ``grad_reduce="all_reduce"`` the returned future is the all-reduce's, as DDP's own
        ``allreduce_hook`` returns: DDP's ``finalize_backward`` waits for it (a stream wait on CUDA)
        before it reads the bucket into ``param.grad``, so ``param.grad`` is DDP's average in every
        overlap mode. Its callback only hands the buffer back; it issues nothing. With
        ``reduce_scatter`` (gloo's has no future) the future is complete: no rank holds the whole
        average, and ``param.grad`` is documented as unreduced.
        """
        index, buffer = bucket.index(), bucket.buffer()
        shard = self.registry.cached(index, buffer)
        if shard is None:  # a bucket not seen before (DDP's first iterations): read it in full
            pids, offsets = self.registry.read_bucket(bucket, buffer, self.pid_of)
        if self.iteration.last_invoked:
            if self.overlap == "step" and self.iteration.ready:
                raise RuntimeError("a synced backward ran twice without optimizer.step() in between; "
                                   "with overlap='step' accumulate gradients under ddp.no_sync()")
            self.iteration = _Iteration()
        it = self.iteration
        if it.hparams is None:
            checkpoint.serve_lone_state_dicts(self)  # before this iteration's first collective
            self.side.join()
            it.hparams = self._read_hparams()
        if shard is None:
            shard = self.registry.shard_for(index, pids, offsets, buffer)
        active, works = self._active(shard)
        with range_push("fused_zero.reduce"):
            works += self._reduce(shard, buffer)
        shard.reduced_buffer = buffer
        it.ready.append(_Reduced(shard, active, works))
        it.invoked += 1
        it.last_invoked = bucket.is_last()
        if it.found_inf is None:
            it.found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        if it.last_invoked:
            self.watch.arm()
            if self.scaler is not None and self.scaler.enabled:
                if self.overlap == "backward":
                    it.grad_scale = self.scaler.scale()
                self.scaler.prepare(it.found_inf)
        if self.overlap == "bucket":
            keep = 0 if (it.last_invoked or self.side.stream is not None) else 1
            self._finish(it, len(it.ready) - keep)
        elif self.overlap == "backward" and it.last_invoked:
            self._finish(it, len(it.ready), self.max_grad_norm)
        if self.grad_reduce == "all_reduce" and self.world > 1:
            return works[-1].get_future().then(lambda _: buffer)
        return shard.completed(buffer)

    def _read_hparams(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]

    def _active(self, shard: BucketShard) -> tuple[np.ndarray | _UsedFlags, list]:
        """Which of the bucket's parameters got a gradient on some rank (torch.optim skips the rest),
        and the Works to wait for before that is known.

        Where it is not known on the host, the local flags go to the device and are all-reduced
        asynchronously, in the hook like every collective: no host sync per bucket."""
        pids = shard.pids
        if not self.track_used:
            return shard.all_active, []
        if self.used_static is not None:
            return self.used_static[pids], []
        local = torch.from_numpy(np.stack([pids, self.used_local[pids]]).astype(np.int64))
        with self.side.run(follow_current=False):
            table = self.side.upload(local)
            works = [dist.all_reduce(table[1], group=self.group, async_op=True)] if self.world > 1 else []
        return _UsedFlags(table), works

    def _used_on_any_rank(self, pids: np.ndarray) -> np.ndarray:
        """All-reduce the local "got a gradient" flags of ``pids`` (a host sync on CUDA)."""
        flags = torch.from_numpy(self.used_local[pids].astype(np.int32)).to(self.device)
        if self.world > 1:
            dist.all_reduce(flags, group=self.group)
        return flags.cpu().numpy() > 0

    def _pre_divides(self, dtype: torch.dtype) -> bool:
        """Divide before summing, as DDP does, wherever rounding or range make it matter: for all-reduce
        (so param.grad is DDP's average) and for low-precision gradients (DDP's rounding, and no fp16
        overflow). fp32 reduce-scatter sums leave the division to the kernel: a pass over the bucket
        saved."""
        return self.grad_reduce == "all_reduce" or dtype != torch.float32

    def _reduce(self, shard: BucketShard, buffer: torch.Tensor) -> list:
        """Start this bucket's reduction, in place in DDP's buffer; return its Works.

        reduce_scatter: the head is reduce-scattered into this rank's own slice of it (the output is
        a chunk of the input, as Megatron-core does; gloo and NCCL accept it) and the tail is
        all-reduced where it is, so the kernel reads the reduced gradient from the bucket buffer and
        no gradient copy exists. The other ranks' slices are left holding this rank's local
        (pre-divided) gradients: ``param.grad`` is not the global gradient in this mode.
        """
        if self.world == 1:
            return []
        layout, g = shard.layout, self.group
        if self._pre_divides(buffer.dtype):
            buffer.div_(self.world)
        works = []
        if self.grad_reduce == "all_reduce":
            works.append(dist.all_reduce(buffer, group=g, async_op=True))
        else:
            if layout.tail:
                works.append(dist.all_reduce(buffer[layout.head:], group=g, async_op=True))
            if layout.shard:
                lo, hi = layout.slice_of(self.rank)
                works.append(reduce_scatter(buffer[lo:hi], buffer[:layout.head], group=g, async_op=True))
        return works

    # ------------------------------------------------------------------ update

    def _finish(self, it: _Iteration, count: int, max_norm: float | None = None, follow: bool = False) -> None:
        """Wait for the first ``count`` ready reductions and update those buckets.

        On CUDA the waits are made by the side stream, so the backward's own stream never waits
        for communication. ``follow``: the side stream also waits for the current stream (the update
        reads something queued there after the backward: the user's edit of ``.grad``, GradScaler's
        scale tensor).
        """
        todo, it.ready = it.ready[:count], it.ready[count:]
        if not todo:
            return
        with self.side.run(follow_current=self.world == 1 or follow):
            for item in todo:
                for w in item.works:
                    w.wait()
            self._update(it, todo, max_norm)

    def _coefficient_table(self, hparams: list[dict], active: np.ndarray) -> torch.Tensor:
        """Every parameter's update scalars for this step, one row per parameter (host float32)."""
        return self.algo.coefficients(hparams, self.group_of, self.step_counts.settled + active, active, self.grad_div)

    def _coefs_for(self, it: _Iteration, shard: BucketShard,
                   active: np.ndarray | _UsedFlags) -> tuple[torch.Tensor, tuple | None]:
        """The table a bucket's update reads: the iteration's shared one (every row active), with this
        bucket's rows of column 0 set from all-reduced flags on the device, or a table of its own where
        the host knows that some parameter of the bucket got no gradient. With device flags, also the
        started host copy of them (for the step counts)."""
        if it.coefs is None:  # the iteration's first table, before any of its updates
            self.step_counts.settle()
            it.coefs = self.side.upload(self._coefficient_table(it.hparams, np.ones(len(self.params))))
        if isinstance(active, _UsedFlags):  # runs on the side stream, after the flags' all-reduce
            pids, used = active.table[0], active.table[1]
            it.coefs[:, 0].index_copy_(0, pids, (used > 0).to(it.coefs.dtype))
            return it.coefs, self.side.download(used)
        if active.all():
            return it.coefs, None
        mask = np.ones(len(self.params))
        mask[shard.pids] = active
        return self.side.upload(self._coefficient_table(it.hparams, mask)), None

    def _update(self, it: _Iteration, items: list[_Reduced], max_norm: float | None = None) -> None:
        """Update ``items`` unless some rank's reduced gradients of them are not finite (then nothing
        is written, on every rank, and their step counts stay).

        One launch per bucket, or, once the shards sit in arenas (backward and step modes, see
        arena.py), one per dtype over all of them; the checks, the updates and the bookkeeping are the
        same for both."""
        coefs, used = zip(*(self._coefs_for(it, item.shard, item.active) for item in items))
        for item in items:
            item.shard.wait_gather()
        units = self._launch_units(it, items, coefs, used)
        found, clip = self._check(it, units, max_norm)
        torch.maximum(it.found_inf, found, out=it.found_inf)
        skipped = self.side.download(found)  # read at the next iteration: the kernels read ``found``
        for unit in units:
            with range_push("fused_zero.update"):
                self.algo.update(self.backend, unit.rows, unit.segments, unit.table, UpdateArgs(
                    unit.grad, unit.param, unit.state, grad_scale=it.grad_scale, found_inf=found,
                    clip_coef=clip))
            self.side.mark_updated()
            for item, flags in unit.items:
                shard = item.shard
                shard.reduced_buffer = None
                self.step_counts.add(Pending(
                    shard.pids, None if flags is not None else item.active, flags, skipped))
                self._start_gather(shard)  # a skipped update gathers the unchanged parameters

    def _launch_units(self, it: _Iteration, items: list[_Reduced], coefs: tuple, used: tuple) -> list[_Unit]:
        """The launches that update ``items``: one per dtype when the arenas hold exactly these shards
        and one coefficient table serves them all, else one per bucket."""
        launches = self.single.for_step([item.shard for item in items]) if self.single else None
        table = self._one_table(it, items, coefs) if launches is not None else None
        if table is None:
            return [_Unit(s.rows, s.segments, s.norm_rows, s.norm_segments, t, s.reduced_buffer, s.param_buffer,
                          s.state, [(item, flags)])
                    for item, t, flags, s in zip(items, coefs, used, (item.shard for item in items))]
        return [_Unit(launch.rows, launch.segments, launch.norm_rows, launch.norm_segments, table,
                      launch.grad(buffers), launch.arena.params, launch.arena.state,
                      [(item, flags) for item, flags in zip(items, used)
                       if item.shard.param_buffer.dtype == launch.arena.params.dtype])
                for launch, buffers in launches]

    def _one_table(self, it: _Iteration, items: list[_Reduced], coefs: tuple) -> torch.Tensor | None:
        """One coefficient table for every bucket of the step (a parameter is in one bucket only): the
        iteration's shared one, or one built from the host's flags where some parameter is known to
        have no gradient; None where neither fits (then one launch per bucket)."""
        if all(t is coefs[0] for t in coefs):
            return coefs[0]
        if any(isinstance(item.active, _UsedFlags) for item in items):
            return None
        mask = np.ones(len(self.params))
        for item in items:
            mask[item.shard.pids] = item.active
        return self.side.upload(self._coefficient_table(it.hparams, mask))

    def _check(self, it: _Iteration, units: list[_Unit],
               max_norm: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass over this rank's reduced slices of ``units`` (unscaled by the loss scale): the
        sum of squares and the count of non-finite values, all-reduced with this rank's edit flag in
        one collective. Returns the skip flag and, with ``max_norm``, the clip coefficient (device
        tensors: no host sync)."""
        stats = torch.zeros(3, dtype=torch.float32, device=self.device)
        for unit in units:
            sumsq, bad = self.algo.grad_sumsq(self.backend, unit.norm_rows, unit.norm_segments, unit.table,
                                              unit.grad, it.grad_scale)
            stats[0] += sumsq
            stats[1] += bad
        stats[2] = float(it.edited)
        if self.world > 1:  # waited for by the side stream on CUDA, like the reductions
            dist.all_reduce(stats, group=self.group, async_op=True).wait()
        found = (stats[1:] > 0).any().to(torch.float32).reshape(1)
        it.edited = bool(stats[2] > 0) if self.device.type == "cpu" else it.edited
        clip = clip_coefficient(stats[0], max_norm) if max_norm is not None else None
        return found, clip

    def _host_flag(self, flag: torch.Tensor) -> bool:
        """A device flag on the host: a synchronization on CUDA, paid only by on_nonfinite='raise'."""
        return bool(flag)

    def _start_gather(self, shard: BucketShard) -> None:
        layout = shard.layout
        if self.world == 1 or layout.shard == 0:
            return
        lo, hi = layout.slice_of(self.rank)
        with range_push("fused_zero.all_gather"):
            shard.gather = all_gather(
                shard.param_buffer[:layout.head], shard.param_buffer[lo:hi], group=self.group,
                async_op=True)

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
        self._check_scaler_use(via_scaler)
        edited = self.watch.edited()
        self.watch.clear()
        if via_scaler and grad_scale is None and self.overlap == "step" and self.scaler is not None:
            # the user's scaler.unscale_(opt) divided param.grad in place, with a fused op that leaves
            # the version counters as they were: every gradient counts as edited
            edited = sorted(set(edited) | {i for i, p in enumerate(self.params) if p.grad is not None})
        honored = bool(edited) and self.overlap == "step" and self.grad_reduce == "all_reduce"
        if honored:
            self._write_back(it, edited)  # this mode reads param.grad's values: the edit is honored
            edited = []
        if self.overlap == "step":  # the updates run now: hyperparameters as they are now
            it.hparams, it.coefs = self._read_hparams(), None
            if self.scaler is not None and self.scaler.enabled:
                it.grad_scale = None if grad_scale is None else grad_scale.reshape(1)
            it.edited = bool(edited)
            self._finish(it, len(it.ready), self.max_grad_norm, follow=honored or it.grad_scale is not None)
            edited_anywhere = it.edited
        else:
            edited_anywhere = self._any_rank(bool(edited))
        if self.scaler is not None and self.scaler.enabled:
            self.scaler.publish(it.found_inf)
        self.skipped += it.found_inf.to(torch.int64).reshape(())
        if self.single is not None and self.single.step_ended():
            self.synchronize()  # nothing may be pending on the shards while they move
            self.single.pack()
            with self.side.run(follow_current=True):  # later updates after the moves
                pass
        if self.track_used and self.used_static is None and getattr(self.ddp, "static_graph", False):
            self.used_static = self._used_on_any_rank(np.arange(len(self.params)))
        self.used_local[:] = False
        self.iteration = _Iteration()
        if self.param_sync == "step":
            self.synchronize()
        else:
            # the compute stream follows the updates (not the all-gathers): whatever runs before the
            # next forward, such as zero_grad(set_to_none=False) or DDP freeing its old buckets when
            # it rebuilds them, must not overwrite what an update still reads
            self.side.join_updates()
        if edited_anywhere:
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
        if self.on_nonfinite == "raise" and self.scaler is None and self._host_flag(it.found_inf):
            raise FloatingPointError(
                "the reduced gradients hold an inf or NaN on some rank; the step was skipped on every rank "
                "(on_nonfinite='raise'; on_nonfinite='skip' skips silently and counts skipped_steps)")

    def _check_scaler_use(self, via_scaler: bool) -> None:
        linked = self.scaler is not None and self.scaler.enabled
        if via_scaler and not linked:
            if self.overlap == "bucket":
                raise RuntimeError("torch.amp.GradScaler needs overlap='step' or overlap='backward' (with "
                                   "overlap='bucket' a bucket is updated before later buckets' overflow "
                                   "check is known); build the optimizer with one of them and grad_scaler=scaler")
            raise RuntimeError("scaler.step(optimizer) with a fused_zero optimizer that was not given the "
                               "scaler: build it with grad_scaler=scaler (the loss scale must be known when "
                               "the gradients are reduced)")
        if linked and not via_scaler:
            raise RuntimeError("this optimizer was built with grad_scaler=scaler: step it through "
                               "scaler.step(optimizer), then scaler.update()")

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank. On CPU an all-reduce (a host value anyway); on CUDA
        reading it back would synchronize the host, so there each rank answers for itself."""
        if self.world == 1 or self.device.type != "cpu":
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, group=self.group, async_op=True).wait()
        return bool(t[0] > 0)

    def _write_back(self, it: _Iteration, pids: list[int]) -> None:
        """Make the reduced buckets hold the user's edited ``param.grad`` (with gradient_as_bucket_view
        the edit is there already, unless ``.grad`` was replaced by another tensor)."""
        buffers = {id(item.shard): item.shard.reduced_buffer for item in it.ready}
        for pid in pids:
            shard, local = self.registry.where[pid]
            g = self.params[pid].grad
            if g is None:
                raise RuntimeError(f"param.grad of parameter {pid} was set to None between backward and step()")
            off, n = shard.layout.offsets[local], shard.layout.numels[local]
            view = buffers[id(shard)][off:off + n]
            if view.data_ptr() != g.data_ptr():
                view.copy_(g.reshape(-1))

    def synchronize(self) -> None:
        """Wait for every pending all-gather: parameters are up to date for any reader after this."""
        for shard in self.shards():
            shard.wait_gather()
        self.side.join()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
