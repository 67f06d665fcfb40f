"""The stand-ins the checker patches over fused_zero's own calls for its duration (checker.py
``__enter__``): the collectives, as NCCL orders them, and the update and norm launches, each seen as one
kernel (its rows' slices read and written) instead of the torch operations the CPU path makes of it.
In a CUDA graph's capture each also records what a replay runs again (graphs.py)."""

from __future__ import annotations

import importlib
import pkgutil

import torch
import torch.distributed as dist
import torch.optim

from ...pipeline.comm import collectives
from .device import ModeledWork
from .graphs import replayed


def _group_of(args, kwargs):
    if "group" in kwargs:
        return kwargs["group"]
    for a in reversed(args):
        if a is None or isinstance(a, dist.ProcessGroup):
            return a
    return None


def collective(checker, real, facts: collectives.Facts):
    """A collective as NCCL orders it: queued on the group's stream after the issuing stream; the
    Work orders its waiter after it. ``facts``: what it reads and writes, and whether it takes
    ``async_op`` (the others block their caller: modeled as a wait at once), as collectives.py declares."""
    def modeled(*args, **kwargs):
        reads = [args[i] for i in facts.reads if isinstance(args[i], torch.Tensor)]
        writes = [t for i in facts.writes for t in (args[i] if isinstance(args[i], (list, tuple)) else [args[i]])
                  if isinstance(t, torch.Tensor)]
        sid = checker._comm_stream(_group_of(args, kwargs))
        capture = checker.capturing()
        if capture is not None:  # the communication stream forks from the capturing one
            capture.wait(sid, capture.snapshot(checker.current), f"the {checker.clocks.names[checker.current]}")
        else:
            checker.clocks.merge(sid, checker.clocks.snapshot(checker.current))
        checker.record(f"collectives.{real.__name__}", reads=reads, writes=writes, sid=sid)
        takes_async = facts.asynchronous
        with checker.paused():
            work = real(*args, **{**kwargs, "async_op": True}) if takes_async else real(*args, **kwargs)
        if capture is not None:
            capture.operations.append(lambda: real(*args, **kwargs) if not takes_async else
                                      real(*args, **{**kwargs, "async_op": True}).wait())
        modeled_work = ModeledWork(checker, work if takes_async else None, checker.clocks.snapshot(sid), writes,
                                   capture.point(sid) if capture is not None else None)
        if not (takes_async and kwargs.get("async_op", True)):
            modeled_work.wait()
        return modeled_work
    return modeled


def launch_apply(checker, real):
    """The update launch as one kernel: what it reads and writes (its rows' slices), on the current stream."""
    def apply(algo, backend, rows, segments, coefs, args):
        reads = [coefs] + ([segments.rows] if segments is not None else []) + \
            [t for t in (args.grad_scale, args.found_inf, args.clip_coef) if t is not None]
        reads += [args.grad[go:go + n] for _, n, _, go, *_ in rows]
        writes = [args.param[po:po + n] for _, n, po, *_ in rows]
        writes += [t[so:so + n] for t in args.state.values() for so, n, *_ in rows]
        writes += list((args.scales or {}).values())  # one per row of the launch: whole tensors
        checker.record("update kernel", reads=reads + writes, writes=writes)
        capture = checker.capturing()
        if capture is not None:
            capture.operations.append(lambda: real(algo, backend, rows, segments, coefs, args))
        with checker.paused():
            return real(algo, backend, rows, segments, coefs, args)
    return apply


def launch_norm(checker, real):
    """The norm pass as one kernel, likewise."""
    def grad_sumsq(backend, rows, segments, coefs, grad, grad_scale=None, out=None, partials=None):
        reads = [coefs] + ([segments.rows] if segments is not None else []) + \
            ([grad_scale] if grad_scale is not None else []) + [grad[go:go + n] for _, n, _, go, *_ in rows]
        capture = checker.capturing()
        with checker.paused():
            result = real(backend, rows, segments, coefs, grad, grad_scale, out, partials)
        if capture is not None:
            capture.operations.append(replayed(real, (backend, rows, segments, coefs, grad, grad_scale, out,
                                                      partials), {}, result))
        if out is None:
            for t in result:
                checker.memory.register(t, fresh=True)
        checker.record("norm kernel", reads=reads, writes=list(result) + [t for t in (partials,) if t is not None])
        return result
    return grad_sumsq


def capturable_on_the_host() -> list[tuple[object, str, object]]:
    """``(module, name, stand-in)``: torch.optim's capturable paths taking the modeled device's tensors.
    Those paths keep the step counts on the parameters' device and never read them on the host (what
    the engine takes on CUDA, algorithms/elementwise.py), and refuse any device but an accelerator: with
    "cpu" among the devices they accept, they run on the CPU tensors that stand for the GPU's."""
    out = []
    for info in pkgutil.iter_modules(torch.optim.__path__):
        module = importlib.import_module(f"torch.optim.{info.name}")
        real = getattr(module, "_get_capturable_supported_devices", None)
        if real is not None:
            out.append((module, "_get_capturable_supported_devices",
                        lambda supports_xla=True, real=real: [*real(supports_xla), "cpu"]))
    return out
