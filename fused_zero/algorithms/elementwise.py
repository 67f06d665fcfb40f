"""torch.optim's elementwise optimizers (``SPECS``: Adagrad, RMSprop and the others) over a rank's element
slices of the buckets, by torch's own update functions; each declared by its ``Spec`` alone.

Each of these updates every element of a parameter from that element's gradient and state alone, with
scalars that depend on the parameter (its step count, NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``)
and its param group. So a piece of a parameter updated by ``torch.optim.<module>.<function>`` (the
functional form torch.optim's ``step()`` calls) gets the bits the whole parameter would: the same ops on
the same values, with the same Python scalars. The pieces are views of the rank's state region (decoded
copies for bf16 moments) and of its fp32 masters; nothing is reimplemented, so each torch release's
own update runs, with its own fixes. The function chooses torch's implementation as torch.optim does:
the param group's ``foreach`` (None: single-tensor on the CPU, ``_foreach`` ops over the slice views on
CUDA, one call per param group and launch).

What torch keeps per parameter beside the tensors is kept here, replicated on every rank:
* ``step``: the engine's device counts (pipeline/updating/step_counts.py), read in the coefficient table's
  ``step`` column: a fresh float32 tensor per call, as torch.optim keeps it, which the function adds one
  to and which is then dropped (the engine counts).
* the 0-dim scalars (``scalars``), one tensor per parameter on the update's device. A rank whose slice
  holds no element of a parameter must still advance them, so that any rank's checkpoint holds them:
  the pieces' calls read copies, and ``finish`` advances the kept ones by the same function over
  empty tensors, once per parameter and step, on every rank (the scalars' ops are then the only ones
  with elements).

Two ways to run, as the host may read the device or not:
* on the CPU (the device is the host: reads are free) the host reads the coefficient table (active
  flags, step counts) and the skip flag, skips what torch.optim skips and hands the function the step
  counts as the fresh float32 host tensors torch.optim keeps: torch.optim's bits, call for call;
* where the device runs later (CUDA: ``UpdateArgs.asynchronous``) the host reads nothing (a read would
  make the backward wait for the device inside DDP's comm hook). Every piece of the launch runs into
  working copies, with the step counts as device tensors through torch's own device-count path of the
  function (``capturable=True``; Adagrad, which has none, through torch's fused kernel, which takes device
  counts), and ``torch.where`` writes the results only where the parameter got a gradient and the step
  is not skipped (the flags stay on the device, as Muon's: pipeline/updating/whole_matrix.py). Its bits
  are torch.optim.<Name>(capturable=True)'s (Adagrad: ``fused=True``'s); docs/optimizers.md has the cost.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field

import numpy as np
import torch

from . import elementwise_calls as calls
from .elementwise_calls import COLUMNS, _lr
from .interface import Algorithm, Declaration


@dataclass(frozen=True)
class Spec:
    """One torch.optim optimizer as the sharded step runs it.

    ``lists``: the functional's per-parameter list arguments besides ``params`` and ``grads``, each the
    name of a region-shaped state tensor, of a 0-dim scalar (``scalars``), or ``"step"``.
    ``renames``: functional keyword -> how to read it from a param group (the others are the group's
    own key of that name). ``initial``: state name -> how torch fills it when the parameter's state is
    made, from the param group and the optimizer's ``defaults`` (Adagrad's accumulator starts at the
    constructor's ``initial_accumulator_value``, whatever a group says); the others start at zero.
    ``optional``: state names a param group has only under a condition (RMSprop's momentum buffer and
    centered average). ``moments``: every state tensor is a running moment, which the compact formats
    can hold (bf16); ``at_construction``: torch makes the state when the optimizer is built (Adagrad),
    so a parameter that never stepped has it. ``test``, ``bench`` and ``constructor_only``: the
    hyperparameters of its ``Declaration`` (interface.py).

    A Spec in ``SPECS`` is the whole of a twin: its algorithm, its public class (optimizer/twins.py), its
    checkpoint facts and its tests and benchmarks are made from it (docs/design-optimizers.md).
    """

    name: str
    module: str
    lists: dict[str, str]
    scalars: tuple[str, ...] = ()
    renames: dict = field(default_factory=dict)
    initial: dict = field(default_factory=dict)
    optional: dict = field(default_factory=dict)
    moments: bool = True
    at_construction: bool = False
    scalars_first: bool = False  # torch makes the scalars before the tensors (its state dict's order)
    function_name: str = ""  # the functional's name in its module, where it is not the module's
    test: dict = field(default_factory=dict)
    bench: dict | None = None
    constructor_only: tuple[str, ...] = ()

    @property
    def torch_class(self) -> type:
        return getattr(torch.optim, self.name)

    @property
    def function(self):
        return getattr(importlib.import_module(f"torch.optim.{self.module}"), self.function_name or self.module)

    @property
    def state(self) -> tuple[str, ...]:
        """The region-shaped state tensors, in torch's state-dict order."""
        return tuple(v for v in self.lists.values() if v != "step" and v not in self.scalars)

    @property
    def order(self) -> tuple[str, ...]:
        """The keys of a parameter's entry in torch's state dict, in torch's order."""
        return ("step",) + (self.scalars + self.state if self.scalars_first else self.state + self.scalars)


