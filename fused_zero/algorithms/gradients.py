"""The reduced gradient as torch.optim reads ``p.grad`` under DDP, for the updates that run torch's own ops
on pieces of it (Muon: muon.py; the elementwise twins: elementwise_calls.py; Adafactor:
pipeline/updating/whole_params.py): DDP's average, unscaled as GradScaler.unscale_ unscales, clipped as
clip_grad_norm_ clips."""

from __future__ import annotations

import torch


def gradient(grad: torch.Tensor, grad_div: float, inv_scale: torch.Tensor | None,
             clip_coef: torch.Tensor | None) -> torch.Tensor:
    """A piece of the reduced gradient as torch.optim reads ``p.grad``: DDP's average, unscaled as
    GradScaler.unscale_ unscales an optimizer without a fused step (a multiplication by the fp32
    reciprocal, ``inverse_scale``), clipped as clip_grad_norm_ clips. Always a new fp32 tensor."""
    g = grad.to(torch.float32, copy=True)
    if grad_div != 1.0:
        g.div_(grad_div)
    if inv_scale is not None:
        g.mul_(inv_scale)
    if clip_coef is not None:
        g.mul_(clip_coef.to(torch.float32))
    return g


def inverse_scale(grad_scale: torch.Tensor) -> torch.Tensor:
    """GradScaler.unscale_'s factor: the fp32 reciprocal of the scale, taken in float64."""
    return grad_scale.double().reciprocal().float()


__all__ = ["gradient", "inverse_scale"]
