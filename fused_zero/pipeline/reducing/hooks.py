"""Everything fused_zero registers on the user's modules: DDP's comm hook, the forward pre-hooks that
wait for the all-gathers, the state_dict pre-hook and, where DDP may skip parameters, the hooks that
record which parameters got a gradient on this rank.

Which parameters a module's forward pre-hook waits for (with ``param_sync="forward"``): those its
forward can reach, i.e. every parameter of its subtree. Modules read their children's parameters
without calling the children: ``nn.MultiheadAttention`` reads ``out_proj.weight``, and
``nn.TransformerEncoderLayer``'s fast path reads every weight of its children. Two kinds of module wait
for their own parameters only, since waiting for their subtree would wait for most of the model
before its first layer runs (which is what ``param_sync="step"`` does):

- plain containers (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``), whose forward, if any,
  only calls the children, and each child waits for itself;
- the module DDP wraps, when it is the user's own class: its forward is the model's top level, which
  calls its submodules (each of which waits). Reading a submodule's parameter there before that
  submodule has run in the same forward is the one case left to the user (``synchronize()``).
"""

from __future__ import annotations

import copy
import functools
import itertools
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.nn.modules import module as torch_module

from ..comm.profiling import range_push

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
"""Modules whose forward only calls their children: they wait for their own parameters only."""


def check_no_comm_hook(ddp) -> None:
    """Refuse a DDP module that already has a comm hook (Python or built-in), before anything is
    changed: DDP accepts one comm hook and cannot remove it."""
    logged = ddp._get_ddp_logging_data().get("comm_hook") if hasattr(ddp, "_get_ddp_logging_data") else None
    if getattr(ddp, "_comm_hooks", None) or logged:
        raise RuntimeError(
            f"this DDP module already has a comm hook ({logged or 'registered with register_comm_hook'}); "
            "fused_zero registers its own to update each bucket as it is reduced. Build the DDP without "
            "register_comm_hook, or build one fused_zero optimizer per DDP")


@dataclass(frozen=True)
class HookTargets:
    """What the hooks reach of the engine, the face they are built with: the engine holds it, each hook
    holds it weakly (``HookState``).

    Attributes:
        on_bucket: the comm hook's work (``Engine.on_bucket``).
        synchronize: waits for every pending all-gather (``Stepping.synchronize``).
        check_refusals: raises a refusal another rank made known (step_end/refusals.py), waiting for nothing.
        side: the side stream (comm/streams.py).
        registry: which shard holds each parameter (buckets/registry.py).
        watch: the gradients' watch (grad_watch.py).
    """

    on_bucket: Callable
    synchronize: Callable
    check_refusals: Callable
    side: object
    registry: object
    watch: object


def register(ddp, targets: HookTargets, handles: list) -> None:
    """Register the hooks on ``ddp`` itself (the module's own come first: ``register_module_hooks``),
    appending the removable handles to ``handles`` as they are made (so that a failure midway can remove
    those already there); DDP's comm hook, which cannot be removed, comes last."""
    if hasattr(ddp, "finalize_backward"):  # torch 2.15's manual backward finalization
        handles.append(FinalizeWatch(targets, ddp))
    state = HookState(targets)
    try:
        ddp.register_comm_hook(state, _comm_hook)
    except RuntimeError:
        # DDP records the refused hook before its reducer refuses it: drop it, and with it the engine
        recorded = getattr(ddp, "_comm_hooks", [])
        if recorded and recorded[-1][1] is state:
            recorded.pop()
        raise


# ------------------------------------------------------------------ hooks the module's copies leave behind
#
# Training scripts copy the module the optimizer trains: ``copy.deepcopy(model)`` (every EMA and SWA:
# torch.optim.swa_utils.AveragedModel, timm's ModelEma; an evaluation snapshot), ``torch.save(model)``,
# ``pickle``. A copy is a plain module: it must carry none of fused_zero's hooks, which reach the engine
# (its streams, its process groups: nothing a copy or a pickle can hold) and wait for all-gathers that
# are not the copy's. torch keeps a module's hooks in its ``__dict__``, which both copies copy; so
# fused_zero keeps its forward pre-hooks outside the modules, behind one global forward pre-hook
# (``forward_pre_hook``), and its state_dict pre-hook in a dict whose copies leave it out
# (``state_dict_pre_hook``).

