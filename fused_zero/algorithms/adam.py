"""torch.optim.Adam and AdamW: their state, checks and coefficients, and their update, by the fused Triton
kernel (kernels/adam.py) or, on the torch backend, torch's own ops (torch_ops.py); and the two public
optimizers made of it."""

from __future__ import annotations

import numpy as np
import torch

from ..kernels import ADAM_COEFS, adam_coefficients, adam_step
from . import step_columns, torch_ops
from .fused import FusedKernel, UpdateArgs, check_scalar, per_param
from .interface import Declaration


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


class AdamFamily(FusedKernel):
    """torch.optim.Adam and AdamW: one algorithm, the weight decay decoupled or not per param group
    (``decoupled_weight_decay``; the optimizer's default where a group lacks it)."""

    kind = "adam"
    title = "Adam/AdamW"
    group_keys = ("lr", "betas", "eps", "weight_decay")
    state_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    uniform_keys = ("amsgrad", "maximize")

    def __init__(self, param_groups: list[dict], defaults: dict):
        self.decoupled_default = bool(defaults["decoupled_weight_decay"])
        self._bias = step_columns.BiasTables()
        super().__init__(param_groups, defaults)

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
        pick = per_param(groups, group_idx)
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
        neg_lr = -per_param(groups, group_idx)(step_lr)
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

    def _row(self, args, coefs, p, moments, n, go) -> None:
        torch_ops.adam_row(args, coefs, p, moments, n, go, self.flags["maximize"], self.flags["amsgrad"])


_STATE = "exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad)"
_KERNEL = "the fused Triton kernel (the CPU: torch's ops)"

ADAMW = Declaration("AdamW", torch.optim.AdamW, AdamFamily, _STATE, "bf16, 8bit", _KERNEL,
                    test=dict(lr=1e-2, weight_decay=0.1), bench=dict(lr=1e-3, weight_decay=0.1))
ADAM = Declaration("Adam", torch.optim.Adam, AdamFamily, _STATE, "bf16, 8bit", _KERNEL,
                   test=dict(lr=1e-2, weight_decay=0.05))  # weight_decay as L2

__all__ = ["ADAM", "ADAMW", "AdamFamily", "adam_scalars", "step_lr"]
