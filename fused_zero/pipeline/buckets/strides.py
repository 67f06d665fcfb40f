"""Parameters keep their memory format (channels_last convolution weights, any dense strides).

DDP lays a dense parameter's gradient into its bucket with the parameter's own strides (its reducer's
bucket views are ``as_strided`` views), and keeps them until it rebuilds its buckets, which with
``find_unused_parameters=True`` it never does. So the flat parameter buffer holds each parameter in the
same memory order, the parameter becomes a view of it with its own strides, and the optimizer state
follows: one element order (memory order) for the bucket, the parameter buffer and the state. What
leaves the optimizer in torch.optim's form (checkpoints) is put back in the parameter's shape and
strides, as torch.optim's ``zeros_like(p, memory_format=torch.preserve_format)`` state has them.
Parameters that do not fill their storage densely are refused at construction (fused_zero/params.py).
"""

from __future__ import annotations

import torch


def strided_view(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``like``'s shape and strides over the 1-D run ``flat`` of ``like.numel()`` elements."""
    return flat.as_strided(like.shape, like.stride())


def memory_order(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t``'s values (``like``'s shape, any strides) as a 1-D tensor in ``like``'s memory order."""
    if like.is_contiguous():
        return t.reshape(-1)
    out = torch.empty(like.numel(), dtype=t.dtype, device=t.device)
    strided_view(out, like).copy_(t)
    return out
