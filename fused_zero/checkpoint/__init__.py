"""Optimizer state in and out, in the forms it takes: torch.optim's canonical dict (canonical.py: built;
loading.py: loaded, before or after attach), the sharded form for torch.distributed.checkpoint
(sharded.py, its chunks in chunks.py), and the checks a dict passes before a load mutates anything
(checks.py). How a rank's state reaches a rank that calls ``state_dict()`` alone is the room below,
serving/ (the rank-0 serving protocol: threads, a gloo group and store mailboxes of its own)."""
