"""What a call costs a rank in host memory, measured without timing: the peak of torch's CPU allocations
(torch's profiler reports each allocation and free of this thread), and the bytes of the tensors an
object holds."""

import torch
from torch.profiler import ProfilerActivity, profile


def peak_bytes(fn) -> int:
    """The peak of torch's CPU allocations made while ``fn`` runs (this thread), above the start."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    now = peak = 0
    for _, n in events:
        now += n
        peak = max(peak, now)
    return peak


def tensor_bytes(obj) -> int:
    """Bytes of every tensor reachable through ``obj``'s dicts, lists and tuples (each storage once)."""
    seen, total, todo = set(), 0, [obj]
    while todo:
        o = todo.pop()
        if isinstance(o, torch.Tensor):
            storage = o.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend(o)
    return total


def state_bytes(opt) -> dict:
    """A fused_zero optimizer's state in bytes: ``own``, this rank's shards (its slices and the tail);
    ``full``, the fp32 state tensors of every parameter (a canonical dict holds them, and the steps)."""
    shards = opt._engine.shards()
    return {"own": sum(s.state_bytes() for s in shards),
            "full": sum(s.layout.numel * 4 * len(s.names) for s in shards)}


__all__ = ["peak_bytes", "state_bytes", "tensor_bytes"]
