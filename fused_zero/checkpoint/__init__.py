"""Optimizer state in and out: torch.optim's canonical dict (canonical.py), the sharded form for
torch.distributed.checkpoint (sharded.py), the checks a dict passes before a load mutates anything
(checks.py) and the handshake that lets rank 0 call ``state_dict()`` alone (rank0.py)."""
