"""Optimizer state in torch.optim's canonical per-parameter form, built from the ranks' regions: a
``state_dict()`` of ours loads into ``torch.optim.AdamW`` (or Adam, SGD), and theirs into ours
(loading.py), at any world size and bucket layout.

Moments stored compact (bf16, 8 bits) are decoded to fp32 here, so the dict is torch.optim's; the
format is recorded under the top-level key ``"fused_zero"`` (torch.optim ignores it), and a load encodes
into whatever format the loading optimizer keeps: a dict from an 8-bit optimizer reloads into one at
the same layout to the same codes (decoding then encoding a block gives back its codes and scale), and
changing the format at load (fp32 into 8 bits, and back) is just that encoding.

bf16/fp16 parameters carry one more entry, ``"fp32_master"`` (checks.MASTER_KEY): the fp32 master
weights, without which a resumed run restarts from rounded weights and drifts. torch.optim's
``load_state_dict`` keeps unknown keys as they are (cast to the parameter's dtype like the rest) and its
``step()`` never reads them; a dict without them (torch.optim's) starts the masters from the parameters.

Each fused_zero optimizer over a DDP module has its own dict (Muon's beside AdamW's): ``view`` here is
one optimizer's share of the module's engine (pipeline/members.MemberView), with its parameters in its
own order (``i``) and its state names in each shard.

The dict is assembled on the calling rank, one slice at a time (``StateDictBuilder``): its own slices and
the replicated tail from its regions, every other rank's slices as that rank's server sends them
(serving/peers.py). The layout module says where each element lives; this module only walks its pieces. With
shard groups (pipeline/buckets/topology.py) every shard group holds the whole state: a dict is built from the
requester's own shard group, and a load fills each rank's region from the dict with no collective,
whatever the sharding it was saved at.
"""

from __future__ import annotations

import bisect
import zlib

import torch

from ..pipeline.buckets.layout import REPLICATED
from ..pipeline.buckets.strides import strided_view
from .checks import MASTER_KEY


def has_state(view, i: int) -> bool:
    """torch.optim creates a parameter's state on its first step (SGD: only with momentum; Adagrad: when
    it is built): algorithms/interface.Algorithm.has_state."""
    return view.algo.has_state(view.counts()[i], view.opt.param_groups[view.table.group_of[i]])


def state_names_of(view, shard, i: int) -> list[str]:
    """The state names torch.optim keeps for parameter ``i`` (the shard's, less what its param group
    has no use for: RMSprop's momentum buffer without momentum)."""
    group = view.opt.param_groups[view.table.group_of[i]]
    return [n for n in view.layout.names(shard) if n == "master" or view.algo.group_has(n, group)]


def kept_entries(view, i: int) -> dict:
    """Parameter ``i``'s state kept on every rank beside the regions (NAdam's ``mu_product``, ASGD's
    ``eta`` and ``mu``: algorithms/elementwise.py; Adafactor's factored statistics: algorithms/adafactor.py),
    on the CPU."""
    algo = view.algo
    if not algo.kept_names:
        return {}
    group = view.opt.param_groups[view.table.group_of[i]]
    return {name: t.detach().cpu().clone() for name, t in algo.kept_entries(int(view.table.pids[i]), group,
                                                                            view.ranks.device).items()}


def param_index(opt) -> dict[int, int]:
    """id(parameter) -> its index in torch.optim's state dict (every parameter of every group)."""
    index = {}
    for group in opt.param_groups:
        for p in group["params"]:
            index.setdefault(id(p), len(index))
    return index


def packed_groups(opt, index: dict[int, int]) -> list[dict]:
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
            for g in opt.param_groups]


def state_dict(view, peers, to: int | None = None) -> dict | None:
    """The canonical dict on CPU, on any calling rank (``to=None``) or on rank ``to`` only (the others
    get None); the other ranks serve their slices whatever they do meanwhile (serving/peers.py)."""
    if to is not None and not (isinstance(to, int) and 0 <= to < view.ranks.world):
        raise ValueError(f"to={to!r} is not a rank of the optimizer's process group (0..{view.ranks.world - 1})")
    return peers.state_dict(to, lambda: StateDictBuilder(view))


