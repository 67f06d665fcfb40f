"""torch.optim.SGD: its state, checks and coefficients, and its update, by the fused Triton kernel
(kernels/sgd.py) or, on the torch backend, torch's own ops (torch_ops.py); and the public optimizer made
of it."""

from __future__ import annotations

import torch

from ..kernels import sgd_coefficients, sgd_step
from . import step_columns, torch_ops
from .fused import FusedKernel, UpdateArgs, check_scalar, count_without_step, per_param
from .interface import Declaration


class SGDAlgorithm(FusedKernel):
    """torch.optim.SGD: momentum, dampening, nesterov, weight decay, maximize."""

    kind = "sgd"
    title = "SGD"
    group_keys = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    state_keys = ("momentum_buffer",)
    keeps_step = False
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

    def has_state(self, count: float, group: dict) -> bool:
        """torch.optim.SGD makes a parameter's state at its first step, with momentum only."""
        return count > 0 and group["momentum"] != 0

    def saved_count(self, saved: dict) -> float:
        return count_without_step(saved)

    def coefficients(self, groups, group_idx, active, grad_div) -> torch.Tensor:
        pick = per_param(groups, group_idx)
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

    def _row(self, args, coefs, p, moments, n, go) -> None:
        torch_ops.sgd_row(args, coefs, p, moments, n, go, self.flags["maximize"], self.flags["nesterov"])


SGD = Declaration("SGD", torch.optim.SGD, SGDAlgorithm, "momentum_buffer (with momentum)", "bf16, 8bit",
                  "the fused Triton kernel (the CPU: torch's ops)", test=dict(lr=5e-2, momentum=0.9, weight_decay=0.01))

__all__ = ["SGD", "SGDAlgorithm"]
