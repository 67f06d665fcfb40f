"""fused_zero: a ZeRO-style sharded optimizer for DDP whose update is one fused Triton kernel per
bucket, run as the bucket's gradients are reduced, with the parameters all-gathered behind the
backward and the next forward."""

from .optimizer import SGD, Adam, AdamW

__all__ = ["Adam", "AdamW", "SGD"]