def written_by(view, peers, writer: int) -> dict:
    """``state_dict(to=)`` the DDP-group rank of global rank ``writer``, for a framework that builds its
    checkpoint on every rank and writes it from ``writer`` alone: one full dict, and one transfer per
    other rank, instead of one dict on every rank and W(W - 1) transfers. The other ranks get ``{}``
    (a dict, as such frameworks expect; Lightning gives the same to sharded optimizers of its own)."""
    topology = view.ranks.topology
    to = topology.group_rank(writer)
    if to is None:
        raise ValueError(f"the checkpoint is written from global rank {writer}, which is not in the optimizer's "
                         f"process group (global ranks {sorted(r for m in topology.global_ranks for r in m)}"
                         "): that rank cannot gather the state. Build DDP over a process group that includes it")
    sd = state_dict(view, peers, to)
    return {} if sd is None else sd


def sharded_slices(view) -> list:
    """(shard, state name) of every region with a sharded head, in the order ranks send their slices."""
    layout = view.layout
    return [(shard, name) for shard in layout.shards() if shard.layout.shard for name in layout.names(shard)]


def layout_fingerprint(view) -> int:
    """What requester and server must agree on for a slice to mean the same elements on both."""
    layouts = [(s.layout.numel, s.layout.head, s.layout.shard, tuple(s.layout.pids), tuple(s.layout.offsets),
                tuple(view.layout.names(s))) for s in view.layout.shards()]
    return zlib.crc32(repr(layouts).encode())


class StateDictBuilder:
    """torch.optim's dict for the parameters that have state, filled in one slice at a time.

    Each stepped parameter's entry is allocated once, at its final size (fp32, on CPU); a slice of a
    bucket's state region, wherever it comes from, is copied straight into the entries it overlaps. So
    building the dict costs the dict itself plus one slice in flight, at any world size.

    Attributes:
        slices: the (shard, name) pairs other ranks send, in order (``sharded_slices``).
        fingerprint: the layout's (``layout_fingerprint``).
    """

    def __init__(self, view):
        view.synchronize()
        self.view = view
        self.slices = sharded_slices(view)
        self.fingerprint = layout_fingerprint(view)
        self._index = param_index(view.opt)
        self.state: dict[int, dict] = {}
        self._fresh: list[tuple] = []  # (flat entry, value) of state made before any step, set in result()
        self._targets: dict[int, tuple] = {}  # id(shard) -> (offsets, numels, per parameter {name: flat entry})
        for shard in view.layout.shards():
            layout = shard.layout
            order = sorted(range(len(layout.pids)), key=layout.offsets.__getitem__)
            rows = [self._entry(view.table.local_of.get(layout.pids[local]), shard) for local in order]
            self._targets[id(shard)] = ([layout.offsets[i] for i in order], [layout.numels[i] for i in order], rows)

    def _entry(self, i: int | None, shard) -> dict | None:
        """The dict's entry of the optimizer's parameter ``i`` (None: another optimizer's)."""
        view = self.view
        if i is None or not has_state(view, i):
            return None
        p = view.table.params[i]
        entry = self.state.setdefault(self._index[id(p)], {})
        if view.algo.keeps_step:
            entry["step"] = torch.tensor(float(view.counts()[i]), dtype=torch.float32, device="cpu")
        fresh = view.counts()[i] == 0  # state torch makes before the first step (Adagrad's): its first values
        flats = {}
        for name in state_names_of(view, shard, i):  # bucket order is the parameter's memory order (strides.py)
            flats[name] = torch.empty(p.numel(), dtype=torch.float32, device="cpu")  # the dict is on the host
            entry[MASTER_KEY if name == "master" else name] = strided_view(flats[name], p)
            if fresh and name != "master":
                self._fresh.append((flats[name], view.algo.fresh(name, view.opt.param_groups[view.table.group_of[i]])))
        entry.update(kept_entries(view, i))
        return flats

    def add(self, shard, name: str, lo: int, values: torch.Tensor) -> None:
        """Bucket elements ``[lo, lo + len(values))`` of state ``name`` (CPU values)."""
        offsets, numels, rows = self._targets[id(shard)]
        hi = lo + values.numel()
        j = max(bisect.bisect_right(offsets, lo) - 1, 0)
        while j < len(offsets) and offsets[j] < hi:
            off, n, flats = offsets[j], numels[j], rows[j]
            a, b = max(lo, off), min(hi, off + n)
            if flats is not None and a < b and name in flats:
                flats[name][a - off:b - off].copy_(values[a - lo:b - lo])
            j += 1

    def local(self) -> StateDictBuilder:
        """This rank's own slices and the replicated tails (every rank holds them)."""
        for shard in self.view.layout.shards():
            layout = shard.layout
            rank = layout.rank  # within the shard group
            mine, tail = slice(*layout.region_slice(rank)), slice(*layout.region_tail(rank))
            for name in self.view.layout.names(shard):
                region = shard.values(name)  # decoded to fp32 where the moments are stored compact
                if layout.shard:
                    self.add(shard, name, rank * layout.shard, region[mine].cpu())
                self.add(shard, name, layout.head, region[tail].cpu())
        return self

    def result(self) -> dict:
        for flat, value in self._fresh:
            flat.fill_(value)
        # torch.optim's order: parameters by index, step first, then the state tensors (the algorithm's
        # order where it keeps 0-dim scalars too), fp32_master last
        rank = {key: i for i, key in enumerate(self.view.algo.state_order)}
        state = {k: dict(sorted(v.items(), key=lambda kv: rank.get(kv[0], len(rank) + (kv[0] == MASTER_KEY))))
                 for k, v in sorted(self.state.items())}
        out = {"state": state, "param_groups": packed_groups(self.view.opt, self._index)}
        formats = self.view.table.group_formats
        if any(f != "fp32" for f in formats):  # torch.optim ignores the key; the moments are decoded
            out["fused_zero"] = {"state_format": formats[0] if len(set(formats)) == 1 else formats}
        return out


