"""torch.optim.Muon's update, cut where the sharding cuts it: the elementwise halves run on any piece of
a matrix (the momentum before Newton-Schulz, the weight decay and the step after), the Newton-Schulz
orthogonalization on the whole matrix, once, on the rank that owns it (pipeline/updating/whole_matrix.py
brings the pieces there and the result back).

Every op is the one torch.optim.Muon calls, with the same Python scalars and dtypes: elementwise ops
give the same bits on a piece as on the whole tensor, and the owner's matrix is assembled in the
parameter's own memory order (its strides), so its matmuls are torch's, on torch's operands.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..kernels import sgd_coefficients
from . import step_columns
from .fused import check_scalar, count_without_step, per_param
from .interface import Algorithm, Declaration, Runs

ADJUST_LR_FNS = (None, "original", "match_rms_adamw") + (
    ("spectral_unclamped",) if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 14) else ())
"""What torch.optim.Muon of the installed torch takes: 2.14 added "spectral_unclamped" (sqrt(A / B))."""


class MuonAlgorithm(Algorithm):
    """Muon over 2-D parameters. Its coefficient table is SGD's layout (the norm pass reads only the
    ``active`` and ``grad_div`` columns); its update runs in phases with collectives between
    (``Runs.WHOLE_MATRIX``), driven by pipeline/updating/whole_matrix.py with the param groups' host
    values."""

    kind = "muon"
    title = "Muon"
    runs = Runs.WHOLE_MATRIX
    group_keys = ("lr", "momentum", "weight_decay", "nesterov", "ns_coefficients", "ns_steps")
    state_keys = ("momentum_buffer",)
    keeps_step = False

    def check_group(self, group: dict, i: int) -> None:
        """torch.optim.Muon's constructor has checked the defaults (optimizer/__init__.py runs it), and its
        refusals of a parameter are torch's here, word for word: one not 2-D (its constructor), a complex
        one (its first step; here at once). A group's own values are taken as torch takes them, but for
        what its step refuses (``ns_steps`` of 100 or more, ``ns_coefficients`` not three), refused here
        in its words, before anything is laid out; an ``adjust_lr_fn`` torch does not know scales the
        step by 1, as torch's ``_adjust_lr`` does."""
        names = group.get("param_names")
        for j, p in enumerate(group["params"]):
            if p.ndim != 2:
                what = repr(names[j]) if names else f"parameter {j} of param group {i}"
                raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with size: "
                                 f"{p.size()}: {what}; give it to a fused_zero.AdamW over the same DDP module")
            if torch.is_complex(p):
                raise RuntimeError("Muon does not support complex parameters")
        if group.get("state_format", "fp32") != "fp32":
            self.check_options({"state_format": group["state_format"]}, f"param group {i}")
        for key in ("lr", "momentum", "weight_decay", "eps"):
            check_scalar(group[key], i, key)
        if int(group["ns_steps"]) != group["ns_steps"]:
            raise ValueError(f"param group {i}: ns_steps must be an integer, got {group['ns_steps']!r}")
        if group["ns_steps"] >= 100:
            raise ValueError(f"Number of steps must be less than 100 for computational efficiency (param group {i}: "
                             f"ns_steps={group['ns_steps']!r})")
        if len(tuple(group["ns_coefficients"])) != 3:
            raise ValueError(f"Coefficients must be a tuple of exactly 3 values (param group {i}: ns_coefficients="
                             f"{group['ns_coefficients']!r})")

    def state_names(self) -> list[str]:
        return ["momentum_buffer"]

    def saved_count(self, saved: dict) -> float:
        return count_without_step(saved)

    @staticmethod
    def check_options(options: dict, where: str = "Muon") -> None:
        """The momentum is kept in fp32, the parameters rounded to nearest: Muon's state is one buffer,
        and its update a matrix product that no per-element code of the compact formats follows."""
        fmt = options.get("state_format", "fp32")
        if fmt not in ("fp32", None):
            raise ValueError(f"{where}: state_format={fmt!r} is not supported for Muon (its momentum is kept "
                             "in fp32); leave state_format unset for the Muon optimizer")
        if options.get("stochastic_rounding"):
            raise ValueError(f"{where}: stochastic_rounding is not supported for Muon; keep fp32 master weights "
                             "(master_weights=True) for low-precision parameters instead")

    def check_engine(self, engine, member) -> None:
        """What the options of the module (given to any of its optimizers) and the groups say."""
        formats = [f for f in member.group_formats if f != "fp32"]
        self.check_options({"state_format": formats[0] if formats else "fp32",
                            "stochastic_rounding": engine.options.stochastic_rounding}, member.name)

    def coefficients(self, groups, group_idx, active, grad_div) -> torch.Tensor:
        pick = per_param(groups, group_idx)
        return sgd_coefficients(lr=pick(lambda g: g["lr"]), momentum=pick(lambda g: g["momentum"]),
                                dampening=np.zeros(len(group_idx)), weight_decay=pick(lambda g: g["weight_decay"]),
                                first=True, grad_div=grad_div, active=active)

    def _fill(self, table, inputs, after, scratch) -> None:
        step_columns.fill_sgd(table, after, scratch)



