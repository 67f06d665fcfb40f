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

import weakref

from torch import nn

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


def register(engine, handles: list) -> None:
    """Register every hook of ``engine``, appending the removable handles to ``handles`` as they are
    made (so that a failure midway can remove those already there); DDP's comm hook, which cannot be
    removed, comes last."""
    ddp = engine.ddp
    root = ddp.module
    gathered = {p: pid for p, pid in engine.pid_of.items() if engine.member_of[pid] >= 0}  # not NO_MEMBER's
    for module in root.modules():
        pids = sorted({gathered[p] for p in reach(module, root) if p in gathered})
        if pids or module is root:
            handles.append(module.register_forward_pre_hook(ForwardWait(engine, pids, module is root)))
    # model.state_dict() reads the parameters: give it their updated values
    handles.append(root.register_state_dict_pre_hook(lambda *a, **k: engine.synchronize()))
    if engine.reduction.track_used:
        for p, pid in gathered.items():
            handles.append(p.register_post_accumulate_grad_hook(MarkUsed(engine, pid)))
    if hasattr(ddp, "finalize_backward"):  # torch 2.15's manual backward finalization
        handles.append(FinalizeWatch(engine, ddp))
    state = HookState(engine)
    try:
        ddp.register_comm_hook(state, _comm_hook)
    except RuntimeError:
        # DDP records the refused hook before its reducer refuses it: drop it, and with it the engine
        recorded = getattr(ddp, "_comm_hooks", [])
        if recorded and recorded[-1][1] is state:
            recorded.pop()
        raise


def reach(module: nn.Module, root: nn.Module):
    """The parameters ``module``'s forward may read, as far as fused_zero can tell (module docstring)."""
    own_only = isinstance(module, CONTAINERS) or (module is root and not _from_torch_nn(module))
    return module.parameters(recurse=not own_only)


def _from_torch_nn(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.nn.")


class HookState:
    """The comm hook's state, which DDP's C++ reducer holds: the engine, weakly. Python's garbage
    collector cannot see into the reducer, so a strong reference (engine -> DDP module -> reducer ->
    engine) is a cycle nothing frees: every DDP module and optimizer a process ever built, with their
    process groups and gloo threads (which spin), kept for the process's life: a sweep, a notebook, a
    test suite's kept ranks (measured: 3 gloo loops more per run, 5% of a core per process at 31)."""

    __slots__ = ("engine",)

    def __init__(self, engine):
        self.engine = weakref.ref(engine)


def _comm_hook(state: HookState, bucket):
    engine = state.engine()
    if engine is None:
        raise RuntimeError("the fused_zero optimizer built for this DDP module is gone (nothing referenced "
                           "it, so it was freed) and its comm hook cannot update the buckets: keep the "
                           "optimizer for as long as the DDP module trains")
    return engine.on_bucket(bucket)


class ForwardWait:
    """Forward pre-hook: wait for the gathers of the buckets holding the parameters this module's
    forward can reach (``reach``); the root also raises a refusal another rank made known and orders
    the compute stream after the side stream."""

    def __init__(self, engine, pids: list[int], root: bool):
        self.engine, self.pids, self.root = engine, pids, root

    def __call__(self, module, args):
        if self.root:
            engine = self.engine
            engine.policy.refusals.check(wait=False)  # one another rank made known (refusals.py)
            engine.side.join()
        where = self.engine.registry.where
        for pid in self.pids:
            shard = where[pid][0]
            if shard.gather is not None:
                with range_push("fused_zero.forward_wait"):
                    shard.wait_gather()


class MarkUsed:
    """Post-accumulate-grad hook: this rank produced a gradient for the parameter."""

    def __init__(self, engine, pid: int):
        self.engine, self.pid = engine, pid

    def __call__(self, param):
        self.engine.reduction.used_local[self.pid] = True


class FinalizeWatch:
    """torch 2.15's ``ddp.require_manual_backward_finalization = True``: DDP writes the reduced gradients
    back into ``param.grad`` in ``ddp.finalize_backward()``, which the user calls after the backward (or
    from a backward hook), not in its own end-of-backward callback. That write is DDP finishing the
    backward, not a user's edit of ``.grad``: the gradients are recorded again once it returns
    (pipeline/reducing/grad_watch.py). Installed on the DDP instance; ``remove()`` puts DDP's own method back."""

    def __init__(self, engine, ddp):
        self.engine = weakref.ref(engine)
        self.ddp = ddp
        self.own = ddp.__dict__.get("finalize_backward")  # an instance attribute already there, if any
        ddp.finalize_backward = self

    def __call__(self, *args, **kwargs):
        finalize = self.own if self.own is not None else type(self.ddp).finalize_backward.__get__(self.ddp)
        out = finalize(*args, **kwargs)
        engine = self.engine()
        if engine is not None:
            engine.policy.watch.record_again()
        return out

    def remove(self) -> None:
        if self.own is not None:
            self.ddp.finalize_backward = self.own
        else:
            self.ddp.__dict__.pop("finalize_backward", None)
