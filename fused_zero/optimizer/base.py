"""What every fused_zero optimizer shares: the torch.optim.Optimizer subclass whose step, state and
checkpoints are those of its share of the DDP module's engine (pipeline/engine.py), and ``opt.state``'s
read-only view of that share."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from ..checkpoint import canonical, loading, sharded
from ..checkpoint.serving import peers
from ..options import ShardingOptions, normalize_options
from ..pipeline.engine import Engine
from . import protocol, sharing
from .frameworks import FrameworkMethods
from .sharing import check_ddp, guard_unattached, not_attached


class _ShardedState(Mapping):
    """``opt.state``: a read-only view that tells one story. Its keys are the parameters torch.optim
    would have state for (stepped at least once; SGD only with momentum), so ``len``, ``bool``, ``in``
    and iteration agree with each other and with torch (torch's checkpoint helpers test
    ``bool(opt.state)`` to decide whether to create state). ``opt.state[p]`` is a snapshot of this
    rank's share, with no collective (see canonical.local_entry); a parameter without state reads as
    ``{}``, as torch's defaultdict does. Writing into it is refused: the state lives in the ranks'
    regions; change it through ``load_state_dict``. Writing into a snapshot's dict changes nothing,
    which keeps device-moving walkers harmless (the state already lives where the parameters do)."""

    def __init__(self, view):
        self._view = view  # this optimizer's share of the engine (pipeline/members.py)
        self._index = {id(p): i for i, p in enumerate(view.table.params)}

    def _stepped(self):
        return [i for i in range(len(self._view.table.params)) if canonical.has_state(self._view, i)]

    def __getitem__(self, param):
        i = self._index.get(id(param))
        if i is None:
            raise KeyError("not a parameter this optimizer updates")
        return canonical.local_entry(self._view, i) if canonical.has_state(self._view, i) else {}

    def __iter__(self):
        return iter([self._view.table.params[i] for i in self._stepped()])

    def __len__(self):
        return len(self._stepped())

    def __contains__(self, param):
        i = self._index.get(id(param))
        return i is not None and canonical.has_state(self._view, i)

    def __setitem__(self, key, value):
        raise TypeError("fused_zero's opt.state is read-only: the state is sharded across ranks; change it "
                        "with opt.load_state_dict()")

    __delitem__ = __setitem__


class ShardedOptimizer(FrameworkMethods, torch.optim.Optimizer):
    """Shared plumbing: validates torch-only flags, joins the DDP module's engine when attached, forwards
    step().

    Built without ``ddp=``, an optimizer is *unattached*: it holds param_groups (so LR schedulers and
    frameworks that wrap optimizers can be set up) but no state and no comm hook. ``attach(ddp)`` joins
    the module's other fused_zero optimizers, if any (optimizer/sharing.py); once they own every
    parameter DDP reduces, the engine lays out the state and registers the hook, and each optimizer is
    a member of it (pipeline/members.py). Until then ``step()`` raises, and so does a backward that
    produces gradients for its parameters (plain DDP would all-reduce them and no update could ever
    use them); ``load_state_dict()`` checks what it can and keeps the state until the engine lays it
    out (checkpoint/loading.py), and ``state_dict()`` returns what was loaded, or torch.optim's dict of
    a fresh optimizer (frameworks round-trip it when they wrap the optimizer).
    """

    # Makes torch.amp.GradScaler hand its scale and found-inf flag to step() instead of unscaling
    # param.grad itself: the kernel unscales (see pipeline/step_end/amp.py).
    _step_supports_amp_scaling = True
    _engine: Engine | None = None  # until the engine is built (torch.optim's __init__ adds the groups before)

    def _start(self, ddp, algorithm, options: dict, *, capturable=False, differentiable=False):
        """``options``: the keyword-only sharding options (options.OPTIONS) (an unknown one is a
        TypeError naming it). foreach and fused are accepted for drop-in compatibility and ignored: the
        update is always one fused kernel."""
        if capturable and (ddp is not None or "overlap" in options) and options.get("overlap") != "step":
            raise ValueError(
                "capturable=True replays step()'s updates, checks and all-gathers from a CUDA graph, which needs "
                f"them in step(): pass overlap=\"step\" (got overlap={options.get('overlap', 'auto')!r}, where "
                "they run inside the backward); the step has no host synchronization in every mode without it")
        # the engine refuses what a graph cannot hold (pipeline/step_end/step_graph.py)
        self._capturable = bool(capturable)
        if differentiable:
            raise ValueError("differentiable=True is not supported: the fused update is not part of the autograd "
                             "graph; leave differentiable=False")
        options = normalize_options(options, type(self).__name__)
        ShardingOptions(**options)  # the values, checked before any DDP module (the Engine checks them again)
        self._algorithm = algorithm
        self._options = dict(options)
        self._engine: Engine | None = None
        self._member = self._view = None  # this optimizer's place in the engine (pipeline/members.py)
        self._joined = False  # attached to a DDP module (the engine may wait for its other optimizers)
        self._kept: dict | None = None  # a state loaded before attach (checkpoint/loading.py)
        self.state = MappingProxyType({})  # no state until attached
        if ddp is None:
            self._unattached_hooks = guard_unattached(self)
        else:
            self.attach(ddp)

    def attach(self, ddp, **options) -> None:
        """Shard this optimizer's state over ``ddp``'s buckets and register its comm hook: what
        ``ddp=`` at construction does, for an optimizer built before its DDP module existed.

        ``options`` are sharding options (options.OPTIONS) added to those given at
        construction; giving one both times with different values is an error. Attach once, on every
        rank, to the DDP module whose trainable parameters this optimizer updates: all of them, or,
        beside other fused_zero optimizers attached to it (Muon and AdamW), its share of them; the state
        is laid out (and a state loaded before, once every rank agrees that it fits) when the module's
        optimizers own every parameter (optimizer/sharing.py). In one process with no DDP, attach the
        plain module: the update then runs in ``step()`` (pipeline/local.py).
        """
        if getattr(self, "_joined", False):
            raise RuntimeError(f"this {type(self).__name__} is already attached to a DDP module; an optimizer "
                               "shards one DDP's buckets, once")
        ddp = check_ddp(ddp)
        options = normalize_options(options, f"{type(self).__name__}.attach()", stacklevel=3)
        for name, value in options.items():
            if name in self._options and self._options[name] != value and self._options[name] != "auto":
                raise ValueError(f"{name}={value!r} given to attach() but {name}={self._options[name]!r} at "
                                 "construction; give it once")
        merged = {**self._options, **options}
        ShardingOptions(**merged)
        self._algorithm.refresh(self.param_groups)  # param groups may have been added since construction
        previous, self._options = self._options, merged
        try:
            sharing.join(self, ddp, merged)  # refuses on every rank, changing nothing; may build the engine
        except BaseException:
            self._options = previous
            raise
        self._joined = True

    def _bind(self, engine: Engine, member, view, plan) -> None:
        """The engine is built (optimizer/sharing.py): this optimizer is its ``member``, whose share the
        checkpoint side reads through ``view`` (pipeline/members.py); ``plan``, the state loaded before,
        checked by every rank, is laid out now."""
        self._engine, self._member, self._view = engine, member, view
        if plan is not None:
            loading.apply_at_attach(self._view, plan)
        self._kept = None
        self._peers = peers.peers_for(self._view)
        self.state = _ShardedState(self._view)
        for handle in getattr(self, "_unattached_hooks", ()):
            handle.remove()
        self._unattached_hooks = ()

    @property
    def attached(self) -> bool:
        """Whether ``attach(ddp)`` (or ``ddp=`` at construction) has run."""
        return self._engine is not None

    def _attached_engine(self, what: str) -> Engine:
        if self._engine is None:
            raise RuntimeError(not_attached(self, what))
        return self._engine

    def add_param_group(self, param_group: dict) -> None:
        """torch.optim's, before or after ``attach``. Attached, the group's parameters (ones the DDP module
        reduces and no fused_zero optimizer updates) join this optimizer's share of the engine, their state
        starting as torch.optim's does, between steps, on every rank (pipeline/added_groups.py); a group
        that cannot join raises, and the optimizer keeps its groups as they were."""
        protocol.check_group_options(param_group, len(self.param_groups))
        super().add_param_group(param_group)
        if self._engine is not None:  # None while being built, unattached, or waiting to be laid out
            protocol.join_group(self)

    @torch.no_grad()
    def step(self, closure=None):
        """This optimizer's step: with overlap="step" its update of every bucket runs now, from its
        gradients as they are (the other modes ran it during the backward); it skips on its own
        gradients' overflow. With param_sync="step" it returns once its parameters hold their new values
        on every rank (pipeline/step_end/stepping.py; a bucket shared with another optimizer:
        pipeline/gathering/packed.py)."""
        engine = self._attached_engine("step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if engine.iteration.invoked == 0 and not engine.iteration.stepped and \
                canonical.is_state_init_step(self._view):
            engine.state_init_step(self._member)  # torch.distributed.checkpoint's helpers do this
            return loss
        iteration, me = engine.iteration, self._member.index
        before = me in iteration.stepped
        try:
            # torch.amp.GradScaler.step() sets both attributes for the call (pipeline/step_end/amp.py); grad_scale is
            # None once the user has called scaler.unscale_(opt).
            engine.step(self._member, via_scaler=hasattr(self, "found_inf"),
                        grad_scale=getattr(self, "grad_scale", None))
        finally:
            if engine.iteration is not iteration or (me in iteration.stepped and not before):
                self._peers.published()  # this optimizer stepped (a refusal may raise after it did)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's. With ``set_to_none=False`` the gradients are zeroed in place: with
        ``gradient_as_bucket_view`` they are views of DDP's buckets, whose version counter every gradient
        of the bucket shares, so the other optimizers over the module are told that this change is not
        an edit of their gradients (pipeline/reducing/grad_watch.py)."""
        engine = self._engine
        if engine is None or set_to_none:
            super().zero_grad(set_to_none)
            return
        watch = engine.policy.watch
        before = watch.versions()
        super().zero_grad(set_to_none=False)
        watch.excuse(before, self._member.pids)

    @property
    def skipped_steps(self) -> int:
        """This optimizer's steps skipped on every rank because some rank's reduced gradients of its
        parameters held an inf or NaN (loss-scale overflows included), as Megatron's skipped-iterations
        count. Reading it waits for the device."""
        return self._attached_engine("skipped_steps").skipped_steps(self._member.index)

    def synchronize(self) -> None:
        """Wait until every parameter holds its updated value. Needed only with param_sync="forward",
        before reading parameters outside the modules' forward passes."""
        self._attached_engine("synchronize()").synchronize()

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds for the optimizer, next to what torch.optim would hold.

        ``state``: master weights and moments of this rank's slice of each bucket plus its small
        replicated tail (see pipeline/buckets/layout.py): 1/W of the model and nothing else, since gradients are
        reduced in place in DDP's buckets; ``reference_state``: torch.optim's fp32 state for the same
        parameters (plus an fp32 master copy when this optimizer keeps master weights).
        """
        engine = self._attached_engine("memory()")
        view = self._view
        parts = [part for s in view.layout.shards() for part in view.layout.parts(s)]
        numel = sum(p.numel() for p in view.table.params)
        masters = sum(p.numel() * 4 for p in view.table.params if engine.options.keeps_master(p.dtype))
        return {
            "state": sum(t.numel() * t.element_size() for part in parts  # + what is kept beside the regions
                         for t in (*part.state.values(), *part.scales.values())) + self._algorithm.bytes_kept(),
            "reference_state": self._algorithm.reference_bytes(view.table.params) + masters,
            # the flat parameter buffers are the DDP module's, shared by its optimizers
            "param_buffers": sum(s.param_buffer.numel() * s.param_buffer.element_size() for s in engine.shards()),
            "elements": numel,
            "region_elements": sum(part.size for part in parts),
        }

    def state_dict(self, to: int | None = None) -> dict | None:
        """torch.optim's canonical state dict (per-parameter ``step``, ``exp_avg``, ... and, for bf16/fp16
        parameters, ``fp32_master``; on CPU), which ``torch.optim`` loads as it is, as it is after the
        last step. Call it between steps on any rank or ranks, e.g. on rank 0 alone as nanoGPT and the
        Trainer do: the other ranks serve their shards from a thread, whatever they do meanwhile (see
        serving/peers.py). ``to=None``: the calling rank gets the whole dict; ``to=r``: rank r
        does, and the other ranks calling it get None once rank r has asked.
        Unattached: what was loaded, or torch.optim's dict of a fresh optimizer (no communication).
        torch.optim's state_dict hooks run as torch.optim runs them (protocol.py)."""
        return protocol.through_state_dict_hooks(self, lambda: loading.kept_state_dict(self, self._kept)
                                                 if self._engine is None
                                                 else canonical.state_dict(self._view, self._peers, to))

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a canonical state dict (ours or torch.optim's), at any world size or bucket layout, after
        checking all of it: a refused dict raises and changes nothing. Load the model's weights first.
        Call on every rank. Unattached: checked as far as it can be without the buckets, the param
        groups loaded, and the state kept until ``attach`` lays it out (checkpoint/loading.py).
        torch.optim's load_state_dict hooks run as torch.optim runs them: the pre-hooks on a shallow copy
        of the dict (a returned dict takes its place), the post-hooks once it is loaded."""
        protocol.through_load_hooks(self, state_dict, self._load)

    def _load(self, state_dict: dict) -> None:
        if self._engine is None:
            self._kept = loading.keep_until_attach(self, state_dict)
        else:
            loading.load_state_dict(self._view, state_dict)
            self._peers.published(by_step=False)

    def sharded_state_dict(self) -> dict:
        """The state for torch.distributed.checkpoint: each rank's tensors hold only the elements it owns,
        as DTensors over each parameter's flattened state (see checkpoint/sharded.py).
        ``dcp.save(opt.sharded_state_dict(), ...)``; to load, ``sd = opt.sharded_state_dict();
        dcp.load(sd, ...); opt.load_sharded_state_dict(sd)`` at any world size or bucket layout."""
        self._attached_engine("sharded_state_dict()")
        return sharded.sharded_state_dict(self._view)

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        """Load what ``dcp.load`` wrote into a ``sharded_state_dict()`` of this optimizer, after checking
        all of it on every rank: a refused dict raises and changes nothing."""
        self._attached_engine("load_sharded_state_dict()")
        sharded.load_sharded_state_dict(self._view, state_dict)
        self._peers.published(by_step=False)
