"""DDP's one bucket rebuild, and the 8-bit moments a load holds in fp32 until it.

A fresh DDP module lays its buckets out in parameter order, then rebuilds them once, at the forward
after its first backward, in the order the gradients came. An 8-bit block is a row of the bucket
layout, so a load into the first layout would encode the moments into blocks about to change and the
move after the rebuild would round them again: a resume would not be the uninterrupted run. So while
the rebuild is pending a load holds them in fp32 (``BucketShard.load_values``), and they are encoded
once in the rebuilt layout: by the move, or, where the rebuild moves no state, in the hook before that
bucket's reduction (engine.py), or at the end of a step if no rebuild comes after all.
"""

from __future__ import annotations


def pending(ddp, local: bool) -> bool:
    """Whether DDP will still rebuild its buckets: it has not, and will (``find_unused_parameters``
    without ``static_graph`` keeps the first layout; one process without DDP, ``local``, has no rebuild)."""
    if local or getattr(ddp, "_has_rebuilt_buckets", True):
        return False
    return bool(getattr(ddp, "static_graph", False) or not getattr(ddp, "find_unused_parameters", False))


def encode_if_final(registry, ddp, local: bool) -> None:
    """At the end of a step, once the compute stream follows the updates: the moments a load held
    (``registry.held_decoded``), encoded if no rebuild can come. (A shard is held only while a rebuild is
    pending, so the arenas, packed once the buckets are stable, never see one.)"""
    if registry.held_decoded and not pending(ddp, local):
        registry.encode_held()