_FORWARD: dict[int, dict] = {}
"""``id(module)`` -> {key: hook}: the forward pre-hooks fused_zero keeps for a module, dropped with the module
(``weakref.finalize``) or the handle. Keyed by ``id``, a plain dict: torch.compile traces the global hook
into every compiled module's forward, and dynamo follows a dict lookup by ``id`` where it cannot follow
a weak reference."""
_GLOBAL: list = []  # torch's handle of the one global forward pre-hook, while some module has one here
_KEYS = itertools.count()


def forward_pre_hook(module: nn.Module, hook) -> ForwardHandle:
    """Call ``hook(module, args)`` before each forward of ``module``, as
    ``module.register_forward_pre_hook(hook)`` would (global forward pre-hooks run just before a module's
    own), but with nothing in ``module``: its copies carry none of it (the comment above)."""
    key = next(_KEYS)
    if id(module) not in _FORWARD:
        _FORWARD[id(module)] = {}
        weakref.finalize(module, _drop, id(module))
    _FORWARD[id(module)][key] = hook
    if not _GLOBAL:
        _GLOBAL.append(torch_module.register_module_forward_pre_hook(_forward_pre_hooks))
    return ForwardHandle(module, key)


def _drop(module_id: int) -> None:
    """A module is gone: its hooks with it (its id may be another module's next)."""
    _FORWARD.pop(module_id, None)
    if not _FORWARD and _GLOBAL:
        _GLOBAL.pop().remove()


def forward_pre_hooks_of(module: nn.Module) -> list:
    """The forward pre-hooks fused_zero keeps for ``module`` (tests check what a refusal leaves behind)."""
    return list(_FORWARD.get(id(module), {}).values())


def _forward_pre_hooks(module: nn.Module, args) -> None:
    hooks = _FORWARD.get(id(module))
    if hooks:
        for hook in list(hooks.values()):
            hook(module, args)


class ForwardHandle:
    """``remove()`` removes a hook of ``forward_pre_hook``'s (and the global one with the last)."""

    def __init__(self, module: nn.Module, key: int):
        self.module, self.key = weakref.ref(module), key

    def remove(self) -> None:
        module = self.module()
        hooks = _FORWARD.get(id(module)) if module is not None else None
        if hooks is not None:
            hooks.pop(self.key, None)
            if not hooks:
                del _FORWARD[id(module)]
        if not _FORWARD and _GLOBAL:
            _GLOBAL.pop().remove()


class _WithoutOurs(OrderedDict):
    """A module's ``_state_dict_pre_hooks`` whose copies (``copy.deepcopy``, pickle) are plain OrderedDicts
    without fused_zero's hooks: what a copy of the module holds then needs no fused_zero to load."""

    def __deepcopy__(self, memo):
        return OrderedDict((k, copy.deepcopy(v, memo)) for k, v in self.items() if not isinstance(v, Synchronize))

    def __reduce__(self):
        return OrderedDict, (), None, None, iter([(k, v) for k, v in self.items() if not isinstance(v, Synchronize)])


def state_dict_pre_hook(module: nn.Module, hook: Synchronize):
    """``module.register_state_dict_pre_hook(hook)``, left out of the module's copies: the module's dict
    of state_dict pre-hooks becomes a ``_WithoutOurs`` where it holds none yet (a user's handle of an earlier
    hook refers to the dict it was registered in, which stays), else ``hook`` copies as a hook that does
    nothing (``Synchronize.__reduce__``)."""
    if type(module._state_dict_pre_hooks) is OrderedDict and not module._state_dict_pre_hooks:
        module._state_dict_pre_hooks = _WithoutOurs()
    return module.register_state_dict_pre_hook(hook)


class Synchronize:
    """State_dict pre-hook: the engine's pending all-gathers waited for before ``state_dict()`` reads the
    parameters (``param_sync="forward"``). Holds the hooks' targets weakly; a copy of it (where the
    module's hooks dict could not leave it out) does nothing."""

    def __init__(self, targets: HookTargets):
        self.targets = weakref.ref(targets)

    def __call__(self, module, prefix, keep_vars) -> None:
        targets: HookTargets | None = self.targets()
        if targets is not None:
            targets.synchronize()

    def __deepcopy__(self, memo):
        return NOTHING

    def __reduce__(self):
        return functools.partial, (slice,)


NOTHING = functools.partial(slice)
"""What a copied ``Synchronize`` is: it takes the hook's three arguments and changes nothing, and it
pickles as builtins only, so that a saved copy loads where fused_zero is not installed."""


