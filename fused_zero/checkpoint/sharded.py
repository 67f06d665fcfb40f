"""The optimizer state for torch.distributed.checkpoint (DCP): each rank saves only what it owns, and a
checkpoint loads at any world size or bucket layout.

Every parameter's state tensor is one DTensor over the parameter's flattened elements (in its memory
order: a channels_last weight flattens as it lies in memory, see pipeline/buckets/strides.py; the checkpoint
records that order, and a load into another memory format is refused), keyed by torch.optim's
parameter index (``state.<i>.exp_avg``, ``state.<i>.fp32_master``, ...). Its chunks are the runs of the
parameter inside each rank's slice (layout.owners), and the replicated tail belongs to rank 0, so the
chunks tile the parameter exactly, as DCP's save planner requires. A slice cuts parameters anywhere,
not where ``torch.chunk`` would, and rank 0 may own two runs of one parameter (one in its slice, one in
the tail), so no placement describes the chunks: the DTensor's local tensor is torch's
``LocalShardsWrapper`` (torch/distributed/tensor/_shards_wrapper.py, TorchRec's form for uneven
shards), which hands DCP the rank's runs with their offsets through the checkpointable protocol
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``; torch 2.11 on). Its
``Shard(0)`` placement is nominal: the DTensor is for DCP, not for DTensor ops (``full_tensor()``
raises). A rank that owns no element of a parameter holds an empty chunk at its end, as DTensor's own
empty shards are, and DCP's planner keeps one of those per tensor. Every rank knows every rank's runs,
so the global metadata is built locally, with no collective. Resharding is DCP's: on load each rank
asks for its own runs in the new layout and DCP reads them from whichever saved chunks overlap. The
tail, held by every rank, is read by rank 0 and broadcast.

**Formats** (``FORMAT``, saved as ``"format"`` under ``fused_zero``): 1, no marker, was ShardedTensor
(torch warns "we are deprecating ShardedTensor" on every load of one); 2 is the DTensor form, with the
same keys, shapes and chunks on disk, so a format-1 checkpoint loads as it is; 3 saves compact moments
as stored (below), and reads 1 and 2, whose moments are all fp32. A format this version does not know
is refused, naming it.

With shard groups (pipeline/buckets/topology.py) each DTensor lives on this rank's shard group (its mesh), which
tiles the parameter by itself; the replicas write the same chunks (the same offsets), which DCP's save
planner keeps once (``dedup_save_plans``), and each rank of every replica reads its own runs on load.
So a checkpoint saved at one sharding (2 replicas of 2, say) loads at any other (4 x 1, 1 x 4).

The local chunks are copies, not views of the live state: ``dcp.load`` writes into them, and the
optimizer changes only in ``load_sharded_state_dict``, once every check passed on every rank. Saving
thus costs one copy of the rank's own state (DCP then writes it chunk by chunk).

``state.<i>.step`` is a plain tensor (replicated; DCP writes it once); ``fused_zero`` holds the param
groups and records the format, the optimizer kind, state names and parameter shapes, so that a mismatch
is named before anything loads.

Compact moments (``state_format``, algorithms/codecs.py) are saved as stored: 8-bit codes (one byte an
element, in the parameter's element space like every other state tensor) and bf16 values, under the
same keys; ``fused_zero`` records which (``"stored"``) and, for 8-bit moments, every block's first
element and scale (``"blocks"``, 12 bytes a block of up to 2048 elements). The blocks are the saving
layout's kernel rows, cut at a grid in each parameter's element space (kernels/segments.py), so a load
into any layout decodes each element with its saved block's scale (the values the saver held, bit for
bit) and encodes them in its own blocks: one it shares with the saving layout comes out with the saved
codes (docs/compact-state.md, "What a reshard re-encodes"). A load receives every moment in fp32
(``_Stored``), so a checkpoint of any format loads into any format. Without a process group (one
process, plain tensors) the moments are saved decoded to fp32, as format 2 saved them everywhere.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh

from ..algorithms import registry
from ..algorithms.codecs import DTYPES, SIGNED, decode
from ..pipeline.buckets.strides import memory_order
from ..pipeline.comm import collectives
from . import canonical, checks, loading
from .checks import MASTER_KEY, StateDictError
from .chunks import STORED, _chunks, _owned, _tensor

FORMAT = 3
"""The DCP form's version (module docstring, "Formats"); raise it with any change a reader must know of."""

READS = (1, 2, 3)
"""The formats ``load_sharded_state_dict`` reads."""

def _state_key(name: str) -> str:
    return MASTER_KEY if name == "master" else name