def _betas(i: int):
    return lambda g: g["betas"][i]


SPECS = {spec.name: spec for spec in (
    Spec("Adagrad", "adagrad", {"state_sums": "sum", "state_steps": "step"},
         initial={"sum": lambda g, d: d["initial_accumulator_value"]}, at_construction=True,
         test=dict(lr=5e-2, lr_decay=1e-3, weight_decay=0.01, initial_accumulator_value=0.1), bench=dict(lr=1e-2),
         constructor_only=("initial_accumulator_value",)),
    Spec("Adadelta", "adadelta", {"square_avgs": "square_avg", "acc_deltas": "acc_delta", "state_steps": "step"},
         test=dict(lr=1.0, rho=0.9, weight_decay=0.01), bench=dict(lr=1.0)),
    Spec("Adamax", "adamax", {"exp_avgs": "exp_avg", "exp_infs": "exp_inf", "state_steps": "step"},
         renames={"beta1": _betas(0), "beta2": _betas(1)}, test=dict(lr=1e-2, weight_decay=0.01),
         bench=dict(lr=2e-3)),
    Spec("ASGD", "asgd", {"axs": "ax", "mus": "mu", "etas": "eta", "state_steps": "step"}, scalars=("eta", "mu"),
         initial={"eta": lambda g, d: g["lr"], "mu": lambda g, d: 1.0}, moments=False, scalars_first=True,
         test=dict(lr=5e-2, lambd=1e-3, t0=3, weight_decay=0.01), bench=dict(lr=1e-2)),
    Spec("NAdam", "nadam", {"exp_avgs": "exp_avg", "exp_avg_sqs": "exp_avg_sq", "mu_products": "mu_product",
                            "state_steps": "step"}, scalars=("mu_product",),
         renames={"beta1": _betas(0), "beta2": _betas(1)}, initial={"mu_product": lambda g, d: 1.0},
         scalars_first=True, test=dict(lr=1e-2, weight_decay=0.01, momentum_decay=4e-3), bench=dict(lr=2e-3)),
    Spec("RAdam", "radam", {"exp_avgs": "exp_avg", "exp_avg_sqs": "exp_avg_sq", "state_steps": "step"},
         renames={"beta1": _betas(0), "beta2": _betas(1)}, test=dict(lr=1e-2, weight_decay=0.01),
         bench=dict(lr=1e-3)),
    Spec("RMSprop", "rmsprop", {"square_avgs": "square_avg", "momentum_buffer_list": "momentum_buffer",
                                "grad_avgs": "grad_avg", "state_steps": "step"},
         optional={"momentum_buffer": lambda g: g["momentum"] > 0, "grad_avg": lambda g: bool(g["centered"])},
         test=dict(lr=1e-3, momentum=0.9, centered=True, weight_decay=0.01), bench=dict(lr=1e-3, momentum=0.9)),
    Spec("Rprop", "rprop", {"prevs": "prev", "step_sizes": "step_size", "state_steps": "step"},
         renames={"etaminus": lambda g: g["etas"][0], "etaplus": lambda g: g["etas"][1],
                  "step_size_min": lambda g: g["step_sizes"][0], "step_size_max": lambda g: g["step_sizes"][1]},
         initial={"step_size": lambda g, d: g["lr"]}, moments=False, test=dict(lr=1e-2), bench=dict(lr=1e-3)),
)}
"""Every torch.optim optimizer whose update is elementwise, by class name."""

_FLAGS = {"foreach", "maximize", "capturable", "differentiable", "fused"}
"""torch's constructor arguments that choose its implementation, not its update's hyperparameters (the
other arguments are the group keys of its state dict, checkpoint/checks.py)."""

_FIXED = {"grad_scale": None, "found_inf": None, "has_complex": False, "has_sparse_grad": False,
          "differentiable": False, "capturable": False}
