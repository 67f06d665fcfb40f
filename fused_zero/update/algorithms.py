"""What differs between Adam(W) and SGD: state names, hyperparameter checks, per-parameter scalars and
the update itself, on either implementation (the Triton kernels, or torch's own ops on CPU).

Everything else (buckets, shards, communication) is shared and lives in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import ADAM_COEFS, adam_coefficients, adam_step, sgd_coefficients, sgd_step
from ..kernels import grad_sumsq as triton_grad_sumsq
from . import step_columns, torch_ops


@dataclass
class UpdateArgs:
    """The buffers of one launch (see kernels.adam_step for their meaning)."""

    grad: torch.Tensor
    param: torch.Tensor
    state: dict[str, torch.Tensor]  # region-shaped, in the moments' format: the state and maybe "master"
    grad_scale: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    clip_coef: torch.Tensor | None = None
    scales: dict[str, torch.Tensor] | None = None  # 8-bit moments: one fp32 scale per row of the launch
    stochastic: bool = False  # bf16 parameters without masters, rounded stochastically
    blocks: object = None  # the launch's codecs.BlockTable: what the torch backend cuts runs and blocks by
    hparams: list[dict] | None = None  # the member's param groups as this step reads them (torch's own updates)
    group_of: object = None  # each engine parameter's param group in its member (numpy)
    grad_div: object = None  # what each engine parameter's reduced gradient is divided by (numpy; the host's)
    asynchronous: bool = False  # the device runs later (CUDA): the host must not read the table or the flags


class Algorithm:
    """Base: subclasses define ``state_names``, ``check_group``, ``coefficients``, ``_fill`` and
    ``_launch``.

    A coefficient table is made in two halves: ``coefficients`` on the host, from the param groups
    (what the host knows without the device: the step-dependent columns hold placeholders), then
    ``fill_steps`` on the device, from the step counts kept there and the ``step_inputs`` uploaded
    before (step_columns.py). The fill reads device memory only, so a CUDA graph can hold it
    (pipeline/step_end/step_graph.py)."""

    uniform_keys: tuple[str, ...] = ()  # flags that are compile-time constants of the kernel
    phased = False  # updates in phases with collectives between (Muon: pipeline/updating/whole_matrix.py)

    def __init__(self, param_groups: list[dict]):
        self.refresh(param_groups)

    def refresh(self, param_groups: list[dict]) -> None:
        """Check the groups' hyperparameters and read the kernel's compile-time flags from them."""
        for i, group in enumerate(param_groups):
            self.check_group(group, i)
        for key in self.uniform_keys:
            values = {bool(g[key]) for g in param_groups}
            if len(values) > 1:
                raise ValueError(f"{key} must be the same in every param group (it is a compile-time "
                                 f"flag of the fused kernel); got {sorted(values)}")
        self.flags = {key: bool(param_groups[0][key]) for key in self.uniform_keys}

    def state_names(self) -> list[str]:
        raise NotImplementedError

    def step_inputs(self, groups: list[dict], group_idx: np.ndarray, bound: int, group: torch.Tensor, upload,
                    scratch) -> tuple:
        """What the step columns read besides the counts, on the device: uploaded now (``upload(host,
        out=)``, pipeline/comm/streams.py), from each parameter's param group (``group_idx`` on the host,
        ``group`` on the device) and the counts' host ``bound``; ``scratch`` holds what is uploaded
        every step (pipeline/comm/scratch.py)."""
        return ()

    def fill_steps(self, table: torch.Tensor, inputs: tuple, counts, sr_seed: int | None, scratch) -> None:
        """Write ``table``'s step-dependent columns on the device (queued where the caller is: the side
        stream), from ``counts`` (pipeline.updating.step_counts.StepCounts) and ``inputs`` (``step_inputs``);
        ``sr_seed``: stochastic rounding's seed, or None without it."""
        after = counts.after(scratch)
        self._fill(table, inputs, after, scratch)
        if sr_seed is not None:
            step_columns.fill_sr_keys(table, after, sr_seed)

    def check_engine(self, engine, member) -> None:
        """Refuse at construction what this algorithm cannot run with the engine's options (Muon's)."""

    def bytes_kept(self) -> int:
        """State this rank keeps beside the regions (Adafactor's statistics), for ``memory()``."""
        return 0

    def reference_bytes(self, params) -> int:
        """torch.optim's state of ``params``, fp32, for ``memory()``."""
        return sum(p.numel() for p in params) * 4 * len(self.state_names())

    def compile(self, backend: str, rows: list, segments, coefs: torch.Tensor, args: UpdateArgs) -> None:
        """Launch each kernel once on a row with nothing active, so that Triton compiles now."""
        self.update(backend, rows, segments, coefs, args)

    def update(self, backend: str, rows: list, segments, coefs: torch.Tensor, args: UpdateArgs) -> None:
        if backend == "triton":
            self._launch(segments, coefs, args)
        else:
            torch_ops.apply(self.kind, rows, coefs, args, **self.flags)


