"""fused_zero's twins made from torch's own constructors: one class per declaration of algorithms/registry.py
marked ``generic`` (the elementwise twins of algorithms/elementwise.py's ``SPECS``, and Adafactor:
algorithms/adafactor.py), and the optimizer table ``fused-zero options`` prints.

Each takes torch.optim.<Name>'s arguments, positional and keyword, with the installed torch's defaults
and checks: its arguments go through torch.optim.<Name>'s own constructor (over one scalar stand-in
parameter), whose errors are the user's, and whose ``defaults`` become the twin's, key for key, so
that state dicts move between the two. The sharding options (options.OPTIONS) and ``ddp`` are
keyword-only beside them, as for every fused_zero optimizer.

torch.optim's ``LBFGS`` and ``SparseAdam`` have no twin: LBFGS's step re-evaluates the whole model
through a closure, several times per step, with a history of whole-model vectors, which no slice of a
bucket can run; SparseAdam takes sparse gradients, which DDP does not put in buckets.
"""

from __future__ import annotations

import inspect

import torch

from ..algorithms import registry
from ..algorithms.interface import Declaration
from .base import ShardedOptimizer

NO_TWIN = {
    "LBFGS": "its step() re-evaluates the whole model through a closure several times, with a history of "
             "whole-model vectors; no rank's slice of the buckets can take such a step. Run torch.optim.LBFGS "
             "under plain DDP",
    "SparseAdam": "it takes sparse gradients (nn.Embedding(sparse=True)), which DDP does not reduce in buckets; "
                  "keep torch.optim.SparseAdam for those parameters beside a fused_zero optimizer over the rest",
}
"""torch.optim's optimizers without a fused_zero twin, and why (``fused_zero.LBFGS`` raises it)."""

TWINS = registry.TWINS


def _torch_defaults(cls: type, args: tuple, kwargs: dict) -> dict:
    """The torch.optim class's ``defaults`` for these arguments, its own checks run on them."""
    stand_in = torch.zeros((), requires_grad=True)
    return dict(cls([stand_in], *args, **kwargs).defaults)


class _Twin(ShardedOptimizer):
    _declaration: Declaration

    def __init__(self, params, *args, ddp=None, **kwargs):
        declared = self._declaration
        accepted = inspect.signature(declared.torch_class.__init__).parameters
        torch_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in accepted and k not in ("self", "params")}
        defaults = _torch_defaults(declared.torch_class, args, torch_kwargs)
        super().__init__(params, defaults)
        algorithm = declared.algorithm(self.param_groups, self.defaults)
        algorithm.check_options(kwargs, declared.name)
        for i, group in enumerate(self.param_groups):
            if "state_format" in group:
                algorithm.check_options({"state_format": group["state_format"]}, f"param group {i}")
        self._start(ddp, algorithm, kwargs, differentiable=bool(defaults.get("differentiable", False)))


def _twin(declared: Declaration) -> type:
    name = declared.name
    signature = inspect.signature(declared.torch_class.__init__)
    doc = (f"torch.optim.{name}, sharded across DDP ranks: its arguments, defaults and checks (the installed "
           f"torch's), its update (torch's own, over this rank's slices of the buckets) and its state dict; "
           "plus ``ddp`` and the sharding options (options.OPTIONS), keyword-only.\n\n"
           f"torch.optim.{name}{signature}")
    return type(name, (_Twin,), {"_declaration": declared, "__doc__": doc, "__module__": "fused_zero"})


CLASSES: dict[str, type] = {d.name: _twin(d) for d in registry.DECLARATIONS if d.generic}
"""The twins' classes, by name (fused_zero.optimizer.OPTIMIZERS holds them beside the written ones)."""

globals().update(CLASSES)


def optimizer_table() -> str:
    """A markdown table of fused_zero's optimizers (``fused-zero options`` prints it above the options'),
    and of torch.optim's without a twin."""
    rows = ["| fused_zero | torch.optim twin | state per parameter, 1/W per rank | compact `state_format` "
            "| update |",
            "|---|---|---|---|---|"]
    for d in registry.DECLARATIONS:
        rows.append(f"| `{d.name}` | `torch.optim.{d.torch_class.__name__}` | {d.state} | {d.compact} | {d.how} |")
    for name, why in NO_TWIN.items():
        rows.append(f"| none | `torch.optim.{name}` | - | - | {why.split(';')[0]} |")
    return "\n".join(rows)


__all__ = [*CLASSES, "CLASSES", "NO_TWIN", "TWINS", "optimizer_table"]