"""Functional arguments the sharded step always passes: the gradient arrives unscaled (GradScaler's
unscale_ as torch applies it to an optimizer without a fused step), real, dense; on the CPU the counts
are fresh host tensors, which torch's non-capturable path takes (``capturable`` is set where they are
device tensors: ``ElementwiseAlgorithm.keywords``)."""


class ElementwiseAlgorithm(Algorithm):
    """A ``Spec`` over the engine's rows (module docstring): each twin's algorithm is a subclass naming
    its ``spec`` (``algorithm_of``), whose facts (interface.Algorithm's class members) are the Spec's."""

    spec: Spec

    def __init_subclass__(cls, **kwargs):
        """The declared facts of ``cls.spec``, where the subclass does not declare its own."""
        super().__init_subclass__(**kwargs)
        spec = cls.spec
        signature = inspect.signature(spec.torch_class.__init__).parameters
        facts = dict(kind=spec.name.lower(), title=spec.name, state_keys=spec.state + spec.scalars,
                     group_keys=tuple(k for k in signature if k not in ("self", "params") and k not in _FLAGS),
                     state_order=spec.order, kept_names=spec.scalars, finishes=bool(spec.scalars))
        for name, value in facts.items():
            if name not in cls.__dict__:
                setattr(cls, name, value)

    def __init__(self, param_groups: list[dict], defaults: dict):
        self.defaults = defaults
        signature = inspect.signature(self.spec.function).parameters
        self._keywords = [n for n in signature if n not in ("params", "grads") and n not in self.spec.lists]
        self.scalars: dict[str, dict[int, torch.Tensor]] = {name: {} for name in self.spec.scalars}
        super().__init__(param_groups, defaults)

    # -- what the engine and the checkpoints ask ------------------------------------------------------

    def check_group(self, group: dict, i: int) -> None:
        """torch.optim.<Name> checks its arguments when it is built (optimizer/twins.py runs its own
        constructor); a param group added later is taken as torch takes it."""

    def refresh(self, param_groups: list[dict]) -> None:
        super().refresh(param_groups)
        self._names = [name for name in self.spec.state
                       if name not in self.spec.optional or any(self.spec.optional[name](g) for g in param_groups)]

    def state_names(self) -> list[str]:
        return list(self._names)

    def group_has(self, name: str, group: dict) -> bool:
        """Whether torch.optim keeps state ``name`` for a parameter of ``group``."""
        return name not in self.spec.optional or bool(self.spec.optional[name](group))

    def has_state(self, count: float, group: dict) -> bool:
        return count > 0 or self.spec.at_construction

    def fresh(self, name: str, group: dict) -> float:
        """The value of state ``name`` before the parameter's first step (Adagrad's accumulator)."""
        init = self.spec.initial.get(name)
        return float(_lr(init(group, self.defaults))) if init is not None else 0.0

    def scalar(self, pid: int, name: str, group: dict, device) -> torch.Tensor:
        """The kept 0-dim scalar ``name`` of engine parameter ``pid``, made as torch makes it at the
        parameter's first step (float32 on the parameters' device)."""
        kept = self.scalars[name]
        if pid not in kept:  # a fill on the device, no copy from the host (a wait on CUDA)
            kept[pid] = torch.full((), _lr(self.spec.initial[name](group, self.defaults)), dtype=torch.float32,
                                   device=device)
        return kept[pid]

    def kept_entries(self, pid: int, group: dict, device) -> dict[str, torch.Tensor]:
        """Engine parameter ``pid``'s kept state, as torch.optim's state dict holds it."""
        return {name: self.scalar(pid, name, group, device) for name in self.spec.scalars}

    def check_kept(self, name: str, value, shape) -> str | None:
        if not isinstance(value, torch.Tensor) or value.numel() != 1 or not bool(torch.isfinite(value).all()):
            return f"state {name!r} should be one finite number, got {value!r}"
        return None

    def load_kept(self, pid: int, saved: dict, device) -> None:
        """A load: the values saved for engine parameter ``pid`` (none saved: made afresh at its first step)."""
        for name in self.spec.scalars:
            value = saved.get(name)
            if value is None:
                self.scalars[name].pop(pid, None)
            else:
                self.scalars[name][pid] = torch.as_tensor(value, dtype=torch.float32).detach().to(device).clone() \
                    .reshape(())

    def check_options(self, options: dict, where: str) -> None:
        fmt = options.get("state_format", "fp32") or "fp32"
        if fmt == "8bit" or (fmt != "fp32" and not self.spec.moments):
            what = ("bf16" if self.spec.moments else "fp32") + (" or fp32" if self.spec.moments else "")
            why = "its state is " + ("not moments (step sizes, an average of the weights)" if not self.spec.moments
                                     else "kept in bf16 at the most (the 8-bit blocks hold Adam's and SGD's moments)")
            raise ValueError(f"{where}: state_format={fmt!r} is not supported for {self.spec.name}: {why}; use "
                             f"state_format={what}")
        if options.get("stochastic_rounding"):
            raise ValueError(f"{where}: stochastic_rounding is not supported for {self.spec.name}; keep fp32 master "
                             "weights (master_weights=True) for low-precision parameters instead")

    def check_engine(self, engine, member) -> None:
        for fmt in member.group_formats:
            self.check_options({"state_format": fmt}, member.name)
        self.check_options({"stochastic_rounding": engine.options.stochastic_rounding}, member.name)

    # -- the coefficient table --------------------------------------------------------------------------

    def coefficients(self, groups, group_idx, active, grad_div) -> torch.Tensor:
        n = len(group_idx)
        cols = np.stack([(np.asarray(active) != 0).astype(np.float64) * np.ones(n),
                         np.broadcast_to(np.asarray(grad_div, dtype=np.float64), (n,)), np.zeros(n)], axis=-1)
        return torch.from_numpy(cols.astype(np.float32))

    def _fill(self, table, inputs, after, scratch) -> None:
        table[:, COLUMNS.index("step")] = after

    # -- the update (elementwise_calls.py) -------------------------------------------------------------

    def apply(self, backend, rows, segments, coefs, args) -> None:
        """This launch's pieces: one call of torch's function per param group, over every active
        parameter with a piece here (module docstring: the host's way and the device's)."""
        (calls.apply_on_device if args.asynchronous else calls.apply_on_host)(self, rows, coefs, args)

    def finish(self, pids, table: torch.Tensor, args) -> None:
        """Advance the kept scalars of ``pids`` (the member's parameters of the buckets just updated,
        every rank's same list) whose row is active, unless the step was skipped: torch's function over
        empty tensors, so that each rank holds every parameter's values (module docstring)."""
        if self.finishes:
            (calls.finish_on_device if args.asynchronous else calls.finish_on_host)(self, pids, table, args)

    def keywords(self, group: dict, device_counts: bool = False) -> dict:
        """torch's function's keyword arguments for a param group: the ones the sharded step fixes
        (``_FIXED``), the renamed ones, the group's own. ``device_counts``: the step counts are device
        tensors, which the host must not read: torch's capturable path, or its fused kernel where the
        function has no capturable path (Adagrad)."""
        out = {}
        for name in self._keywords:
            if name in _FIXED:
                out[name] = _FIXED[name]
            elif name in self.spec.renames:
                out[name] = self.spec.renames[name](group)
            elif name in group:
                out[name] = group[name]
        if device_counts:
            if "capturable" in self._keywords:
                out["capturable"] = True
            else:
                out["fused"], out["foreach"] = True, False
        return out