def grad_sumsq(backend: str, rows: list, segments, coefs: torch.Tensor, grad: torch.Tensor,
               grad_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
               partials: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of squares and the non-finite count of the rows' gradients (the columns ``active`` and
    ``grad_div`` of any algorithm's table), on either implementation; written into ``out`` (float32
    ``[2]``) where given (``partials``: the Triton kernel's per-row buffer, see kernels.grad_sumsq)."""
    if backend == "triton":
        return triton_grad_sumsq(segments, coefs, grad=grad, grad_scale=grad_scale, out=out, partials=partials)
    sumsq, bad = torch_ops.grad_sumsq(rows, coefs, grad, grad_scale)
    if out is None:
        return sumsq, bad
    out[0], out[1] = sumsq, bad
    return out[0], out[1]


def check_scalar(value, i: int, name: str) -> None:
    """A param group's number: a Python number or, as torch.optim takes one (a tensor ``lr``, say), a
    1-element tensor, refused otherwise in torch's words. Its value is torch.optim's to check: its
    constructor checks the defaults (optimizer/__init__.py runs it), and a param group's own values are
    taken as torch takes them."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"Tensor {name} must be 1-element (param group {i}: {tuple(value.shape)})")


def _scalar(value):
    """A param group's number as torch's update computes with it: a Python number, or a 1-element tensor
    as a 0-dim CPU tensor of its dtype (torch's ``_to_scalar``; a CUDA tensor is read to the host here)."""
    return value.detach().reshape(()).cpu() if isinstance(value, torch.Tensor) else value


def adam_scalars(group: dict, decoupled: bool) -> dict[str, float] | None:
    """The step-independent scalars of torch's single-tensor Adam(W) for a group that holds a tensor (lr,
    betas, weight_decay or eps), computed by torch's own expressions on its values: with a tensor they
    are tensor arithmetic in its dtype (``1 - lr * weight_decay`` in float32 for a float32 lr), not the
    float64 of Python numbers. None where every value is a number (adam_coefficients' float64 is then
    torch's). The step-dependent ones: step_columns.BiasTables."""
    lr, (beta1, beta2), wd, eps = group["lr"], group["betas"], group["weight_decay"], group["eps"]
    if not any(isinstance(v, torch.Tensor) for v in (lr, beta1, beta2, wd, eps)):
        return None
    lr, beta1, beta2, wd, eps = (_scalar(v) for v in (lr, beta1, beta2, wd, eps))
    # torch moves a tensor beta1 to the moments' dtype for the lerp (fp32 here); beta2 as it is
    device_beta1 = beta1.to(torch.float32) if isinstance(beta1, torch.Tensor) else beta1
    return {"decay_mul": float(1 - lr * wd) if decoupled and wd != 0 else 1.0,
            "l2": 0.0 if decoupled else float(wd),
            "lerp_w": float(1 - device_beta1),
            "beta2": float(beta2),
            "one_minus_beta2": float(1 - beta2),
            "eps": float(eps)}


def step_lr(group: dict) -> float:
    """The lr of torch's step size ``lr / bias_correction1`` as that division reads it: over a tensor
    beta1 a float lr is cast to the tensor's dtype (``bias_correction1.reciprocal() * lr``,
    Tensor.__rtruediv__; step_columns.BiasTables holds the reciprocal); 1 where the table holds the
    whole step size (step_columns.folds_lr)."""
    lr, beta1 = group["lr"], group["betas"][0]
    if step_columns.folds_lr(group):
        return 1.0
    if isinstance(beta1, torch.Tensor) and not isinstance(lr, torch.Tensor):
        return float(torch.tensor(lr, dtype=beta1.dtype))
    return float(lr)


class AdamFamily(Algorithm):
    kind = "adam"
    uniform_keys = ("amsgrad", "maximize")

    def __init__(self, param_groups, *, decoupled_default: bool):
        self.decoupled_default = decoupled_default
        self._bias = step_columns.BiasTables()
        super().__init__(param_groups)

    def check_group(self, group: dict, i: int) -> None:
        """torch.optim.Adam's constructor has checked the defaults; a group's own betas must be in its range
        too: the bias corrections are tabulated per step (step_columns.py), and at 1 ``1 - beta ** step``
        is 0, which torch divides by."""
        for key in ("lr", "eps", "weight_decay"):
            check_scalar(group[key], i, key)
        for j, beta in enumerate(group["betas"]):
            check_scalar(beta, i, f"betas[{j}]")
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {j}: {beta} (param group {i}; Adam's bias "
                                 "correction 1 - beta ** step needs 0 <= beta < 1)")

    def state_names(self) -> list[str]:
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.flags["amsgrad"] else [])

    def coefficients(self, groups: list[dict], group_idx: np.ndarray, active: np.ndarray,
                     grad_div: float) -> torch.Tensor:
        pick = _per_param(groups, group_idx)
        decoupled = [bool(g.get("decoupled_weight_decay", self.decoupled_default)) for g in groups]
        table = adam_coefficients(
            lr=pick(lambda g: g["lr"]), beta1=pick(lambda g: g["betas"][0]), beta2=pick(lambda g: g["betas"][1]),
            eps=pick(lambda g: g["eps"]), weight_decay=pick(lambda g: g["weight_decay"]), step=1,
            decoupled=np.array(decoupled)[group_idx], grad_div=grad_div, active=active)
        for g, group in enumerate(groups):  # a group holding tensors: torch's tensor arithmetic
            scalars = adam_scalars(group, decoupled[g])
            if scalars is not None:
                rows = torch.from_numpy(np.flatnonzero(group_idx == g))
                for name, value in scalars.items():
                    table[rows, ADAM_COEFS.index(name)] = value
        return table

    def step_inputs(self, groups, group_idx, bound, group, upload, scratch) -> tuple:
        neg_lr = -_per_param(groups, group_idx)(step_lr)
        bias = self._bias.get(groups, bound, group, upload, first=2 ** 16 if scratch.kept else 32)
        return (upload(torch.from_numpy(neg_lr), out=scratch.take("neg_lr", neg_lr.shape, torch.float64)),
                bias.both, bias.base, bias.length)

    def _fill(self, table, inputs, after, scratch) -> None:
        step_columns.fill_adam(table, after, *inputs, scratch)

    def _launch(self, segments, coefs, a: UpdateArgs) -> None:
        adam_step(segments, coefs, grad=a.grad, param=a.param, exp_avg=a.state["exp_avg"],
                  exp_avg_sq=a.state["exp_avg_sq"], master=a.state.get("master"),
                  max_exp_avg_sq=a.state.get("max_exp_avg_sq"), scales=a.scales, stochastic=a.stochastic,
                  maximize=self.flags["maximize"], grad_scale=a.grad_scale, found_inf=a.found_inf,
                  clip_coef=a.clip_coef)


class SGDAlgorithm(Algorithm):
    kind = "sgd"
    uniform_keys = ("nesterov", "maximize")

    def check_group(self, group: dict, i: int) -> None:
        """torch.optim.SGD's constructor has checked the defaults; a group's own values are taken as torch
        takes them (its update reads a tensor lr or weight_decay as a Python number: ``alpha=-lr``)."""
        for key in ("lr", "momentum", "dampening", "weight_decay"):
            check_scalar(group[key], i, key)

    def refresh(self, param_groups):
        super().refresh(param_groups)
        self.has_momentum = any(g["momentum"] != 0 for g in param_groups)

    def state_names(self) -> list[str]:
        return ["momentum_buffer"] if self.has_momentum else []

    def coefficients(self, groups, group_idx, active, grad_div) -> torch.Tensor:
        pick = _per_param(groups, group_idx)
        return sgd_coefficients(lr=pick(lambda g: g["lr"]), momentum=pick(lambda g: g["momentum"]),
                                dampening=pick(lambda g: g["dampening"]),
                                weight_decay=pick(lambda g: g["weight_decay"]), first=True, grad_div=grad_div,
                                active=active)

    def _fill(self, table, inputs, after, scratch) -> None:
        step_columns.fill_sgd(table, after, scratch)

    def _launch(self, segments, coefs, a: UpdateArgs) -> None:
        sgd_step(segments, coefs, grad=a.grad, param=a.param, momentum_buffer=a.state.get("momentum_buffer"),
                 master=a.state.get("master"), scales=a.scales, stochastic=a.stochastic,
                 nesterov=self.flags["nesterov"], maximize=self.flags["maximize"], grad_scale=a.grad_scale,
                 found_inf=a.found_inf, clip_coef=a.clip_coef)


def _per_param(groups: list[dict], group_idx: np.ndarray):
    """``pick(f)``: ``f`` of each parameter's group, as a float64 array (one Python call per group; a tensor
    is read as a Python number: a CPU tensor's read costs no wait, a CUDA tensor's is a host read)."""
    def pick(f):
        return np.array([float(f(g)) for g in groups], dtype=np.float64)[group_idx]
    return pick


def clip_coefficient(total_sumsq: torch.Tensor, max_norm: float, out: torch.Tensor) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s factor, on the device, into ``out`` (float32 ``[1]``):
    min(1, max_norm / (norm + 1e-6)), in torch's operations (``max_norm / x`` is ``x.reciprocal() *
    max_norm``, Tensor.__rdiv__), in place."""
    torch.sqrt(total_sumsq.reshape(1), out=out)
    return out.add_(1e-6).reciprocal_().mul_(max_norm).clamp_(max=1.0)


__all__ = ["AdamFamily", "SGDAlgorithm", "UpdateArgs", "clip_coefficient", "grad_sumsq"]