def register_module_hooks(root: nn.Module, targets: HookTargets, gathered: dict, used_local, handles: list) -> None:
    """The hooks on the module ``root`` and its parameters: each module's forward waits for the
    parameters it can reach, ``state_dict()`` for every one, and, where DDP may skip some (``used_local``,
    the reduction's flags, else None), which got a gradient. ``gathered``: parameter -> index, of those a
    fused_zero optimizer updates. Registered again when parameters join an optimizer
    (pipeline/added_groups.py)."""
    for module in root.modules():
        pids = sorted({gathered[p] for p in reach(module, root) if p in gathered})
        if pids or module is root:
            handles.append(forward_pre_hook(module, ForwardWait(targets, pids, module is root)))
    # model.state_dict() reads the parameters: give it their updated values
    handles.append(state_dict_pre_hook(root, Synchronize(targets)))
    if used_local is not None:
        for p, pid in gathered.items():
            handles.append(p.register_post_accumulate_grad_hook(MarkUsed(used_local, pid)))


def reach(module: nn.Module, root: nn.Module):
    """The parameters ``module``'s forward may read, as far as fused_zero can tell (module docstring)."""
    own_only = isinstance(module, CONTAINERS) or (module is root and not _from_torch_nn(module))
    return module.parameters(recurse=not own_only)


def _from_torch_nn(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.nn.")


class HookState:
    """The comm hook's state, which DDP's C++ reducer holds: the hooks' targets (which the engine holds),
    weakly. Python's garbage collector cannot see into the reducer, so a strong reference (engine -> DDP
    module -> reducer -> engine) is a cycle nothing frees: every DDP module and optimizer a process ever
    built, with their process groups and gloo threads (which spin), kept for the process's life: a sweep,
    a notebook, a test suite's kept ranks (measured: 3 gloo loops more per run, 5% of a core per process
    at 31)."""

    __slots__ = ("targets",)

    def __init__(self, targets: HookTargets):
        self.targets = weakref.ref(targets)


def _comm_hook(state: HookState, bucket):
    targets: HookTargets | None = state.targets()
    if targets is None:
        raise RuntimeError("the fused_zero optimizer built for this DDP module is gone (nothing referenced "
                           "it, so it was freed) and its comm hook cannot update the buckets: keep the "
                           "optimizer for as long as the DDP module trains")
    return targets.on_bucket(bucket)


class ForwardWait:
    """Forward pre-hook: wait for the gathers of the buckets holding the parameters this module's
    forward can reach (``reach``); the root also raises a refusal another rank made known and orders
    the compute stream after the side stream. Holds the hooks' targets weakly: kept in a map keyed by the
    module (``forward_pre_hook``), a strong reference would keep the module, and the engine, forever."""

    def __init__(self, targets: HookTargets, pids: list[int], root: bool):
        self.targets, self.pids, self.root = weakref.ref(targets), pids, root

    def __call__(self, module, args):
        targets: HookTargets | None = self.targets()
        if targets is None:
            return
        if self.root:
            targets.check_refusals()  # one another rank made known (refusals.py)
            targets.side.join()
        where = targets.registry.where
        for pid in self.pids:
            shard = where[pid][0]
            if shard.gather.pending is not None:
                with range_push("fused_zero.forward_wait"):
                    shard.gather.finish()


class MarkUsed:
    """Post-accumulate-grad hook: this rank produced a gradient for the parameter (into the reduction's
    ``used_local`` flags)."""

    def __init__(self, used_local, pid: int):
        self.used_local, self.pid = used_local, pid

    def __call__(self, param):
        self.used_local[self.pid] = True


class FinalizeWatch:
    """torch 2.15's ``ddp.require_manual_backward_finalization = True``: DDP writes the reduced gradients
    back into ``param.grad`` in ``ddp.finalize_backward()``, which the user calls after the backward (or
    from a backward hook), not in its own end-of-backward callback. That write is DDP finishing the
    backward, not a user's edit of ``.grad``: the gradients are recorded again once it returns
    (pipeline/reducing/grad_watch.py). Installed on the DDP instance; ``remove()`` puts DDP's own method back."""

    def __init__(self, targets: HookTargets, ddp):
        self.targets = weakref.ref(targets)
        self.ddp = ddp
        self.own = ddp.__dict__.get("finalize_backward")  # an instance attribute already there, if any
        ddp.finalize_backward = self

    def __call__(self, *args, **kwargs):
        finalize = self.own if self.own is not None else type(self.ddp).finalize_backward.__get__(self.ddp)
        out = finalize(*args, **kwargs)
        targets: HookTargets | None = self.targets()
        if targets is not None:
            targets.watch.record_again()
        return out

    def remove(self) -> None:
        if self.own is not None:
            self.ddp.finalize_backward = self.own
        else:
            self.ddp.__dict__.pop("finalize_backward", None)
