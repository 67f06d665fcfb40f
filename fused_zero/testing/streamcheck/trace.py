"""Seeing every tensor operation: a ``TorchDispatchMode`` records what each aten operation reads and
writes (from its schema's alias information, as torch's own CUDA sanitizer does), on the stream it
would run on; stand-ins patched on torch for the checker's duration see the calls that only make sense
on a real device (a tensor made on the host, a blocking copy to the device, a read of a device value by
the host).

On the CPU every tensor is a CPU tensor, so "host memory" is what the program makes as host memory:
pinned buffers (through the stream calls), ``torch.from_numpy``, and tensors made from Python data or
by a factory without a ``device=`` torch.device. Everything else is device memory.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .graphs import replayed

_HOST_FACTORIES = ("tensor", "as_tensor", "asarray", "zeros", "ones", "empty", "full", "arange", "randn", "rand",
                   "randint", "randperm")
_METADATA_ONLY = {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "new_empty",
                  "new_zeros", "new_ones", "new_full", "new_empty_strided"}
"""Operations whose tensor arguments give only shape, dtype and device: nothing is read."""
_HOST_READS = {"tolist": "tensor.tolist()", "numpy": "tensor.numpy()", "cpu": "tensor.cpu()"}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):  # the common case, without flattening
        return [value] if _has_storage(value) else []
    return [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor) and _has_storage(v)]


def _has_storage(t: torch.Tensor) -> bool:
    """False for a wrapper subclass without memory of its own (a DTensor, DCP's LocalShardsWrapper): the
    tensors it wraps are the memory, made and copied by operations of their own."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return True
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:
        return False
    return True


def _device_arg(args, kwargs):
    """The target device of a ``Tensor.to`` call, or None when it only changes the dtype."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args:
        if isinstance(a, (torch.device, str)):
            return a
        if isinstance(a, torch.Tensor):
            return a.device
    return None


def function_patches(checker) -> list[tuple[object, str, object]]:
    """``(owner, name, stand-in)`` for the torch functions and tensor methods the checker must see with
    their Python arguments. Patched on their modules (not a ``TorchFunctionMode``: the backward's hooks,
    where the comm hook builds tables, run without the caller's function modes)."""
    out = []
    for name in _HOST_FACTORIES:
        out.append((torch, name, _factory(checker, getattr(torch, name))))
    for name, what in _HOST_READS.items():
        out.append((torch.Tensor, name, _host_read(checker, getattr(torch.Tensor, name), what)))
    out.append((torch.Tensor, "to", _to(checker, torch.Tensor.to)))
    return out


def _factory(checker, real):
    def factory(*args, **kwargs):
        if checker.is_paused() or (args and isinstance(args[0], torch.Tensor)):
            return real(*args, **kwargs)
        # made without a ``device=`` torch.device: host memory (the engine's own device tensors always
        # name one; "cpu" as a string is how fused_zero asks for host memory explicitly)
        device = kwargs.get("device")
        host = device is None or isinstance(device, str)
        pinned = host and bool(kwargs.get("pin_memory"))
        with checker.paused():
            out = real(*args, **kwargs)
        made = _tensors(out)
        capture = checker.capturing()
        if capture is not None:
            capture.operations.append(replayed(real, args, kwargs, out))
        kind = "pinned" if pinned else "host" if host else "device"
        for t in made:
            checker.memory.register(t, host=host, name=f"{kind} {real.__name__} {tuple(t.shape)}", pinned=pinned,
                                    fresh=True)
        if real.__name__ != "empty":  # the values it fills in are a write, on the stream it runs on
            checker.record(f"torch.{real.__name__}", writes=made)
        return out
    return factory


def _host_read(checker, real, what: str):
    def read(self, *args, **kwargs):
        if not checker.is_paused() and not checker.memory.is_host(self):
            checker.host_read(self, what)
        return real(self, *args, **kwargs)
    return read


def _to(checker, real):
    def to(self, *args, **kwargs):
        target = _device_arg(args, kwargs)
        if target is not None and not checker.is_paused():
            source_host = checker.memory.is_host(self)
            to_host = isinstance(target, str) and target == "cpu"
            if source_host and not to_host:
                if not kwargs.get("non_blocking", False):
                    checker.log_sync("blocking host-to-device copy (tensor.to(device) from pageable memory)")
                # a copy in device memory, as on a GPU (on the CPU ``to`` hands back the host tensor itself)
                with checker.paused():
                    out = real(self, *args, **{**kwargs, "copy": True})
                capture = checker.capturing()
                if capture is not None:
                    capture.operations.append(replayed(real, (self, *args), {**kwargs, "copy": True}, out))
                checker.memory.register(out, name=f"device copy {tuple(out.shape)}", fresh=True)
                checker.record("tensor.to(device)", reads=[self], writes=[out], transfer=True)
                return out
            if not source_host and to_host:
                checker.host_read(self, "tensor.to('cpu')")
        return real(self, *args, **kwargs)
    return to


class DispatchCalls(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No ``torch._disable_dynamo`` wrapper around every call: nothing is compiled under the checker,
        and the wrapper cost as much as the rest of the checker's work per operation."""
        return False

    def __init__(self, checker):
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        checker = self.checker
        if checker.is_paused():
            return out
        capture = checker.capturing()
        if capture is not None:  # what a replay runs again (graphs.py)
            capture.operations.append(replayed(func, args, kwargs, out))
        sig = _SIGNATURES.get(func) or _signature(func)
        memory = checker.memory
        if sig.lifts:  # Python data (an index list, a number) made a tensor
            for t in _tensors(out):
                memory.register(t, host=True, name=f"host data {tuple(t.shape)}", fresh=True)
            return out
        reads, writes, inputs = [], [], []
        n_args = len(args)
        for i, name, kw_only, kind in sig.arguments:
            if kw_only or i >= n_args:
                if name not in kwargs:
                    continue
                value = kwargs[name]
            else:
                value = args[i]
            if isinstance(value, torch.Tensor):
                found = (value,) if _has_storage(value) else ()
            elif isinstance(value, (list, tuple)):
                found = [v for v in value if isinstance(v, torch.Tensor) and _has_storage(v)]
            else:
                continue
            inputs += found
            if kind is _WRITE:
                writes += found
            elif kind is _READ:
                reads += found
        fresh = []
        results = out if isinstance(out, (tuple, list)) else (out,)
        for fresh_return, value in zip(sig.fresh_returns, results):
            if fresh_return:
                fresh += _tensors(value)
        # a 0-dim input (a wrapped number, a scalar) does not make an operation's output device memory,
        # as CUDA takes 0-dim CPU tensors anywhere; an operation of scalars and Python numbers only makes
        # a host scalar
        shaped = [t for t in inputs if t.dim()] or inputs
        host = all(memory.is_host(t) for t in shaped) if shaped else all(t.dim() == 0 for t in fresh)
        origin = memory.origin(shaped[0]) if host and shaped and shaped[0].dim() else ""
        for t in fresh:
            memory.register(t, host=host, origin=origin, fresh=True)
        # a copy from host memory into device memory is a transfer, not a device operation on host
        # memory: CUDA makes it from any host memory, with a host wait from pageable memory
        transfer = sig.copies and not memory.is_host(args[0]) and memory.is_host(args[1])
        if transfer and memory.is_pageable(args[1]):
            checker.log_sync("blocking host-to-device copy (copy_ from pageable memory)")
        checker.record(sig.op, reads=reads, writes=writes + fresh, transfer=transfer)
        if sig.reads_a_value and reads and not memory.is_host(reads[0]):
            checker.host_read(reads[0], "a device value read by the host (item(), bool(), float())", record=False)
        return out


_READ, _WRITE = "read", "write"


class _Signature:
    """What one aten operation's schema says, read once per operation (the schema's Python bindings
    are slow to ask on every call): per argument, its position, name and whether its tensors are read
    (no alias information), written (``Tensor(a!)``) or neither (a view's base, a factory's template);
    per return, whether it is fresh memory (no alias information)."""

    def __init__(self, func):
        schema = func._schema
        name = str(func.overloadpacket.__name__)
        self.op = f"aten.{name}"
        self.lifts = name in ("lift_fresh", "lift_fresh_copy")
        self.copies = name == "copy_"
        self.reads_a_value = name == "_local_scalar_dense"
        self.arguments = []
        for i, argument in enumerate(schema.arguments):
            info = argument.alias_info
            kind = _WRITE if info is not None and info.is_write else \
                _READ if info is None and name not in _METADATA_ONLY else None
            self.arguments.append((i, argument.name, argument.kwarg_only, kind))
        self.fresh_returns = [ret.alias_info is None for ret in schema.returns]


_SIGNATURES: dict = {}


def _signature(func) -> _Signature:
    sig = _SIGNATURES[func] = _Signature(func)
    return sig
