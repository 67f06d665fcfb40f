"""The fused_zero optimizers over one DDP module, until and once they share its engine.

An optimizer attaches to a DDP module (``ddp=`` or ``attach``), and several may, each with parameters of
its own: ``fused_zero.Muon`` for the hidden matrices beside ``fused_zero.AdamW`` for the embeddings,
norms and biases, the pairing torch's docs and Muon's authors use. The engine (pipeline/engine.py) lays
out every parameter DDP reduces, so it is built once the layout is settled: at once where the attached
optimizers own every parameter (one optimizer over the whole module), else at the module's first
forward, with the optimizers attached by then (a forward pre-hook; every rank sees the same attaches and
runs the same forward). A parameter none of them owns is reduced as DDP reduces it, its ``.grad`` DDP's
average, and left to its owner: a torch.optim optimizer over the rest of the module, or none, as with
DDP + torch.optim. Until the engine is built the attached optimizers *wait*: they keep a loaded state as
an unattached one does (checkpoint/loading.py).

Refused at ``attach``, before anything changes: a parameter another optimizer over the module owns
(named, with that optimizer), an option given to two optimizers with different values (the options
other than ``state_format`` are the module's: one reduction, one overlap mode, one global norm for
``max_grad_norm``, one GradScaler), a DDP module with a comm hook of its own, and an optimizer attached
once the layout is settled (build it before the module's first forward).
"""

from __future__ import annotations

import weakref

import torch
from torch.nn.parallel import DistributedDataParallel

from ..checkpoint import loading
from ..params import ddp_params, member_params, param_name
from ..pipeline.engine import Engine
from ..pipeline.local import (
    OVERRIDES,
    LocalModule,
    PythonReducerDDP,
    refuse_plain_module_in_group,
    uses_python_reducer,
)
from ..pipeline.reducing import hooks

PER_OPTIMIZER = ("state_format",)
"""Options each optimizer keeps for itself (the default of its param groups); the others are the module's."""

_BY_MODULE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # the DDP module (plain module) -> ModuleOptimizers


def join(opt, ddp, options: dict) -> None:
    """Attach ``opt`` to ``ddp`` with its merged sharding ``options``; builds the engine once the module's
    optimizers own every parameter DDP reduces. Raises, changing nothing, for a bad split."""
    local = isinstance(ddp, LocalModule)
    key = ddp.module if local else ddp
    attached = _BY_MODULE.get(key)
    # a plain module has no comm hook to keep: an optimizer attached once its engine exists starts anew
    # (one process replacing its optimizer), where a DDP module's hook stays the first engine's
    if attached is None or (local and attached.engine is not None):
        attached = _BY_MODULE[key] = ModuleOptimizers(ddp)
    attached.join(opt, ddp, options)


def _same(a, b) -> bool:
    return a is b or (type(a) is type(b) and a == b)


class ModuleOptimizers:
    """The optimizers attached to one DDP module. It is the value of a weak-keyed map whose key is the
    module, so it holds the module (and the engine, which holds it) only while optimizers wait: else
    neither could ever be freed.

    Attributes:
        ddp: the DDP module (a LocalModule for a plain module), while optimizers wait.
        waiting: the attached optimizers, in attach order, until the engine is built.
        options: the module's sharding options, merged from theirs.
        engine: the engine, once built (None once it has been freed with its optimizers).
    """

    def __init__(self, ddp):
        self.ddp = ddp
        self.waiting: list = []
        self.options: dict = {}
        self._engine = None
        self._guard = None

    @property
    def engine(self):
        return self._engine() if self._engine is not None else None

    def owner_of(self) -> dict[int, object]:
        """id(parameter) -> the optimizer that owns it, among those attached."""
        owners = [m.opt for m in self.engine.members] if self.engine is not None else self.waiting
        return {id(p): o for o in owners for g in o.param_groups for p in g["params"] if p.requires_grad}

    def join(self, opt, ddp, options: dict) -> None:
        if self.engine is None and not self.waiting:
            self.ddp = ddp
            hooks.check_no_comm_hook(self.ddp)
        params, _ = member_params(opt.param_groups, ddp)
        owners = self.owner_of()
        for p in params:
            other = owners.get(id(p))
            if other is not None:
                raise ValueError(f"{param_name(ddp, p)} is already updated by the {type(other).__name__} "
                                 f"attached to this DDP module: give each parameter to one optimizer "
                                 f"(this {type(opt).__name__} was not attached)")
        if self.engine is not None:
            names = ", ".join(type(m.opt).__name__ for m in self.engine.members)
            raise RuntimeError(
                f"this {type(opt).__name__} was attached to a DDP module whose layout is already settled, with "
                f"the fused_zero optimizers attached by its first forward ({names}): build and attach every "
                "fused_zero optimizer over the module before its first forward (the parameters none of them "
                "owns are left to their owner, a torch.optim optimizer or none)")
        module = {k: v for k, v in options.items() if k not in PER_OPTIMIZER}
        for k, v in module.items():
            if k in self.options and not _same(self.options[k], v):
                raise ValueError(f"{k}={v!r} given to this {type(opt).__name__} but {k}={self.options[k]!r} to "
                                 f"another fused_zero optimizer over the same DDP module: the option is the "
                                 "module's (one reduction, one overlap, one global norm); give it once, or the "
                                 "same value to each")
        before = dict(self.options)
        self.options.update(module)
        self.waiting.append(opt)
        try:
            if self.missing():
                self._install_guard()
            else:
                self._build()
        except BaseException:
            self.waiting.pop()
            self.options = before
            raise

    def missing(self) -> list:
        """The parameters DDP reduces that no attached optimizer owns."""
        owners = self.owner_of()
        return [p for p in ddp_params(self.ddp) if id(p) not in owners]

    def _install_guard(self) -> None:
        if self._guard is None:
            module = self.ddp.module if isinstance(self.ddp, LocalModule) else self.ddp
            self._guard = hooks.forward_pre_hook(module, _SettleAtFirstForward(self))

    def _build(self) -> None:
        """The layout is settled (every parameter owned, or the module's first forward): check each
        optimizer's kept state (a collective per optimizer, in attach order on every rank), build the
        engine, then bind each optimizer to its member."""
        members = list(self.waiting)
        options = {**self.options, **(OVERRIDES if isinstance(self.ddp, LocalModule) else {})}
        plans = [loading.check_at_attach(o, self.ddp, options, o._kept) for o in members]
        engine = Engine(self.ddp, [(o, o._algorithm, o._options.get("state_format", "fp32")) for o in members],
                        **options)
        self._engine, self.waiting, self.ddp = weakref.ref(engine), [], None
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        for o, member, plan in zip(members, engine.members, plans):
            o._bind(engine, member, engine.view(member), plan)


