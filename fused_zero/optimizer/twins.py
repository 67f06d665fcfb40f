"""fused_zero's twins of torch.optim's elementwise optimizers (update/elementwise.py): Adagrad, Adadelta,
Adamax, ASGD, NAdam, RAdam, RMSprop and Rprop; and of Adafactor (update/adafactor.py).

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

from ..update.adafactor import SPEC as ADAFACTOR
from ..update.adafactor import AdafactorAlgorithm
from ..update.elementwise import SPECS, ElementwiseAlgorithm
from .base import _ShardedOptimizer

NO_TWIN = {
    "LBFGS": "its step() re-evaluates the whole model through a closure several times, with a history of "
             "whole-model vectors; no rank's slice of the buckets can take such a step. Run torch.optim.LBFGS "
             "under plain DDP",
    "SparseAdam": "it takes sparse gradients (nn.Embedding(sparse=True)), which DDP does not reduce in buckets; "
                  "keep torch.optim.SparseAdam for those parameters beside a fused_zero optimizer over the rest",
}
"""torch.optim's optimizers without a fused_zero twin, and why (``fused_zero.LBFGS`` raises it)."""


def _spec(name: str):
    return ADAFACTOR if name == "Adafactor" else SPECS[name]


def _torch_defaults(cls: type, args: tuple, kwargs: dict) -> dict:
    """The torch.optim class's ``defaults`` for these arguments, its own checks run on them."""
    stand_in = torch.zeros((), requires_grad=True)
    return dict(cls([stand_in], *args, **kwargs).defaults)


class _Twin(_ShardedOptimizer):
    _spec_name: str

    def __init__(self, params, *args, ddp=None, **kwargs):
        spec = _spec(self._spec_name)
        accepted = inspect.signature(spec.torch_class.__init__).parameters
        torch_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in accepted and k not in ("self", "params")}
        defaults = _torch_defaults(spec.torch_class, args, torch_kwargs)
        super().__init__(params, defaults)
        algorithm = AdafactorAlgorithm(self.param_groups, self.defaults) if spec is ADAFACTOR else \
            ElementwiseAlgorithm(spec, self.param_groups, self.defaults)
        algorithm.check_options(kwargs, spec.name)
        for i, group in enumerate(self.param_groups):
            if "state_format" in group:
                algorithm.check_options({"state_format": group["state_format"]}, f"param group {i}")
        self._start(ddp, algorithm, kwargs, differentiable=bool(defaults.get("differentiable", False)))


def _twin(name: str) -> type:
    spec = _spec(name)
    signature = inspect.signature(spec.torch_class.__init__)
    doc = (f"torch.optim.{name}, sharded across DDP ranks: its arguments, defaults and checks (the installed "
           f"torch's), its update (torch's own, over this rank's slices of the buckets) and its state dict; "
           "plus ``ddp`` and the sharding options (options.OPTIONS), keyword-only.\n\n"
           f"torch.optim.{name}{signature}")
    cls = type(name, (_Twin,), {"_spec_name": name, "__doc__": doc, "__module__": "fused_zero"})
    return cls


Adagrad = _twin("Adagrad")
Adadelta = _twin("Adadelta")
Adamax = _twin("Adamax")
ASGD = _twin("ASGD")
NAdam = _twin("NAdam")
RAdam = _twin("RAdam")
RMSprop = _twin("RMSprop")
Rprop = _twin("Rprop")
Adafactor = _twin("Adafactor")

TWINS = ("Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop")

_OWN = (("AdamW", "exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad)", "bf16, 8bit",
         "the fused Triton kernel (the CPU: torch's ops)"),
        ("Adam", "exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad)", "bf16, 8bit",
         "the fused Triton kernel (the CPU: torch's ops)"),
        ("SGD", "momentum_buffer (with momentum)", "bf16, 8bit", "the fused Triton kernel (the CPU: torch's ops)"),
        ("Muon", "momentum_buffer", "-", "Newton-Schulz once per matrix, on its owner rank"))


def optimizer_table() -> str:
    """A markdown table of fused_zero's optimizers (``fused-zero options`` prints it above the options')."""
    rows = ["| fused_zero | torch.optim twin | state per parameter, 1/W per rank | compact `state_format` "
            "| update |",
            "|---|---|---|---|---|"]
    for name, state, compact, how in _OWN:
        rows.append(f"| `{name}` | `torch.optim.{name}` | {state} | {compact} | {how} |")
    for name in TWINS:
        spec = SPECS[name]
        state = ", ".join(n for n in spec.state if n not in spec.optional) + (
            f" (+ {', '.join(spec.optional)} where the group's momentum / centered ask)" if spec.optional else "")
        scalars = f"; step, {', '.join(spec.scalars)} on every rank" if spec.scalars else "; step"
        rows.append(f"| `{name}` | `torch.optim.{name}` | {state}{scalars} | {'bf16' if spec.moments else '-'} | "
                    "torch's own update function over the rank's slices |")
    for name, why in NO_TWIN.items():
        rows.append(f"| none | `torch.optim.{name}` | - | - | {why.split(';')[0]} |")
    rows.append("| `Adafactor` | `torch.optim.Adafactor` | row_var, col_var of a matrix, variance of a vector; step: "
                "on every rank | - | torch's own update on each parameter whole, on every rank |")
    return "\n".join(rows)

__all__ = ["ASGD", "Adafactor", "NO_TWIN", "TWINS", "optimizer_table", "Adadelta", "Adagrad", "Adamax", "NAdam",
           "RAdam", "RMSprop", "Rprop"]
