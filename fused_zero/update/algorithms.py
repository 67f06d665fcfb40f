"""What differs between Adam(W) and SGD: state names, hyperparameter checks, per-parameter scalars and
the update itself, on either implementation (the Triton kernels, or torch's own ops on CPU).

Everything else (buckets, shards, communication) is shared and lives in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import adam_coefficients, adam_step, sgd_coefficients, sgd_step
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
    blocks: object = None  # the launch's formats.BlockTable: what the torch backend cuts runs and blocks by
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


def _check_nonneg(group: dict, i: int, key: str) -> None:
    value = group[key]
    if isinstance(value, torch.Tensor):
        raise ValueError(f"param group {i}: {key} as a Tensor is not supported; pass a float")
    if not 0.0 <= value:
        raise ValueError(f"Invalid {key} in param group {i}: {value} (must be >= 0)")


class AdamFamily(Algorithm):
    kind = "adam"
    uniform_keys = ("amsgrad", "maximize")

    def __init__(self, param_groups, *, decoupled_default: bool):
        self.decoupled_default = decoupled_default
        self._bias = step_columns.BiasTables()
        super().__init__(param_groups)

    def check_group(self, group: dict, i: int) -> None:
        for key in ("lr", "eps", "weight_decay"):
            _check_nonneg(group, i, key)
        for j, beta in enumerate(group["betas"]):
            if isinstance(beta, torch.Tensor) or not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {j} in param group {i}: {beta}")

    def state_names(self) -> list[str]:
        return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self.flags["amsgrad"] else [])

    def coefficients(self, groups: list[dict], group_idx: np.ndarray, active: np.ndarray,
                     grad_div: float) -> torch.Tensor:
        pick = _per_param(groups, group_idx)
        return adam_coefficients(
            lr=pick(lambda g: g["lr"]), beta1=pick(lambda g: g["betas"][0]), beta2=pick(lambda g: g["betas"][1]),
            eps=pick(lambda g: g["eps"]), weight_decay=pick(lambda g: g["weight_decay"]), step=1,
            decoupled=pick(lambda g: g.get("decoupled_weight_decay", self.decoupled_default)) != 0,
            grad_div=grad_div, active=active)

    def step_inputs(self, groups, group_idx, bound, group, upload, scratch) -> tuple:
        neg_lr = -_per_param(groups, group_idx)(lambda g: g["lr"])
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
        for key in ("lr", "momentum", "weight_decay"):
            _check_nonneg(group, i, key)
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"param group {i}: Nesterov momentum requires a momentum and zero dampening")

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
    """``pick(f)``: ``f`` of each parameter's group, as a float64 array (one Python call per group)."""
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