def _dim_order(p: torch.Tensor) -> list[int] | None:
    """How a parameter's elements are laid out (the flattening of its DTensors): None for
    row-major, else its dimensions from the outermost stride in (channels_last: [0, 2, 3, 1])."""
    if p.is_contiguous():
        return None
    return sorted(range(p.dim()), key=lambda d: (-p.stride(d), d))


def _describe(view) -> dict:
    index = canonical.param_index(view.opt)
    return {"format": FORMAT, "kind": view.algo.kind,
            "state": sorted({_state_key(n) for s in view.layout.shards() for n in view.layout.names(s)}),
            "shapes": {index[id(p)]: list(p.shape) for p in view.table.params},
            "orders": {index[id(p)]: _dim_order(p) for p in view.table.params}}


def sharded_state_dict(view) -> dict:
    """Every rank must call it. The 8-bit moments' scales travel in the ``fused_zero`` entry, which DCP
    writes once, from one rank, so every rank must hold all of them: with 8-bit moments, one
    ``all_gather_object`` of the blocks' first elements and scales (12 bytes a block) in the shard
    group; nothing else is communicated."""
    view.synchronize()
    index = canonical.param_index(view.opt)
    state, regions, parts = {}, {}, {}
    group = view.ranks.topology.shard_group
    mesh = None if group is None else DeviceMesh.from_group(group, view.ranks.device.type)
    stored, blocks = {}, {}
    counts = view.counts()
    for i, p in enumerate(view.table.params):
        shard, local = view.layout.where(i)
        mine = _owned(shard.layout.owners(local, shard.layout.rank), shard.layout.rank)
        entry = {"step": torch.tensor(float(counts[i]), dtype=torch.float32, device="cpu")}  # torch.optim's
        for name in view.layout.names(shard):
            dtype = _saved_dtype(view, i, name, compact=mesh is not None)
            if dtype in STORED:  # copies of the stored runs
                part = _part_of(shard, int(view.table.pids[i]), name, dtype, parts) if mine else None
                chunks = [part.stored(name, off, hi - lo).clone() for lo, hi, off in mine]
            else:
                if (id(shard), name) not in regions:
                    regions[(id(shard), name)] = shard.values(name)
                region = regions[(id(shard), name)]
                live = region is shard.live(name)  # fp32: copies; decoded: views of the decoded copy
                chunks = [region[off:off + hi - lo].clone() if live and mesh is not None
                          else region[off:off + hi - lo] for lo, hi, off in mine]
            key = _state_key(name)
            entry[key] = _tensor(chunks, [lo for lo, _, _ in mine], p.numel(), mesh, view.ranks.device, dtype)
            if dtype in STORED:
                stored.setdefault(index[id(p)], {})[key] = STORED[dtype]
        entry.update(canonical.kept_entries(view, i))  # replicated: the same on every rank
        state[index[id(p)]] = entry
    if mesh is not None and "8bit" in view.table.state_formats and not view.layout.held_decoded:  # alike on every rank
        blocks = _gather_blocks(view, index, group)
    describe = dict(_describe(view), stored=stored, blocks=blocks)
    # one tuple: DCP stores it as one pickled object, where it would cut dicts and lists into leaves
    return {"state": state, "fused_zero": (canonical.packed_groups(view.opt, index), describe)}


def _part_of(shard, pid: int, name: str, dtype: torch.dtype, parts: dict):
    """The part of ``shard`` holding parameter ``pid``'s state, which stores ``name`` as ``dtype``
    (``parts``: the shards' parts by parameter, filled here)."""
    if id(shard) not in parts:
        parts[id(shard)] = {row[4]: part for part in shard.parts for row in part.rows}
    part = parts[id(shard)][pid]
    if part.state[name].dtype != dtype:
        raise RuntimeError(f"{name!r} of a {part.format} part is kept in {part.state[name].dtype} though no "
                           "load is held (rebuild.py): the ranks would save it in different dtypes")
    return part


def _saved_dtype(view, i: int, name: str, compact: bool) -> torch.dtype:
    """What a parameter's state tensor is saved as, the same on every rank (DCP keeps one rank's
    metadata): its format's dtype, but fp32 for masters, without a process group (``compact`` False: no
    DTensor receives into fp32), and for 8-bit moments a load holds in fp32 until DDP's rebuild."""
    fmt = view.table.state_formats[i]
    if name == "master" or not compact or (view.layout.held_decoded and fmt == "8bit"):
        return torch.float32
    return DTYPES[fmt]


