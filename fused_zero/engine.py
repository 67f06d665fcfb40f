"""The machinery behind the optimizer classes: bucket shards, the reduce -> update -> gather pipeline
driven by DDP's comm hook, resharding when DDP rebuilds its buckets, and the forward waits.

One iteration (see ``Engine.on_bucket``): DDP hands every bucket of gradients to the comm hook in
bucket order; the hook starts its reduction (reduce-scatter of the head plus an all-reduce of the small
tail, or one all-reduce), and, when the overlap mode says so, waits for it, runs the fused update on
this rank's region and starts the all-gather of the updated slices into the flat parameter buffer.
``step()`` ends the iteration; the all-gathers are waited for there or by the forward pre-hooks.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from .algorithms import Algorithm, UpdateArgs, clip_coefficient
from .collectives import all_gather, reduce_scatter
from .kernels import Segments
from .layout import BucketLayout, reshard_plan
from .profiling import range_push
from .shard import BucketShard

OVERLAPS = ("bucket", "backward", "step")
GRAD_REDUCES = ("reduce_scatter", "all_reduce")
BACKENDS = ("auto", "triton", "torch")
PARAM_SYNCS = ("step", "forward")


@dataclass
class _Reduced:
    """A bucket whose reduction has been started: its shard, the parameters that got a gradient and
    the Works to wait for."""

    shard: BucketShard
    active: np.ndarray
    works: list


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
    """

    hparams: list[dict] | None = None
    coefs: torch.Tensor | None = None
    invoked: int = 0
    last_invoked: bool = False
    ready: list[_Reduced] = field(default_factory=list)


