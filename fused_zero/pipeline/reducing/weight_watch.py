"""Notices the user's writes of the parameters themselves, so that training continues from them.

Under DDP + torch.optim the next step updates whatever the parameters hold: weights loaded after the
optimizer was built (``model.load_state_dict``: a resume script that builds first, a rollback after a loss
spike, pretrained weights), ``p.copy_(...)`` under ``no_grad``, ``nn.init``'s functions, ``p.data = t``.
fused_zero's update of bf16/fp16 parameters reads their fp32 masters, which such a write does not reach:
so the masters of every parameter written since the update last looked are taken afresh from it (as a
user of DDP + torch.optim with fp32 masters makes them from the loaded weights) before the next update.
fp32 parameters are their own masters; only ``p.data = t`` (the parameter no longer a view of the bucket's
buffer) needs mending there.

Seen on the host, with no wait for the device: each parameter has a version counter of its own (its data is
a view of the bucket's buffer, bound with ``p.data = view``, which keeps the parameter's counter: the
engine's own writes go through the buffer and never count there), which every in-place write through the
parameter advances; ``p.data = t`` moves its data elsewhere, which ``data_ptr()`` tells. Writes through
``p.data`` in place (``p.data.copy_(t)``) touch neither: they are not seen (docs/usage.md says so).

Looked at the iteration's first bucket, before any update, and at ``step()`` (where the update runs
there: overlap="step"). A write that only some ranks made cannot be honored (each rank's slice of a
parameter would come from its own weights): every rank's written set goes into ``step()``'s agreement
(refusals.py) as ``bits``, and a difference is refused on every rank.
"""

from __future__ import annotations

import hashlib

import torch

HASH_BITS = 16
"""Bits of the written set's hash in ``bits``: two ranks that wrote different sets agree on all of them
with probability 2**-16."""


class WeightWatch:
    """Attributes:
        versions: each parameter's version counter when last looked at (None: not watched, no member's).
    """

    def __init__(self, params: list[torch.nn.Parameter], owned: list[bool]):
        self.params = params
        self.owned = owned
        self.shapes = [(tuple(p.shape), p.stride(), p.dtype, p.device) for p in params]
        self.versions: list[int | None] = []
        self.look()

    def own(self, pids: list[int]) -> None:
        """Watch ``pids`` too: parameters that joined an optimizer (pipeline/added_groups.py)."""
        for pid in pids:
            self.owned[pid] = True
        self.look()

    def look(self) -> None:
        """Take the parameters as they are now as seen (the engine's own writes, a load of the optimizer's
        state whose masters then win over weights written before it)."""
        self.versions = [p._version if owned else None for p, owned in zip(self.params, self.owned)]

    def written(self, where) -> list[int]:
        """The parameters written since the last look. ``where(pid)``: ``(flat, offset)``, the buffer the
        parameter's data must be a view of and its element offset there. A parameter whose data was moved
        elsewhere (``p.data = t``) gets its values copied into that view and becomes its view again."""
        out = []
        for pid, (p, seen) in enumerate(zip(self.params, self.versions)):
            if seen is None:
                continue
            flat, off = where(pid)
            if p.data_ptr() != flat.data_ptr() + off * flat.element_size():
                self._mend(pid, p, flat, off)
                out.append(pid)
            elif p._version != seen:
                out.append(pid)
        if out:
            self.look()
        return out

    def _mend(self, pid: int, p: torch.nn.Parameter, flat: torch.Tensor, off: int) -> None:
        shape, stride, dtype, device = self.shapes[pid]
        data = p.data
        if tuple(data.shape) != shape or data.dtype != dtype or data.device != device:
            raise RuntimeError(
                f"parameter {pid}'s data was replaced (p.data = t) by a tensor of shape {tuple(data.shape)}, "
                f"{data.dtype}, on {data.device}, where the optimizer keeps it as {shape}, {dtype}, on {device}: "
                "write the new values into the parameter instead (with torch.no_grad(): p.copy_(t)), or build "
                "the DDP module and the optimizer after changing the parameters' shape, dtype or device")
        view = flat[off:off + data.numel()].as_strided(shape, stride)  # the parameter's own memory order
        view.copy_(data)
        p.data = view

    @staticmethod
    def bits(pids: list[int]) -> tuple[bool, ...]:
        """Whether this rank wrote any parameter, and ``HASH_BITS`` bits of which: what every rank must
        agree on (the module docstring)."""
        if not pids:
            return (False,) * (1 + HASH_BITS)
        digest = int.from_bytes(hashlib.blake2b(repr(sorted(pids)).encode(), digest_size=4).digest(), "little")
        return (True, *(bool(digest >> i & 1) for i in range(HASH_BITS)))


def refresh_masters(shard, pids) -> None:
    """The masters of engine parameters ``pids`` in ``shard`` (a BucketShard) taken afresh from the
    parameters: their pieces in this rank's region."""
    wanted = set(pids)
    for part in shard.parts:
        master = part.state.get("master")
        if master is not None:
            for so, n, po, _, pid, *_ in part.rows:
                if pid in wanted:
                    master[so:so + n].copy_(shard.param_buffer[po:po + n])


__all__ = ["HASH_BITS", "WeightWatch", "refresh_masters"]