def _gather_blocks(view, index, group) -> dict:
    """``(parameter index, state key) -> (first elements, scales)`` of every 8-bit block of every rank
    of the shard group, in element order (host tensors): each rank sends the rows of its own runs (the
    tail's are rank 0's, as its chunks are). Worked out in numpy: nothing here touches the device but
    the one read of each part's scales."""
    mine: dict[tuple, list] = {}
    params = view.table.engine_params  # the part tables' indices are the engine's
    for shard in view.layout.shards():
        me, layout = shard.layout.rank, shard.layout
        for part in view.layout.parts(shard):
            names = [n for n, t in part.state.items() if t.dtype == torch.uint8]
            if not names:
                continue
            table = part.table.numpy()
            if layout.tail and me != 0:
                table = table[part.region_offsets(part.table[:, 0]).numpy() < layout.region_tail(me)[0]]
            i_of = np.array([index[id(params[pid])] for pid in table[:, 4].tolist()], dtype=np.int64)
            order = np.argsort(i_of, kind="stable")
            keys, firsts = np.unique(i_of[order], return_index=True)
            for name in names:
                scales = part.scales[name].cpu().numpy()[table[:, 7]]
                for i, rows in zip(keys.tolist(), np.split(order, firsts[1:])):
                    mine.setdefault((i, _state_key(name)), []).append((table[rows, 5], scales[rows]))
    gathered: dict[tuple, list] = {}
    for every in collectives.all_gather_object(mine, group):
        for key, parts in every.items():
            gathered.setdefault(key, []).extend(parts)
    out = {}
    for key, parts in gathered.items():
        starts = np.concatenate([s for s, _ in parts])
        order = np.argsort(starts, kind="stable")
        out[key] = (torch.from_numpy(starts[order]), torch.from_numpy(np.concatenate([v for _, v in parts])[order]))
    return out


def load_sharded_state_dict(view, sd) -> None:
    error = None
    try:
        plan = _check(view, sd)
    except StateDictError as e:
        error, plan = str(e), None
    except Exception as e:
        error, plan = f"the sharded state dict is malformed ({type(e).__name__}: {e})", None
    checks.agree(view, error)
    _apply(view, *plan)


def _check(view, sd):
    algo = view.algo
    meta = sd.get("fused_zero") if isinstance(sd, dict) else None
    if not (isinstance(meta, tuple) and len(meta) == 2 and isinstance(meta[1], dict)):
        raise StateDictError("not a fused_zero sharded state dict (no 'fused_zero' entry)")
    groups, saved = meta
    version = saved.get("format", 1)
    if version not in READS:
        raise StateDictError(f"the checkpoint is fused_zero's DCP format {version}, this version reads formats "
                             f"{', '.join(map(str, READS))}: load it with the fused_zero that saved it and save "
                             "it as the canonical state_dict(), which loads at any version")
    checks.check_structure({"state": sd.get("state"), "param_groups": groups}, algo)
    mine = _describe(view)
    if registry.KINDS.get(saved["kind"]) is not type(algo):
        raise StateDictError(f"the checkpoint holds {registry.title_of(saved['kind'])} state, this optimizer is "
                             f"{algo.title}")
    for i, shape in mine["shapes"].items():
        if saved["shapes"].get(i) != shape:
            raise StateDictError(f"parameter {i} has shape {tuple(shape)}, the checkpoint's "
                                 f"{tuple(saved['shapes'].get(i) or ())}")
        order = saved.get("orders", {}).get(i)
        if order != mine["orders"][i]:
            raise StateDictError(f"parameter {i} is laid out with dimension order {mine['orders'][i] or 'row-major'}, "
                                 f"the checkpoint's with {order or 'row-major'} (a memory format such as "
                                 "channels_last): give the parameter the memory format it was saved with, or "
                                 "convert through the canonical state_dict()")
    groups = checks.merged_groups(view.opt, groups)
    checks.check_algorithm(view, groups)
    index = canonical.param_index(view.opt)
    view.synchronize()
    values = {}
    for pid, p in enumerate(view.table.params):  # the optimizer's own order
        i = index[id(p)]
        entry = sd["state"][i]
        where = f"parameter {i} (shape {tuple(p.shape)})"
        step = entry["step"]
        local = {"step": step}
        shard, loc = view.layout.where(pid)
        mine_runs = _owned(shard.layout.owners(loc, shard.layout.rank), shard.layout.rank)
        for name in view.layout.names(shard):
            by_offset = _chunks(entry[_state_key(name)], mine_runs, p.numel())
            if sorted(by_offset) != [lo for lo, _, _ in mine_runs]:
                raise StateDictError(f"{where}: the dict's chunks are not this optimizer's runs; call "
                                     "sharded_state_dict() again after the buckets changed")
            flat = torch.cat([by_offset[lo] for lo, _, _ in mine_runs]) if mine_runs else \
                torch.zeros(0, dtype=torch.float32, device=view.ranks.device)
            if saved.get("stored", {}).get(i, {}).get(_state_key(name)) == "8bit":
                flat = _decoded(flat, mine_runs, saved.get("blocks", {}).get((i, _state_key(name))), p.numel(),
                                name, where)
            local[_state_key(name)] = flat
            if name == "master" and mine_runs and float(step) > 0:
                params = memory_order(p.detach(), p)
                params = torch.cat([params[lo:hi] for lo, hi, _ in mine_runs])
                if not torch.equal(flat.to(p.dtype), params):
                    raise StateDictError(f"{where}: its {MASTER_KEY!r} does not round to the parameter; load "
                                         "the model's weights before the optimizer's state")
        for name in algo.kept_names:
            if name in entry:
                local[name] = entry[name]
        required = [_state_key(n) for n in view.layout.names(shard)] + ["step"]
        checks.check_entry(view, pid, where, local, local[required[0]].shape if len(required) > 1 else (),
                                 required)
        values[pid] = local
    return groups, values


