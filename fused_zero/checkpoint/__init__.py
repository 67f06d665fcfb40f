"""Optimizer state in and out: torch.optim's canonical dict (canonical.py: built; loading.py: loaded,
before or after attach), the sharded form for torch.distributed.checkpoint (sharded.py), the checks a
dict passes before a load mutates anything (checks.py), and what lets any rank call ``state_dict()``
alone while the others do whatever they do between steps (serving.py, with server.py, inbox.py and
channel.py)."""
