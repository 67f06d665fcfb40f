"""Which ranks shard the optimizer together and which hold replicas of it: the groups every collective of
the pipeline runs on.

By default every bucket is sharded over all ``W`` ranks of DDP's process group. ``shard_group`` shards
it within groups of ``S`` ranks instead and replicates across the ``R = W / S`` groups, as FSDP2's
HSDP (a 2-D device mesh), Megatron-core's distributed optimizer instances and DeepSpeed ZeRO++'s
hierarchical partitioning do: the reduce-scatter of gradients and the all-gather of parameters stay
within the shard group (a node's NVLink), and only this rank's slice, 1/S of the bucket, is all-reduced
across the replicas (the network). The state per rank is then 1/S of torch.optim's.

``shard_group`` is one of:

- an ``int`` S: consecutive ranks of DDP's group, ``[0, S)``, ``[S, 2S)``, ... (as
  ``torch.distributed.new_subgroups(group_size=S)``; with one node of S GPUs per group, the node);
- a ``ProcessGroup``: this rank's shard group; the groups of all ranks must tile DDP's group (equal
  sizes, disjoint, covering it), which the ranks check together at construction;
- a ``DeviceMesh``: 2-D as FSDP2's HSDP, dimension 0 replicating and dimension 1 sharding; or 1-D,
  the shard group. Its ranks must be DDP's.

Every rank derives the same groups from the same information, so construction agrees on every rank,
and refuses on every rank, naming the fix. Groups made here are cached by their ranks: building another
optimizer over the same sharding makes no new process group. Where DDP's group is the whole world,
every rank makes every group, in the same order (``new_group`` is then a collective of the world, which
every rank joins). Where DDP runs on a subgroup of the world (torch's own DDP tests use ``{0, 2}`` and
``{1, 3}``; a node's ranks), the ranks outside it, training another replica or not at all, never call
into fused_zero: each group is made by its own members only (``use_local_synchronization``), whose
name torch derives from its ranks and from how many groups each member has made so far. So the members
check first that they have made equally many (one all-gather over DDP's group), and refuse on every
rank, saying why, where they have not, rather than wait for each other under different names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm import collectives

_GROUPS: dict[tuple, object] = {}
"""Process groups made here, by their global ranks (None for one this rank is not a member of), under the
default process group ``_GROUPS_WORLD`` holds (see ``_group``)."""
_GROUPS_WORLD: list = [None]


@dataclass(frozen=True)
class Topology:
    """Attributes:
        group, world, rank: DDP's process group, its size W and this rank in it (the reductions'
            averaging, the tail, flags and checks run over it).
        shard_group, shard_size, shard_rank: the ranks sharing this rank's buckets (S of them), and
            this rank's index among them: the ``world_size`` and ``rank`` of every ``BucketLayout``.
        replica_group, replicas, replica: the ranks holding the same slice as this one in the other
            shard groups (None when R = 1), R, and the index of this rank's shard group.
        shards: every shard group's members as ranks of DDP's group, ``shards[replica][shard_rank]``.
        global_ranks: the same, as global ranks (DCP's placements).
        local: DDP's group leaves ranks of the world out: the groups made here are made by their members
            alone (module docstring).
    """

    group: object
    world: int
    rank: int
    shard_group: object
    shard_size: int
    shard_rank: int
    replica_group: object | None
    replicas: int
    replica: int
    shards: tuple[tuple[int, ...], ...]
    global_ranks: tuple[tuple[int, ...], ...]
    local: bool = False

    @property
    def counts_slice(self) -> bool:
        """Whether this rank's slices count towards global sums (norm, non-finite count): every slice is
        held by R ranks after the reduction, and summed once, on replica 0."""
        return self.replica == 0

    @property
    def counts_tail(self) -> bool:
        """The tail is held by every rank: it counts on one."""
        return self.replica == 0 and self.shard_rank == 0

    def check_reduce_dtype(self, dtype: torch.dtype | None, device: torch.device) -> None:
        """Refuse ``grad_reduce_dtype`` where a group's backend cannot sum it (before anything changes)."""
        if dtype is None or self.world == 1:
            return
        for g in (self.group, self.shard_group, self.replica_group):
            if g is not None and not collectives.reduces_in(g, dtype, device):
                raise ValueError(f"grad_reduce_dtype={dtype}: the {collectives.backend_of(g, device)!r} backend of "
                                 f"the process group cannot sum {dtype} tensors (gloo can; NCCL from 2.10 for "
                                 "bfloat16); leave grad_reduce_dtype=None to reduce in the gradients' dtype")

    def position(self, rank: int) -> tuple[int, int]:
        """``(replica, shard_rank)`` of DDP-group rank ``rank``."""
        for replica, members in enumerate(self.shards):
            if rank in members:
                return replica, members.index(rank)
        raise ValueError(f"rank {rank} is not in DDP's group of {self.world}")

    def group_rank(self, global_rank: int) -> int | None:
        """DDP-group rank of global rank ``global_rank`` (None where it is not in DDP's group): frameworks
        name the rank that writes a checkpoint by its global rank, ``state_dict(to=)`` by its group rank."""
        for members, ranks in zip(self.shards, self.global_ranks):
            if global_rank in ranks:
                return members[ranks.index(global_rank)]
        return None

    @staticmethod
    def build(group, shard_group, device: torch.device) -> Topology:
        """The topology of DDP's ``group`` sharded by the ``shard_group`` option (module docstring);
        one rank and no group for a plain module in a process without a process group (local.py)."""
        if group is None and not process_group_exists():
            return Topology(None, 1, 0, None, 1, 0, None, 1, 0, ((0,),), ((0,),))
        group = group if group is not None else dist.group.WORLD
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ddp_ranks = tuple(dist.get_process_group_ranks(group)) if world > 1 else (dist.get_rank(),)
        given = None  # the user's own process group of this rank's shard group
        if shard_group is None:
            members = [tuple(range(world))]
        elif isinstance(shard_group, int):
            members = _consecutive(shard_group, world)
        elif _is_mesh(shard_group) and shard_group.ndim == 2:
            members = _from_mesh(shard_group, ddp_ranks)
        elif _is_mesh(shard_group):
            if shard_group.ndim != 1:
                raise ValueError(f"shard_group: a DeviceMesh of {shard_group.ndim} dimensions; give a 2-D mesh "
                                 "(replicate, shard), as FSDP2's HSDP takes, or a 1-D mesh of the shard group")
            given = shard_group.get_group()
            members = _gathered(given, group, world, ddp_ranks, device)
        else:
            given = shard_group
            members = _gathered(given, group, world, ddp_ranks, device)
        S, R = len(members[0]), len(members)
        local = _local(group, world, device)
        replica, shard_rank = next((i, m.index(rank)) for i, m in enumerate(members) if rank in m)
        global_ranks = tuple(tuple(ddp_ranks[r] for r in m) for m in members)
        if S == world:
            shard_pg = group  # the same communicator as DDP's: one stream, and no group to make
        elif given is not None:
            shard_pg = given
        elif _is_mesh(shard_group):
            shard_pg = shard_group.get_group(1)
        else:
            shard_pg = _group_of(global_ranks, replica, local)
        replicas = [tuple(m[j] for m in global_ranks) for j in range(S)]
        if R == 1:
            replica_pg = None
        elif S == 1:
            replica_pg = group
        elif _is_mesh(shard_group) and given is None:
            replica_pg = shard_group.get_group(0)
        else:
            replica_pg = _group_of(replicas, shard_rank, local)
        if S > 1 and dist.get_rank(shard_pg) != shard_rank:
            raise ValueError(f"shard_group: this rank is rank {dist.get_rank(shard_pg)} of its shard group but "
                             f"position {shard_rank} in its member list; build the group from its ranks in order")
        return Topology(group, world, rank, shard_pg, S, shard_rank, replica_pg, R, replica,
                        tuple(members), global_ranks, local)


def process_group_exists() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_and_rank(group) -> tuple[int, int]:
    """``group``'s size and this rank in it; ``(1, 0)`` with no process group at all (a plain module)."""
    if group is None and not process_group_exists():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _consecutive(size, world: int) -> list[tuple[int, ...]]:
    if isinstance(size, bool) or size < 1 or world % size:
        divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        raise ValueError(f"shard_group={size!r} does not tile DDP's group of {world} ranks into groups of "
                         f"consecutive ranks: give a divisor of {world} ({divisors}), or a process group "
                         "or DeviceMesh whose groups tile it")
    return [tuple(range(i, i + size)) for i in range(0, world, size)]


def _is_mesh(obj) -> bool:
    return type(obj).__name__ == "DeviceMesh" and hasattr(obj, "get_group")


def _from_mesh(mesh, ddp_ranks: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Shard groups of a 2-D DeviceMesh (the rows: dimension 1 shards), as ranks of DDP's group."""
    rows = [tuple(int(r) for r in row) for row in mesh.mesh.tolist()]
    flat = sorted(r for row in rows for r in row)
    if flat != sorted(ddp_ranks):
        raise ValueError(f"shard_group: the DeviceMesh holds ranks {flat}, DDP's process group {sorted(ddp_ranks)}: "
                         "build the mesh over DDP's ranks (init_device_mesh(device, (replicas, shard_size)))")
    return [tuple(ddp_ranks.index(r) for r in row) for row in rows]


def _gathered(pg, group, world: int, ddp_ranks: tuple[int, ...], device) -> list[tuple[int, ...]]:
    """Every rank's shard group, learned by one all-gather over DDP's group (a process group's members
    are known only to its own ranks), then checked to tile DDP's group."""
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(f"shard_group must be an int (ranks per shard group), a ProcessGroup or a DeviceMesh, "
                        f"got {type(pg).__name__}")
    mine = dist.get_process_group_ranks(pg)
    own = torch.full((world,), -1, dtype=torch.int64, device=device)
    for i, r in enumerate(mine):
        own[i] = ddp_ranks.index(r) if r in ddp_ranks else world  # world: not one of DDP's ranks
    everyone = torch.empty(world * world, dtype=torch.int64, device=device)
    if world > 1:
        collectives.all_gather(everyone, own, group, async_op=False)
    else:
        everyone.copy_(own)
    lists = [tuple(r for r in row if r >= 0) for row in everyone.view(world, world).cpu().tolist()]
    for r, members in enumerate(lists):
        if r not in members:
            raise ValueError(f"shard_group: rank {r}'s shard group ({list(members)}) does not contain rank {r}, "
                             "or holds ranks outside DDP's process group; pass each rank the group it belongs to")
    groups = list(dict.fromkeys(lists))
    for r, members in enumerate(lists):
        for other in groups:
            if other != members and r in other:
                raise ValueError(f"shard_group: rank {r} is in the shard groups {list(members)} and {list(other)} "
                                 "of different ranks; the shard groups must be disjoint")
    return _check_tiling(groups, world, "the process groups")


def _check_tiling(groups, world: int, what: str) -> list[tuple[int, ...]]:
    sizes = sorted({len(g) for g in groups})
    if len(sizes) > 1:
        raise ValueError(f"shard_group: {what} have sizes {sizes}; every shard group must have the same size "
                         f"(a divisor of DDP's {world} ranks)")
    covered = sorted(r for g in groups for r in g)
    if covered != list(range(world)):
        raise ValueError(f"shard_group: {what} cover ranks {covered} of DDP's group of {world}: the shard groups "
                         "must tile it (disjoint, equal sizes, every rank in one)")
    return sorted(groups)


def _group_of(groups: list[tuple[int, ...]] | tuple[tuple[int, ...], ...], mine: int, local: bool):
    """The process group of ``groups[mine]`` (this rank's): made by its members alone (``local``), or
    after making (or finding) one for every group, as every rank of the world does (module docstring)."""
    if not local:
        return [_group(tuple(members), members, False) for members in groups][mine]
    return _group(tuple(groups[mine]), groups[mine], True)


def _local(ddp_group, world: int, device: torch.device) -> bool:
    """Whether DDP's group leaves ranks of the world out: then groups are made by their members alone, once
    they agree (a collective of DDP's group) that each has made as many groups as the others."""
    if world == 1 or world == dist.get_world_size():
        return False
    made = torch.tensor([_naming_key()], dtype=torch.int64, device=device)
    keys = torch.empty(world, dtype=torch.int64, device=device)
    collectives.all_gather(keys, made, ddp_group, async_op=False)
    keys = keys.tolist()
    if len(set(keys)) > 1:
        apart = [r for r, k in enumerate(keys) if k != keys[0]]
        raise ValueError(
            f"DDP runs on a subgroup of the world, whose ranks have made different numbers of process groups "
            f"so far (ranks {apart} of DDP's group against its rank 0, as torch {torch.__version__} counts "
            "them): a group fused_zero makes of some of them would get a different name on each (torch names "
            "a group made by its members alone after its ranks and that count), and they would wait for each "
            "other forever. Make the same process groups, in the same order, on every rank of DDP's group "
            "before building the optimizer")
    return True


def _naming_key() -> int:
    """What torch names a group made by its members alone after, besides its ranks, as an integer: torch's
    own ``_hash_ranks_to_str`` of one fixed rank list. It reads the count of groups this rank has
    registered up to torch 2.13 (``len(_world.pg_names)``), and of group creations it has reached from 2.14
    on (``_world.group_count``, which also counts groups the rank is not a member of): comparing the
    names, not one of the counts, follows the installed torch."""
    c10d = dist.distributed_c10d
    name = getattr(c10d, "_hash_ranks_to_str", None)
    if name is not None:
        return int(name([0])[:15], 16)
    world = c10d._world
    return getattr(world, "group_count", len(world.pg_names))


def post_update_groups(topo: Topology) -> tuple[object, object]:
    """``(gathers' group, checks' group)``: twins of the shard group and of DDP's group, for the
    collectives that wait for an update (the all-gathers, the overflow / norm check's all-reduce) in
    ``overlap="bucket"``. A communicator runs its collectives in issue order, so on the reductions' own
    groups the next bucket's reduction would queue behind this bucket's update (docs/design-pipeline.md "Issue
    order per communicator"). Made once per set of ranks, by its members, in the same order on each;
    where a twin would not number its ranks as the group it stands for, the group itself is used."""
    ddp_ranks = tuple(sorted(r for members in topo.global_ranks for r in members))
    check = _twin([ddp_ranks], 0, topo.local)
    gather = topo.shard_group
    if topo.shard_size > 1:
        gather = _twin(topo.global_ranks, topo.replica, topo.local)
        if dist.get_rank(gather) != topo.shard_rank:
            gather = topo.shard_group
    if dist.get_rank(check) != topo.rank:
        check = topo.group
    return gather, check


def _twin(groups, mine: int, local: bool):
    if not local:
        return [_group(("post-update", *sorted(m)), sorted(m), False) for m in groups][mine]
    members = sorted(groups[mine])
    return _group(("post-update", *members), members, True)


def _group(key: tuple, members, local: bool) -> object:
    """The group of ``members`` (global ranks) made for ``key``, made now if it is not made yet: by its
    members alone (``local``) or by every rank of the world. The groups belong to the default process
    group they were made under: after ``destroy_process_group`` and a new ``init_process_group`` (a
    second run in one process) they are made anew, not handed out destroyed."""
    world = dist.group.WORLD
    if _GROUPS_WORLD[0] is not world:
        _GROUPS.clear()
        _GROUPS_WORLD[0] = world
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(members), use_local_synchronization=local)
    return _GROUPS[key]
