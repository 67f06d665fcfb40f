"""Several fused_zero optimizers over one DDP module: each is a *member* of the module's one engine.

DDP takes one comm hook, and its buckets mix the parameters of every optimizer (Muon's matrices beside
AdamW's embeddings, norms and biases), so the reduction stays one per bucket, and so does the step
count per parameter. Everything a user can observe per optimizer is its own, as torch.optim's
optimizers are independent objects: its parameters, param groups, algorithm and state (a shard keeps one
part per member and state format, shard.py), its coefficient table and launches, its ``step()`` (in
overlap="step" its update runs then: stepping.py), its overflow skip and skip count, its GradScaler state
(amp.py), its ``state_dict()`` and schedulers. ``max_grad_norm`` clips by the norm of every member's
gradients, as one ``clip_grad_norm_(model.parameters())`` before the steps does (docs/design-optimizers.md,
"Several optimizers, each torch.optim's own").

``MemberView`` is one member's share as the checkpoint side reads it (checkpoint/*), in narrow faces
rather than the engine: its optimizer and algorithm, its parameter table (its parameters in its own
order, local indices ``i`` as its state dict numbers them), its ranks, its state's layout (the shards
holding its state, its parts and names there), its step counts. tests/test_package_layout.py holds every
module outside pipeline/ to at most 8 attributes of the engine or of such a view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..algorithms.interface import Algorithm
from .step_end.amp import ScalerLink

if TYPE_CHECKING:
    from .buckets.param_table import ParamTable


@dataclass
class Member:
    """One fused_zero optimizer of an engine.

    Attributes:
        index: its position among the engine's members (the order they attached in).
        opt: the optimizer (its ``param_groups`` are read at every step).
        algo: its algorithm (algorithms/interface.Algorithm: what the engine asks of it).
        pids: the engine's indices of its parameters, in its own order.
        group_formats: each of its param groups' state format.
        scaler: its link to the user's GradScaler (GradScaler keeps a state per optimizer), or None.
    """

    index: int
    opt: object
    algo: Algorithm
    pids: np.ndarray
    group_formats: list[str]
    scaler: ScalerLink | None = None

    @property
    def name(self) -> str:
        return f"{type(self.opt).__name__} (optimizer {self.index} over this DDP module)"

    def hparams(self) -> list[dict]:
        """Its param groups' hyperparameters as they are now (what an update reads)."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]

    @property
    def captured(self) -> bool:
        """Whether its ``step()``'s device work is replayed from a CUDA graph (it was built with
        ``capturable=True``: AdamW and Adam, whose update is the fused kernel); the other members of
        the engine step eagerly beside it (pipeline/step_end/step_graph.py)."""
        return self.opt._capturable


@dataclass(frozen=True)
class Ranks:
    """Who holds a member's state: the optimizer's process group, this rank in it, the device of its
    state and how the group is cut into shard groups (buckets/topology.py)."""

    world: int
    rank: int
    group: object
    device: object
    topology: object


@dataclass(frozen=True)
class ParamTable:
    """A member's parameters in its own order (local indices ``i``, as its state dict numbers them) and
    what each is to the engine: its index there (``pids``; ``local_of`` back), its param group, its
    state format; ``member`` the member's index, ``engine_params`` every parameter of the engine (what
    the parts' row tables index)."""

    params: list
    pids: np.ndarray
    local_of: dict
    group_of: np.ndarray
    group_formats: list
    state_formats: list
    member: int
    engine_params: list


class StateLayout:
    """Where a member's state lives: the shards of the buckets holding its parameters, its parts and
    state names in each, where each parameter is, and whether 8-bit moments are held in fp32 since a
    load (``held_decoded``: the registry's, read and set) and whether DDP's rebuild, which makes it so, is to
    come. Built by the engine (``Engine.view``) from the registry, the weights' watch and the rebuild's
    test, bound to the DDP module."""

    def __init__(self, member: Member, registry, weights, rebuild_pending):
        self._member, self._registry, self._weights = member, registry, weights
        self.rebuild_pending = rebuild_pending
        """Whether DDP will still rebuild its buckets (a load then holds 8-bit moments in fp32 until it:
        buckets/rebuild.py)."""

    def shards(self) -> list:
        """The shards of the buckets holding some of the member's parameters, in the engine's order: the
        same on every rank, whether or not its region holds rows of them (collectives follow this order)."""
        return [s for s in self._registry.shards() if (s.members == self._member.index).any()]

    def parts(self, shard) -> list:
        return [p for p in shard.parts if p.member == self._member.index]

    def names(self, shard) -> list[str]:
        """The member's state names in ``shard`` (its algorithm's, then ``"master"`` where kept)."""
        return self._member.algo.state_names() + (["master"] if "master" in shard.names else [])

    def where(self, i: int):
        """``(shard, index in the bucket)`` of the member's parameter ``i``."""
        return self._registry.where[int(self._member.pids[i])]

    def masters_loaded(self) -> None:
        """A load wrote the masters from a state dict (after the weights they round to): the weights as
        they are now count as seen, so that the next update does not take the masters afresh from a
        model load made before this one (pipeline/reducing/weight_watch.py)."""
        self._weights.look()

    @property
    def held_decoded(self) -> bool:
        return self._registry.held_decoded

    @held_decoded.setter
    def held_decoded(self, value: bool) -> None:
        self._registry.held_decoded = value


class MemberView:
    """One member's share of an engine as the checkpoint side reads it, in narrow faces (module
    docstring): ``opt`` and ``algo``; ``table`` (ParamTable), ``ranks`` (Ranks), ``layout``
    (StateLayout); the step counts (``counts()``, ``steps``); ``synchronize()``; and, for the
    checkpoint server's thread, ``side`` and ``iteration``. Built by the engine (``Engine.view``):
    ``parameters`` its parameter table (buckets/param_table.py), ``step_counts`` every parameter's
    (updating/step_counts.py), ``stepping`` the owner of the iteration (step_end/stepping.py)."""

    def __init__(self, member: Member, parameters: ParamTable, ranks: Ranks, layout: StateLayout, *,
                 step_counts, side, stepping):
        self.opt, self.algo = member.opt, member.algo
        self._pids = member.pids
        self.table = ParamTable(
            params=[parameters.tensors[pid] for pid in member.pids], pids=member.pids,
            local_of={int(pid): i for i, pid in enumerate(member.pids)},
            group_of=parameters.group_of[member.pids], group_formats=member.group_formats,
            state_formats=[parameters.state_formats[pid] for pid in member.pids],
            member=member.index, engine_params=parameters.tensors)
        self.ranks, self.layout = ranks, layout
        self.side, self._step_counts, self._stepping = side, step_counts, stepping

    @property
    def iteration(self):
        return self._stepping.iteration

    def synchronize(self) -> None:
        self._stepping.synchronize()

    def counts(self) -> np.ndarray:
        """The member's step counts on the host (a wait for the device, once until they change)."""
        return self._step_counts.host()[self._pids]

    @property
    def steps(self) -> np.ndarray:
        return self.counts().copy()

    @steps.setter
    def steps(self, value) -> None:
        full = self._step_counts.host().copy()
        full[self._pids] = value
        self._step_counts.write(full)
