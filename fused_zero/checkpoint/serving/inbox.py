"""Each rank's checkpoint mailbox, in the process group's c10d store: how a rank learns that another
wants its shards (peers.py), without a single store request while nobody checkpoints.

A message to rank s takes a slot number from s's counter (``add``) and is written under it (``set``);
s's listener thread takes its messages in slot order (``wait``, ``get``, ``delete_key``): five store
requests per message, so a checkpoint costs the store O(world size) requests and an iteration none.
The listener blocks in ``wait`` on a connection of its own (``clone``: on a shared TCPStore client a
blocking ``wait`` holds up every other call), so the training thread's own store calls (gloo's lazy
connections, new groups) never queue behind it; the wait is re-armed every ``IDLE_WAIT_S`` (one
request) when nothing comes.

Why the store and not a gloo receive: a thread blocked in a store ``wait`` can be woken from its own
process (``post`` a message to itself), so it can be stopped at exit, before the interpreter
finalizes; a pending gloo receive can be neither cancelled nor completed locally, and a daemon thread
whose C++ wait returns while the interpreter finalizes aborts the process ("terminate called without
an active exception"). Keys live under ``fused_zero/checkpoint/<n>/`` in the DDP group's own store
prefix, where ``n`` counts the servers made for that group (one request per rank when one is made),
so that a process group made again under the same name, on a store that outlived the first, starts
from empty mailboxes.
"""

from __future__ import annotations

import datetime
import json

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

IDLE_WAIT_S = 3600.0
"""How long one idle ``wait`` lasts before it is re-armed."""


class Inbox:
    """The mailboxes of one DDP group's ranks, as seen from this rank.

    Attributes:
        rank: this rank's place in the group (its mailbox).
    """

    def __init__(self, ddp_group):
        getter = getattr(c10d, "_get_process_group_store", None)
        base = dist.PrefixStore("fused_zero/checkpoint", getter(ddp_group) if getter is not None
                                else c10d._get_default_store())
        made = (base.add("servers", 1) - 1) // dist.get_world_size(ddp_group)  # every rank adds one
        self.store = dist.PrefixStore(str(made), base)
        self.listening = self.store.clone()  # the listener's own connection
        self.rank = dist.get_rank(ddp_group)
        self._next = 1

    def post(self, rank: int, message: dict) -> None:
        """Leave ``message`` (JSON-able) in ``rank``'s mailbox. Any thread but the listener."""
        slot = self.store.add(f"{rank}/n", 1)
        self.store.set(f"{rank}/{slot}", json.dumps(message))

    def take(self, timeout_s: float | None = None) -> dict | None:
        """The listener: the next message of this rank's mailbox, or None after ``timeout_s`` (default
        IDLE_WAIT_S) without one."""
        key = f"{self.rank}/{self._next}"
        try:
            self.listening.wait([key], datetime.timedelta(seconds=timeout_s or IDLE_WAIT_S))
        except dist.DistStoreError:
            return None
        message = json.loads(self.listening.get(key))
        self.listening.delete_key(key)
        self._next += 1
        return message