class Engine:
    """Everything one fused_zero optimizer does, behind the torch.optim interface (see optimizer.py).

    Attributes (the main ones):
        params, group_of, pid_of: the parameters updated (requiring grad), their param group, their index.
        steps: each parameter's step count, on the host (replicated on every rank).
        where: parameter index -> (the BucketShard holding its state, its index in that bucket).
        by_index: DDP bucket index -> BucketShard.
        iteration: this iteration's progress (_Iteration).
        stream: the side stream the updates run on (CUDA), else None.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, ddp, algorithm: Algorithm, *,
                 grad_reduce: str = "reduce_scatter", overlap: str = "bucket", master_weights: bool | None = None,
                 max_grad_norm: float | None = None, param_sync: str = "step", backend: str = "auto"):
        _check_choice("overlap", overlap, OVERLAPS)
        _check_choice("grad_reduce", grad_reduce, GRAD_REDUCES)
        _check_choice("param_sync", param_sync, PARAM_SYNCS)
        _check_choice("backend", backend, BACKENDS)
        if max_grad_norm is not None:
            if overlap != "step":
                raise ValueError("max_grad_norm needs overlap='step': the global norm is known only once "
                                 "every bucket is reduced, after the other modes have updated")
            if not max_grad_norm > 0:
                raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        self.opt = optimizer
        self.ddp = ddp
        self.algo = algorithm
        self.overlap = overlap
        self.grad_reduce = grad_reduce
        self.max_grad_norm = max_grad_norm
        self.param_sync = param_sync
        self.group = ddp.process_group
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)

        self.params, self.group_of = _collect_params(optimizer.param_groups, ddp)
        self.pid_of = {p: i for i, p in enumerate(self.params)}
        self.device = self.params[0].device
        self.backend = _resolve_backend(backend, self.device)
        self.master_weights = master_weights
        self.steps = np.zeros(len(self.params), dtype=np.float64)
        # what the kernel divides each parameter's reduced gradient by: 1 where the reduction averaged
        self.grad_div = np.array([1.0 if self._pre_divides(p.dtype) else float(self.world) for p in self.params])
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.iteration = _Iteration()
        self.where: dict[int, tuple[BucketShard, int]] = {}
        self.by_index: dict[int, BucketShard] = {}
        self.layout_changes = 0

        self.track_used = bool(ddp.find_unused_parameters or getattr(ddp, "static_graph", False))
        self.used_local = np.zeros(len(self.params), dtype=bool)
        self.used_static: np.ndarray | None = None  # static graph: the global used map, once known
        self._handles = []
        self._install_initial_layout()
        self._register_hooks()
        if self.backend == "triton":
            self._compile_kernels()

    # ------------------------------------------------------------------ layout and state

    def _install_initial_layout(self) -> None:
        """State for one bucket holding every parameter in registration order: what DDP hands the
        hook in its first iteration. Any other bucket reshards from it when it arrives."""
        by_dtype: dict[torch.dtype, list[int]] = {}
        for p in self.ddp.module.parameters():  # registration order, as DDP's first bucket
            if p in self.pid_of:
                by_dtype.setdefault(p.dtype, []).append(self.pid_of[p])
        for index, pids in enumerate(by_dtype.values()):
            numels = [self.params[i].numel() for i in pids]
            offsets = np.concatenate([[0], np.cumsum(numels)[:-1]]).tolist()
            layout = BucketLayout.build(pids, numels, offsets, self.world, self.rank)
            shard = self._new_shard(layout)
            shard.bind_params()
            shard.init_master_from_params()
            for local, pid in enumerate(pids):
                self.where[pid] = (shard, local)
            self.by_index[-1 - index] = shard  # not a DDP index: replaced as real buckets arrive

    def _new_shard(self, layout: BucketLayout) -> BucketShard:
        dtype = self.params[layout.pids[0]].dtype
        master = dtype != torch.float32 if self.master_weights is None else (
            self.master_weights and dtype != torch.float32)
        shard = BucketShard(
            layout, [self.params[i] for i in layout.pids], state_names=self.algo.state_names(),
            master=master, grad_in_region=self.grad_reduce == "reduce_scatter" and self.world > 1,
            device=self.device, dtype=dtype, build_segments=self.backend == "triton")
        return shard

    def _shard_for(self, index: int, pids: list[int], offsets: list[int]) -> BucketShard:
        shard = self.by_index.get(index)
        if shard is not None and shard.layout.same_bucket(pids, offsets):
            return shard
        holder = self.where[pids[0]][0]
        if holder.layout.same_bucket(pids, offsets):  # e.g. the initial layout, guessed right
            self.by_index = {i: s for i, s in self.by_index.items() if s is not holder}
            self.by_index[index] = holder
            return holder
        with range_push("fused_zero.reshard"):
            layout = BucketLayout.build(pids, [self.params[i].numel() for i in pids], offsets,
                                        self.world, self.rank)
            for old in {id(self.where[pid][0]): self.where[pid][0] for pid in pids}.values():
                old.wait_gather()
            new = self._new_shard(layout)
            new.bind_params()
            self._move_state(new)
            for local, pid in enumerate(pids):
                self.where[pid] = (new, local)
            self.by_index[index] = new
            self.by_index = {i: s for i, s in self.by_index.items()
                             if any(self.where[pid][0] is s for pid in s.layout.pids)}
            self.layout_changes += 1
        return new

    def _move_state(self, new: BucketShard) -> None:
        """Fill ``new``'s region with the state its parameters had, in one all_to_all."""
        names = list(new.state)
        if not names:
            return
        plan = reshard_plan(new.layout, {pid: (self.where[pid][0].layout, self.where[pid][1])
                                         for pid in new.layout.pids})
        me = self.rank
        sends = sorted((t for t in plan if t.src == me), key=lambda t: t.dst)  # stable: plan order kept
        recvs = sorted((t for t in plan if t.dst == me), key=lambda t: t.src)
        pieces = [torch.stack([self.where[t.pid][0].state[n][t.src_off:t.src_off + t.length]
                               for n in names], dim=1) for t in sends]
        width = len(names)
        send = torch.cat(pieces) if pieces else torch.zeros(0, width, device=self.device)
        recv = torch.empty(sum(t.length for t in recvs), width, device=self.device)
        if self.world == 1:
            recv.copy_(send)
        else:
            send_splits = [sum(t.length for t in sends if t.dst == r) * width for r in range(self.world)]
            recv_splits = [sum(t.length for t in recvs if t.src == r) * width for r in range(self.world)]
            dist.all_to_all_single(recv.view(-1), send.contiguous().view(-1), recv_splits, send_splits,
                                   group=self.group)
        pos = 0
        for t in recvs:
            for f, n in enumerate(names):
                new.state[n][t.dst_off:t.dst_off + t.length].copy_(recv[pos:pos + t.length, f])
            pos += t.length

    def _compile_kernels(self) -> None:
        """Launch each kernel variant once on a one-element dummy with every parameter inactive, so that
        Triton compiles now and not inside the first backward (tens of ms per variant)."""
        for shard in self.shards():
            dtype = shard.param_buffer.dtype
            one = lambda dt=torch.float32: torch.zeros(1, dtype=dt, device=self.device)  # noqa: E731
            state = {name: one() for name in shard.state}
            coefs = self.algo.coefficients(self._read_hparams(), np.zeros(1, dtype=np.int64), np.ones(1),
                                           np.zeros(1, dtype=bool), 1.0).to(self.device)
            rows = [(0, 1, 0, 0, 0)]
            segments = Segments.build(rows, self.device)
            clip = one() if self.max_grad_norm is not None else None
            self.algo.update("triton", rows, segments, coefs, UpdateArgs(one(dtype), one(dtype), state, clip_coef=clip))
            if self.max_grad_norm is not None:
                self.algo.grad_sumsq("triton", rows, segments, coefs, one(dtype))

    # ------------------------------------------------------------------ hooks

    def _register_hooks(self) -> None:
        try:
            self.ddp.register_comm_hook(self, _comm_hook)
        except RuntimeError as e:
            raise RuntimeError(
                "this DDP module already has a comm hook; fused_zero registers its own to update each "
                "bucket as it is reduced. Build the DDP without register_comm_hook, or build one "
                "fused_zero optimizer per DDP") from e
        root = self.ddp.module
        for module in root.modules():
            pids = [self.pid_of[p] for p in module.parameters(recurse=False) if p in self.pid_of]
            if pids or module is root:
                self._handles.append(module.register_forward_pre_hook(_ForwardWait(self, pids, module is root)))
        # model.state_dict() reads the parameters: give it their updated values
        self._handles.append(root.register_state_dict_pre_hook(lambda *a, **k: self.synchronize()))
        if self.track_used:
            for pid, p in enumerate(self.params):
                self._handles.append(p.register_post_accumulate_grad_hook(_MarkUsed(self, pid)))

    def on_bucket(self, bucket) -> torch.futures.Future:
        """The comm hook: start this bucket's reduction; update the buckets whose turn has come.

        Every collective is issued here, on the autograd thread, or in ``step()``, in bucket order:
        all ranks then issue the same collectives in the same order, which gloo and NCCL both need
        (callbacks on communication threads would race). On CUDA, waiting for a reduction is a stream
        wait, so a bucket is updated as soon as it is handed over; on CPU a wait blocks the host, so a
        bucket is updated when the next one arrives, and its reduction overlaps the backward between.
        The returned future is complete: the buffer's values are final once the last bucket's hook
        has returned, which is before DDP reads them.
        """
        buffer = bucket.buffer()
        if buffer.is_sparse:
            raise RuntimeError("fused_zero does not support sparse gradients (nn.Embedding(sparse=True))")
        try:
            pids = [self.pid_of[p] for p in bucket.parameters()]
        except KeyError:
            raise RuntimeError("DDP reduced a parameter the optimizer does not own") from None
        base = buffer.data_ptr()
        offsets = [(g.data_ptr() - base) // buffer.element_size() for g in bucket.gradients()]
        if self.iteration.last_invoked:
            if self.overlap == "step" and self.iteration.ready:
                raise RuntimeError("a synced backward ran twice without optimizer.step() in between; "
                                   "with overlap='step' accumulate gradients under ddp.no_sync()")
            self.iteration = _Iteration()
        it = self.iteration
        if it.hparams is None:
            self.join_side_stream()
            it.hparams = self._read_hparams()
        shard = self._shard_for(bucket.index(), pids, offsets)
        active = self._active(shard)
        with range_push(f"fused_zero.reduce[{bucket.index()}]"):
            works = self._reduce(shard, buffer)
        shard.reduced_buffer = buffer
        it.ready.append(_Reduced(shard, active, works))
        it.invoked += 1
        it.last_invoked = bucket.is_last()
        if self.overlap == "bucket":
            keep = 0 if (it.last_invoked or self.stream is not None) else 1
            self._finish(it, len(it.ready) - keep)
        elif self.overlap == "backward" and it.last_invoked:
            self._finish(it, len(it.ready))
        fut = torch.futures.Future()
        fut.set_result(buffer)
        return fut

    def _finish(self, it: _Iteration, count: int, max_norm: float | None = None) -> None:
        """Wait for the first ``count`` ready reductions and update those buckets.

        On CUDA the waits are made by the side stream, so the backward's own stream never waits
        for communication.
        """
        todo, it.ready = it.ready[:count], it.ready[count:]
        if not todo:
            return
        with self._side_stream(follow_current=any(not item.works for item in todo)):
            for item in todo:
                for w in item.works:
                    w.wait()
            self._update(it, todo, max_norm)

    def _read_hparams(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]

    def _active(self, shard: BucketShard) -> np.ndarray:
        """Which of the bucket's parameters got a gradient on some rank (torch.optim skips the rest)."""
        pids = shard.pids
        if not self.track_used:
            return np.ones(len(pids), dtype=bool)
        if self.used_static is not None:
            return self.used_static[pids]
        return self._used_on_any_rank(pids)

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
        """Start this bucket's reduction; return its Works."""
        if self.world == 1:
            return []
        layout, g = shard.layout, self.group
        if self._pre_divides(buffer.dtype):
            buffer.div_(self.world)
        works = []
        if self.grad_reduce == "all_reduce":
            works.append(dist.all_reduce(buffer, group=g, async_op=True))
        else:
            region = shard.grad_region
            if layout.tail:
                region[layout.shard:].copy_(buffer[layout.head:])
                works.append(dist.all_reduce(region[layout.shard:], group=g, async_op=True))
            if layout.shard:
                works.append(reduce_scatter(region[:layout.shard], buffer[:layout.head],
                                             group=g, async_op=True))
        return works

    # ------------------------------------------------------------------ update

    def _side_stream(self, follow_current: bool):
        """Run the updates on the side stream (CUDA) or inline (CPU). ``follow_current`` orders the
        side stream after all work queued so far, needed when no collective orders it after the
        gradients (one rank)."""
        if self.stream is None:
            return contextlib.nullcontext()
        if follow_current:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def join_side_stream(self) -> None:
        """Order the current stream after the updates: before DDP's buffers and our regions are
        written again by the next backward and reduction."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _coefficient_table(self, hparams: list[dict], active: np.ndarray) -> torch.Tensor:
        """Every parameter's update scalars for this step, one row per parameter (host float32)."""
        return self.algo.coefficients(hparams, self.group_of, self.steps + active, active, self.grad_div)

    def _coefs_for(self, it: _Iteration, shard: BucketShard, active: np.ndarray) -> torch.Tensor:
        """The table a bucket's update reads: the iteration's shared one, unless some parameter of the
        bucket got no gradient (then a table of its own, with those rows inactive)."""
        if it.coefs is None:
            it.coefs = self._to_device(self._coefficient_table(it.hparams, np.ones(len(self.params))))
        if active.all():
            return it.coefs
        mask = np.ones(len(self.params))
        mask[shard.pids] = active
        return self._to_device(self._coefficient_table(it.hparams, mask))

    def _to_device(self, table: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return table
        with self._side_stream(follow_current=False):  # the side stream reads it first
            return table.pin_memory().to(self.device, non_blocking=True)

    def _update(self, it: _Iteration, items: list[_Reduced], max_norm: float | None = None) -> None:
        coefs = [self._coefs_for(it, item.shard, item.active) for item in items]
        for item in items:
            item.shard.wait_gather()
        clip = self._clip_coef(items, coefs, max_norm) if max_norm is not None else None
        for item, table in zip(items, coefs):
            shard = item.shard
            with range_push(f"fused_zero.update[{shard.layout.numel}]"):
                grad = shard.grad_region if shard.grad_region is not None else shard.reduced_buffer
                self.algo.update(self.backend, shard.rows, shard.segments, table,
                                 UpdateArgs(grad, shard.param_buffer, shard.state, clip_coef=clip))
            self.steps[shard.pids] += item.active
            shard.reduced_buffer = None
            self._start_gather(shard)

    def _clip_coef(self, items: list[_Reduced], tables: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for item, coefs in zip(items, tables):
            shard = item.shard
            grad = shard.grad_region if shard.grad_region is not None else shard.reduced_buffer
            sumsq, _ = self.algo.grad_sumsq(self.backend, shard.norm_rows, shard.norm_segments, coefs, grad)
            total += sumsq
        if self.world > 1:
            dist.all_reduce(total, group=self.group)
        return clip_coefficient(total, max_norm)

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

    def step(self) -> None:
        it = self.iteration
        if it.invoked == 0:
            raise RuntimeError("optimizer.step() found no reduced gradients since the last step: run a "
                               "backward outside ddp.no_sync() (with require_backward_grad_sync=True) "
                               "before stepping")
        if not it.last_invoked:
            raise RuntimeError("optimizer.step() called while DDP is still reducing gradients")
        if self.overlap == "step":  # the updates run now: hyperparameters as they are now
            it.hparams, it.coefs = self._read_hparams(), None
        self._finish(it, len(it.ready), self.max_grad_norm)
        if self.track_used and self.used_static is None and getattr(self.ddp, "static_graph", False):
            self.used_static = self._used_on_any_rank(np.arange(len(self.params)))
        self.used_local[:] = False
        self.iteration = _Iteration()
        if self.param_sync == "step":
            self.synchronize()

    def synchronize(self) -> None:
        """Wait for every pending all-gather: parameters are up to date for any reader after this."""
        for shard in self.shards():
            shard.wait_gather()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def shards(self) -> list[BucketShard]:
        return list({id(s): s for s, _ in self.where.values()}.values())

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class _ForwardWait:
    """Forward pre-hook: wait for the gathers of the buckets holding this module's own parameters."""

    def __init__(self, engine: Engine, pids: list[int], root: bool):
        self.engine, self.pids, self.root = engine, pids, root

    def __call__(self, module, args):
        if self.root:
            self.engine.join_side_stream()
        where = self.engine.where
        for pid in self.pids:
            shard = where[pid][0]
            if shard.gather is not None:
                with range_push("fused_zero.forward_wait"):
                    shard.wait_gather()


class _MarkUsed:
    def __init__(self, engine: Engine, pid: int):
        self.engine, self.pid = engine, pid

    def __call__(self, param):
        self.engine.used_local[self.pid] = True


def _comm_hook(engine, bucket):
    return engine.on_bucket(bucket)


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' on CPU tensors runs Triton's interpreter: set TRITON_INTERPRET=1 "
                         "before importing fused_zero, or use backend='torch'")
    return backend


def _collect_params(param_groups: list[dict], ddp) -> tuple[list[torch.nn.Parameter], np.ndarray]:
    """The parameters the optimizer updates (those requiring grad), each with its group index, checked
    against the parameters DDP reduces: every one of them must be the optimizer's, and vice versa."""
    ddp_params = [p for p in ddp.module.parameters() if p.requires_grad]
    ignored = {id(p) for name, p in ddp.module.named_parameters()
               if name in getattr(ddp, "parameters_to_ignore", ())}
    ddp_params = [p for p in ddp_params if id(p) not in ignored]
    ddp_ids = {id(p) for p in ddp_params}
    params, group_of, seen = [], [], set()
    for gi, group in enumerate(param_groups):
        for i, p in enumerate(group["params"]):
            if p.is_sparse or getattr(p, "layout", torch.strided) != torch.strided:
                raise ValueError(f"param group {gi}, parameter {i}: sparse parameters are not supported")
            if id(p) not in ddp_ids and p.requires_grad:
                raise ValueError(
                    f"param group {gi}, parameter {i} (shape {tuple(p.shape)}) is not a parameter that "
                    "the DDP module reduces; build the optimizer from ddp.parameters()")
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
                group_of.append(gi)
    missing = [tuple(p.shape) for p in ddp_params if id(p) not in seen]
    if missing:
        raise ValueError(f"the DDP module reduces {len(missing)} parameter(s) the optimizer does not own "
                         f"(shapes {missing[:4]}); pass every trainable parameter, e.g. ddp.parameters()")
    if not params:
        raise ValueError("the optimizer has no trainable parameters")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
    for module in ddp.module.modules():
        if getattr(module, "sparse", False) and isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            raise ValueError(f"{type(module).__name__}(sparse=True) produces sparse gradients, which "
                             "fused_zero does not support; use sparse=False")
    return params, np.asarray(group_of, dtype=np.int64)