def is_state_init_step(view) -> bool:
    """Whether a step() with no backward before it is torch's state initialization
    (torch.distributed.checkpoint.state_dict._init_optim_state): no state torch.optim would show
    (``bool(opt.state)``, which DCP tests: a stateless optimizer, SGD without momentum, shows none
    after any number of steps, and DCP steps it at every save and load), every gradient a zero tensor,
    every learning rate 0. torch.optim's step then makes the state as a first step makes it, and leaves
    the parameters (pipeline/step_end/stepping.py's ``state_init_step`` runs that step)."""
    if any(has_state(view, i) for i in range(len(view.table.params))):
        return False
    if any(float(g.get("lr", 0.0)) != 0.0 for g in view.opt.param_groups):
        return False
    return all(p.grad is not None and not bool(p.grad.any()) for p in view.table.params)


def local_entry(view, i: int) -> dict:
    """``opt.state[p]``: a snapshot of this rank's share of a parameter's state, with no collective.
    ``step`` as torch.optim keeps it; each state tensor (and ``fp32_master``) flattened, holding only
    the elements of the parameter that this rank updates (its slices, then the replicated tail)."""
    shard, local = view.layout.where(i)
    me = shard.layout.rank
    runs = [(region_off, hi - lo) for lo, hi, owner, region_off in shard.layout.owners(local, me)
            if owner in (me, REPLICATED)]
    entry = {}
    if view.algo.keeps_step:
        entry["step"] = torch.tensor(float(view.counts()[i]), dtype=torch.float32, device="cpu")
    view.synchronize()
    for name in state_names_of(view, shard, i):
        region = shard.values(name)
        parts = [region[off:off + n] for off, n in runs]
        value = torch.cat(parts) if parts else region[:0].clone()
        entry[MASTER_KEY if name == "master" else name] = value
    entry.update(kept_entries(view, i))
    return entry
