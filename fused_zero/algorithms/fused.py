"""What the algorithms share (their interface: interface.py): the buffers of one launch (``UpdateArgs``),
the base of the algorithms whose update is one fused kernel (``FusedKernel``: adam.py, sgd.py), the
norm pass any algorithm's table serves (``grad_sumsq``, ``clip_coefficient``), and the param groups'
readers (``check_scalar``, ``per_param``, ``count_without_step``).

Everything else (buckets, shards, communication) is shared and lives in the engine.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels import grad_sumsq as triton_grad_sumsq
from . import torch_ops
from .interface import Algorithm


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


class FusedKernel(Algorithm):
    """An algorithm whose update is one fused kernel per launch (kernels/): Adam(W) and SGD. On the torch
    backend the same update runs row by row in torch's ops (torch_ops.py): ``_row``."""

    def compile(self, backend: str, rows: list, segments, coefs: torch.Tensor, args: UpdateArgs) -> None:
        """Launch each kernel once on a row with nothing active, so that Triton compiles now."""
        self.apply(backend, rows, segments, coefs, args)

    def apply(self, backend: str, rows: list, segments, coefs: torch.Tensor, args: UpdateArgs) -> None:
        if backend == "triton":
            self._launch(segments, coefs, args)
        else:
            torch_ops.apply(self._row, rows, coefs, args)

    @abstractmethod
    def _launch(self, segments, coefs: torch.Tensor, args: UpdateArgs) -> None:
        """The Triton kernel over ``segments``."""

    @abstractmethod
    def _row(self, args: UpdateArgs, coefs: list, p: torch.Tensor, moments, n: int, go: int) -> None:
        """torch's update of one run of ``n`` elements (torch_ops.apply): ``c`` its row of the table, ``p``
        its fp32 weights, ``moments`` its state, ``go`` its offset in the gradient."""


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


def per_param(groups: list[dict], group_idx: np.ndarray):
    """``pick(f)``: ``f`` of each parameter's group, as a float64 array (one Python call per group; a tensor
    is read as a Python number: a CPU tensor's read costs no wait, a CUDA tensor's is a host read)."""
    def pick(f):
        return np.array([float(f(g)) for g in groups], dtype=np.float64)[group_idx]
    return pick


def count_without_step(saved: dict) -> float:
    """The count a saved entry of an optimizer that keeps no ``step`` stands for (SGD's, Muon's, as
    torch.optim keeps them): stepped once where it holds a momentum buffer, never where it holds none;
    a ``step`` there (the sharded form records every parameter's) is read as it is."""
    if "step" in saved:
        step = saved["step"]
        return float(step.item() if isinstance(step, torch.Tensor) else step)
    return 1.0 if saved.get("momentum_buffer") is not None else 0.0


def clip_coefficient(total_sumsq: torch.Tensor, max_norm: float, out: torch.Tensor) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s factor, on the device, into ``out`` (float32 ``[1]``):
    min(1, max_norm / (norm + 1e-6)), in torch's operations (``max_norm / x`` is ``x.reciprocal() *
    max_norm``, Tensor.__rdiv__), in place."""
    torch.sqrt(total_sumsq.reshape(1), out=out)
    return out.add_(1e-6).reciprocal_().mul_(max_norm).clamp_(max=1.0)


__all__ = ["FusedKernel", "UpdateArgs", "check_scalar", "clip_coefficient", "count_without_step", "grad_sumsq",
           "per_param"]
