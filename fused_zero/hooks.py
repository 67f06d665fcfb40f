"""Everything fused_zero registers on the user's modules: DDP's comm hook, the forward pre-hooks that
wait for the all-gathers, the state_dict pre-hook and, where DDP may skip parameters, the hooks that
record which parameters got a gradient on this rank."""

from __future__ import annotations

from .profiling import range_push


def register(engine) -> list:
    """Register every hook of ``engine``; return the removable handles (the comm hook has none)."""
    ddp = engine.ddp
    try:
        ddp.register_comm_hook(engine, _comm_hook)
    except RuntimeError as e:
        # DDP records the refused hook before its reducer refuses it: drop it, and with it the engine
        recorded = getattr(ddp, "_comm_hooks", [])
        if recorded and recorded[-1][1] is engine:
            recorded.pop()
        raise RuntimeError(
            "this DDP module already has a comm hook; fused_zero registers its own to update each "
            "bucket as it is reduced. Build the DDP without register_comm_hook, or build one "
            "fused_zero optimizer per DDP") from e
    handles = []
    root = ddp.module
    for module in root.modules():
        pids = [engine.pid_of[p] for p in module.parameters(recurse=False) if p in engine.pid_of]
        if pids or module is root:
            handles.append(module.register_forward_pre_hook(ForwardWait(engine, pids, module is root)))
    # model.state_dict() reads the parameters: give it their updated values
    handles.append(root.register_state_dict_pre_hook(lambda *a, **k: engine.synchronize()))
    if engine.track_used:
        for pid, p in enumerate(engine.params):
            handles.append(p.register_post_accumulate_grad_hook(MarkUsed(engine, pid)))
    return handles


def _comm_hook(engine, bucket):
    return engine.on_bucket(bucket)


class ForwardWait:
    """Forward pre-hook: wait for the gathers of the buckets holding this module's own parameters."""

    def __init__(self, engine, pids: list[int], root: bool):
        self.engine, self.pids, self.root = engine, pids, root

    def __call__(self, module, args):
        if self.root:
            self.engine.side.join()
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
        self.engine.used_local[self.pid] = True