def _decoded(codes: torch.Tensor, runs: list, blocks, numel: int, name: str, where: str) -> torch.Tensor:
    """8-bit codes (received in fp32) of a parameter's ``runs``, decoded with the saved blocks' scales:
    the values the saving optimizer held, bit for bit (``codecs.values``' product)."""
    if blocks is None:
        raise StateDictError(f"{where}: its 8-bit {name!r} has no block scales in the checkpoint")
    starts, scales = (np.asarray(t.numpy()) for t in blocks)  # host tensors, as unpickled
    if not (starts.size and starts.size == scales.size and starts[0] == 0 and (starts[1:] > starts[:-1]).all()
            and starts[-1] < numel):
        raise StateDictError(f"{where}: the checkpoint's 8-bit blocks of {name!r} do not tile its {numel} elements")
    if not bool(((codes >= 0) & (codes <= 255) & (codes == codes.round())).all()):
        raise StateDictError(f"{where}: its {name!r} should hold 8-bit codes and holds other values")
    ends = np.append(starts[1:], numel)
    each = []  # every element's block scale, run by run: the blocks a run overlaps, repeated
    for lo, hi, _ in runs:
        first, last = np.searchsorted(starts, [lo, hi - 1], side="right") - 1
        counts = np.minimum(ends[first:last + 1], hi) - np.maximum(starts[first:last + 1], lo)
        each.append(np.repeat(scales[first:last + 1], counts))
    each = torch.from_numpy(np.concatenate(each) if each else np.zeros(0, dtype=np.float32)).to(codes.device)
    return decode(codes, SIGNED[name]) * each


def _apply(view, groups, values) -> None:
    opt = view.opt
    for g, merged in zip(opt.param_groups, groups):
        g.update({k: v for k, v in merged.items() if k != "params"})
    view.algo.refresh(opt.param_groups)
    steps, member = view.steps, view.table.member
    hold = view.layout.rebuild_pending()  # 8-bit moments encoded once, in the rebuilt layout's blocks
    view.layout.held_decoded = view.layout.held_decoded or hold
    for shard in view.layout.shards():
        names = view.layout.names(shard)
        # the state itself where it is fp32, else a region to encode from: every slot of the optimizer's
        # rows is filled below (this rank's runs, the tail from rank 0), so nothing needs decoding first
        regions = {name: shard.live(name, member) if shard.live(name, member) is not None else
                   torch.zeros(shard.layout.region_size, dtype=torch.float32, device=shard.device) for name in names}
        me = shard.layout.rank
        for local, gpid in enumerate(shard.layout.pids):
            pid = view.table.local_of.get(gpid)
            if pid is None:
                continue  # another optimizer's parameter
            saved = values[pid]
            pos = 0
            for lo, hi, off in _owned(shard.layout.owners(local, me), me):
                for name in names:
                    regions[name][off:off + hi - lo].copy_(saved[_state_key(name)][pos:pos + hi - lo])
                pos += hi - lo
            steps[pid] = float(saved["step"])
            loading.load_kept(view, pid, saved)
        layout = shard.layout
        if layout.tail and layout.world_size > 1 and names:
            tail = torch.stack([regions[n][slice(*layout.region_tail(me))] for n in names])
            collectives.broadcast(tail, 0, view.ranks.topology.shard_group)
            for f, n in enumerate(names):
                regions[n][slice(*layout.region_tail(me))].copy_(tail[f])
        for name in names:  # every rank cuts the tail into the same blocks: the same codes everywhere
            if regions[name] is not shard.live(name, member):
                shard.load_values(name, regions[name], hold, member)
    view.steps = steps
    view.layout.masters_loaded()