def algorithm_of(spec: Spec) -> type[ElementwiseAlgorithm]:
    """The twin's algorithm: ``ElementwiseAlgorithm`` over ``spec``."""
    return type(f"{spec.name}Algorithm", (ElementwiseAlgorithm,), {"spec": spec, "__module__": __name__})


def declaration(spec: Spec, algorithm: type[ElementwiseAlgorithm], state: str | None = None,
                compact: str | None = None, how: str = "torch's own update function over the rank's slices"
                ) -> Declaration:
    """The public optimizer of a Spec (its table row in words, from the Spec where not given)."""
    if state is None:
        state = ", ".join(n for n in spec.state if n not in spec.optional) + (
            f" (+ {', '.join(spec.optional)} where the group's momentum / centered ask)" if spec.optional else "")
        state += f"; step, {', '.join(spec.scalars)} on every rank" if spec.scalars else "; step"
    return Declaration(spec.name, spec.torch_class, algorithm, state, compact or ("bf16" if spec.moments else "-"),
                       how, generic=True, test=spec.test, bench=spec.bench, constructor_only=spec.constructor_only)


DECLARATIONS = tuple(declaration(spec, algorithm_of(spec)) for spec in SPECS.values())
"""The twins of torch.optim's elementwise optimizers, in ``SPECS``' order."""

globals().update({d.algorithm.__name__: d.algorithm for d in DECLARATIONS})  # importable by name (pickle)

__all__ = ["COLUMNS", "DECLARATIONS", "SPECS", "ElementwiseAlgorithm", "Spec", "algorithm_of", "declaration"]