class _SettleAtFirstForward:
    """Forward pre-hook of a module whose attached optimizers do not own every parameter: its first forward
    settles the layout, with the optimizers attached by then (every rank runs it, with the same ones)."""

    def __init__(self, attached: ModuleOptimizers):
        self.attached = weakref.ref(attached)

    def __call__(self, module, args):
        attached = self.attached()
        if attached is not None and attached.engine is None and attached.waiting:
            attached._build()


def not_attached(opt, what: str) -> str:
    if getattr(opt, "_joined", False):
        return (f"{what} needs this {type(opt).__name__}'s DDP module laid out, which happens at its first "
                "forward (the fused_zero optimizers attached to it do not own all of its trainable parameters: "
                "the layout is settled then, with the ones attached by then)")
    return (f"{what} needs this {type(opt).__name__} attached to its DDP module, and it is not: call "
            "opt.attach(ddp) once the model is wrapped in DistributedDataParallel, or pass ddp= at "
            "construction (one process without DDP: opt.attach(model); Lightning: "
            "fused_zero.lightning.FusedZeroStrategy attaches it; Accelerate: "
            "fused_zero.accelerate.attach(accelerator, model, optimizer) after accelerator.prepare)")


def check_ddp(ddp):
    """``ddp`` must be the DistributedDataParallel module itself, whose buckets are what gets sharded;
    or, in one process, a plain module, which is given a LocalModule's place (pipeline/local.py). A DDP
    module built under ``optimize_ddp="python_reducer"`` reduces per parameter, without buckets: it is
    given a PythonReducerDDP's place (pipeline/local.py)."""
    if isinstance(ddp, DistributedDataParallel):
        return PythonReducerDDP(ddp) if uses_python_reducer(ddp) else ddp
    kind = f"{type(ddp).__module__}.{type(ddp).__qualname__}"
    inner = getattr(ddp, "_orig_mod", None) or getattr(ddp, "module", None)
    if isinstance(inner, DistributedDataParallel):
        hint = "; it wraps a DistributedDataParallel: pass that DDP module itself"
    elif "FullyShardedDataParallel" in kind or type(ddp).__name__.startswith("FSDP"):
        hint = "; FSDP shards parameters and optimizer state itself: fused_zero shards DDP's buckets"
    elif isinstance(ddp, torch.nn.Module):
        refuse_plain_module_in_group(ddp)
        return LocalModule(ddp)
    else:
        hint = ""
    raise TypeError(f"ddp must be a torch.nn.parallel.DistributedDataParallel module (or, in one process "
                    f"without DDP, the nn.Module itself), got {kind}{hint}")


def guard_unattached(opt) -> list:
    """Hooks that make a backward producing gradients for an unattached optimizer's parameters raise.
    They hold the optimizer weakly and go away with it, so a discarded optimizer leaves no trap."""
    ref = weakref.ref(opt)

    def hook(param):
        o = ref()
        if o is not None and o._engine is None:
            raise RuntimeError(not_attached(o, "a backward through its parameters"))

    handles = [p.register_post_accumulate_grad_hook(hook)
               for group in opt.param_groups for p in group["params"] if p.requires_grad]
    weakref.finalize(opt, _remove_all, handles)
    return handles


def _remove_all(handles) -> None:
    for handle in handles:
        handle.remove()
