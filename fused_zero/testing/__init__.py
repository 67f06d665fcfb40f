"""Tools for testing code that uses fused_zero, kept apart from the optimizer itself (as ``torch.testing``
is from torch): nothing of the product imports them.

``fused_zero.testing.streamcheck``: the stream-order checker. ``StreamChecker`` runs the real engine on
CPU tensors with stand-ins for CUDA's streams, events and graphs, and reports every stream-order hazard
and every host synchronization (docs/design-streams.md, "The stream-order checker").
"""