def momentum_update(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool,
                    ok: torch.Tensor) -> torch.Tensor:
    """Advance the momentum ``buf`` (a piece, in place) where ``ok`` (a device flag: the step is not skipped)
    and return the piece of Newton-Schulz's input in bf16 (what ``_zeropower_via_newtonschulz`` casts it
    to first: the cast is elementwise, so the pieces travel in bf16)."""
    new = buf.lerp(grad, 1 - momentum)
    buf.copy_(torch.where(ok, new, buf))
    update = grad.lerp(new, momentum) if nesterov else new
    return update.bfloat16()


def newton_schulz(x: torch.Tensor, ns_coefficients, ns_steps: int, eps: float) -> torch.Tensor:
    """torch.optim.Muon's ``_zeropower_via_newtonschulz`` of a bf16 matrix, op for op."""
    a, b, c = ns_coefficients
    out = x.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:
        out = out.T
    out.div_(out.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = out @ out.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        out = torch.addmm(out, gram_update, out, beta=a)
    return out.T if tall else out


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    """torch.optim.Muon's ``_adjust_lr`` of the installed torch: the step's scale for a matrix of ``shape``
    (``lr`` as the group holds it: a tensor lr gives a tensor, as torch's does); a function that torch does
    not know scales by 1."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    elif adjust_lr_fn == "spectral_unclamped" and adjust_lr_fn in ADJUST_LR_FNS:
        ratio = math.sqrt(rows / cols)
    else:
        ratio = 1.0
    return lr * ratio


def apply(param: torch.Tensor, ortho: torch.Tensor, lr: float, weight_decay: float, step_lr: float,
          ok: torch.Tensor) -> None:
    """The weight decay with the unadjusted lr, then the orthogonalized step, on a piece in place where
    ``ok`` (a device flag)."""
    new = param.mul(1 - lr * weight_decay)
    new.add_(ortho, alpha=-step_lr)
    param.copy_(torch.where(ok, new, param))


def ns_flops(shape, ns_steps: int) -> int:
    """Matmul FLOPs of one Newton-Schulz orthogonalization of a matrix of ``shape``: each step is a
    Gram matrix (2 m^2 n), its square (2 m^3) and the product with X (2 m^2 n), m the smaller side."""
    m, n = sorted(int(s) for s in shape[:2])
    return max(ns_steps, 0) * (4 * m * m * n + 2 * m ** 3)


MUON = Declaration("Muon", torch.optim.Muon, MuonAlgorithm, "momentum_buffer", "-",
                   "Newton-Schulz once per matrix, on its owner rank", test=dict(lr=2e-2, weight_decay=0.1))

__all__ = ["ADJUST_LR_FNS", "MUON", "MuonAlgorithm", "adjusted_lr", "apply", "momentum_update", "newton_schulz",
           "ns_flops"]
