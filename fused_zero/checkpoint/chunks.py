"""A rank's chunks of a parameter's flat state as a DTensor that torch.distributed.checkpoint saves and
loads (checkpoint/sharded.py): the runs of the parameter in the rank's slice and, on rank 0, the
replicated tail, through torch's ``LocalShardsWrapper`` (uneven shards, handed to DCP through the
checkpointable protocol); compact moments through ``_Stored``, which saves them as stored and receives
them in fp32."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from ..pipeline.buckets.layout import REPLICATED
from .checks import StateDictError

STORED = {torch.uint8: "8bit", torch.bfloat16: "bf16"}
"""The compact moments' dtypes, as the checkpoint names their formats (``"stored"``)."""


class _Stored(LocalShardsWrapper):
    """A rank's chunks of one compact moment: written as stored (8-bit codes, bf16), received in fp32.

    One dict serves ``dcp.save`` and ``dcp.load``, in either order and again, as torch's own state dicts
    do, and a load must take any format a checkpoint holds (fp32 moments into an 8-bit optimizer, a
    format-2 checkpoint's decoded ones): a uint8 chunk would truncate them. DCP asks a checkpointable
    object for its chunk list only to load (``__create_chunk_list__``), so that allocates fp32 chunks to
    receive into, once; fp32 holds every 8-bit code and bf16 value exactly, and the codes are decoded
    with the saved scales in ``load_sharded_state_dict``. What the object holds is its stored chunks
    until a load, then what the load received: a save writes that (``__create_write_items__``: the
    received chunks in fp32, with the loaded checkpoint's ``fused_zero`` entry, which the load put into
    the dict, saying how to read them), so ``dcp.load`` then ``dcp.save`` writes the checkpoint that was
    loaded, and ``dcp.save`` then ``dcp.load`` reads what was saved.
    """

    @staticmethod
    def __new__(cls, chunks, offsets):
        out = LocalShardsWrapper.__new__(cls, chunks, offsets)
        out.received = None
        return out

    def __create_write_items__(self, fqn, obj):
        items = super().__create_write_items__(fqn, obj)
        if self.received is None:
            return items
        props = TensorProperties.create_from_tensor(self.received[0]) if self.received else None
        return [dataclasses.replace(item, tensor_data=dataclasses.replace(item.tensor_data, properties=props))
                for item in items]

    def __create_chunk_list__(self):
        if self.received is None:
            self.received = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in self.local_shards()]
        return super().__create_chunk_list__()

    def __get_tensor_shard__(self, index):
        shard = super().__get_tensor_shard__(index)
        if self.received is None:
            return shard
        return next(r for t, r in zip(self.local_shards(), self.received) if t is shard)

    def chunks(self) -> list[torch.Tensor]:
        """What this rank holds: the chunks received by a load, else the stored ones."""
        return self.received if self.received is not None else self.local_shards()


def _owner(owner: int) -> int:
    return 0 if owner == REPLICATED else owner


def _owned(runs: list, me: int) -> list[tuple[int, int, int]]:
    """``(elem_lo, elem_hi, region_off)`` of the runs (layout.owners) whose chunk rank ``me`` writes."""
    return [(lo, hi, off) for lo, hi, owner, off in runs if _owner(owner) == me]


def _tensor(chunks: list, starts: list[int], numel: int, mesh, device: torch.device,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A flat tensor of ``numel`` elements of which this rank holds ``chunks`` (copies), starting at
    ``starts``: a DTensor on ``mesh``; a plain tensor, the whole of it, where there is no process group
    (one process: every chunk is this rank's). ``dtype``: the chunks', compact (``_Stored``) or fp32."""
    if mesh is None:
        return torch.cat(chunks) if chunks else torch.zeros(0, dtype=dtype, device=device)
    if not chunks:
        chunks, starts = [torch.zeros(0, dtype=dtype, device=device)], [numel]
    local = (_Stored if dtype in STORED else LocalShardsWrapper)(chunks, [(s,) for s in starts])
    out = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,))
    out._local_tensor = local  # from_local keeps a view, a plain LocalShardsWrapper: DCP must see ours
    return out


def _chunks(value, runs: list, numel: int) -> dict[int, torch.Tensor]:
    """What a ``_tensor`` holds, by start (the empty chunk of a rank owning nothing left out)."""
    if not isinstance(value, DTensor):
        if tuple(value.shape) != (numel,):
            raise StateDictError(f"a tensor of shape {tuple(value.shape)} where the flat state of {numel} "
                                 "elements belongs")
        return {lo: value[lo:hi].float() for lo, hi, _ in runs}
    local = value._local_tensor
    held = local.chunks() if isinstance(local, _Stored) else local.local_shards()
    return {start[0]: t.float() for t, start in zip(held, local.local_offsets()) if t.numel()}
