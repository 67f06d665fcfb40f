"""``Scratch``: the small device tensors a step's device work writes besides the state (the norm's
statistics, the skip flag, the clip coefficient, the step columns' and the counts' intermediates, the
uploaded ``-lr``).

Made new at every use, as any torch code makes its temporaries; or, where ``step()``'s device work is
captured in a CUDA graph (``capturable=True``, step_graph.py), one tensor per name kept across steps:
a graph replays fixed addresses, and a capture that allocates would hold the blocks in a private pool
besides. Every user writes them with ``out=`` or in place, so the code is the same either way. All are
written and read on the side stream, in order, so reusing one from the previous step needs no wait.
"""

from __future__ import annotations

import torch


class Scratch:
    """Attributes:
        device: where the tensors live.
        kept: whether each name's tensor is kept (reused while its shape and dtype stay).
    """

    def __init__(self, device: torch.device, kept: bool = False, prefix: tuple = (), buffers: dict | None = None):
        self.device, self.kept = device, kept
        self._prefix = prefix
        self._buffers = buffers if buffers is not None else {}

    def take(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` whose values the caller overwrites."""
        if not self.kept:
            return torch.empty(shape, dtype=dtype, device=self.device)
        key = (*self._prefix, name)
        t = self._buffers.get(key)
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            t = self._buffers[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return t

    def under(self, *prefix) -> Scratch:
        """The same store, its names prefixed (one per member, per launch)."""
        return Scratch(self.device, self.kept, (*self._prefix, *prefix), self._buffers)
