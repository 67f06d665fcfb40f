"""Every optimizer of fused_zero, declared once (interface.Declaration, each in its algorithm's module),
and what is read from the list: the public names (fused_zero, fused_zero.optimizer, optimizer/twins.py),
the optimizer table ``fused-zero options`` prints, the tests' and benchmarks' hyperparameters, and the
checkpoints' facts about every kind of state (a dict saved by another kind is named as such)."""

from __future__ import annotations

from . import adafactor, adam, elementwise, muon, sgd
from .interface import Algorithm, Declaration

DECLARATIONS: tuple[Declaration, ...] = (adam.ADAMW, adam.ADAM, sgd.SGD, muon.MUON, *elementwise.DECLARATIONS,
                                         adafactor.ADAFACTOR)
"""fused_zero's optimizers, in the order of the public names and the optimizer table."""

BY_NAME: dict[str, Declaration] = {d.name: d for d in DECLARATIONS}

TWINS: tuple[str, ...] = tuple(d.name for d in elementwise.DECLARATIONS)
"""The twins of torch.optim's elementwise optimizers (algorithms/elementwise.py's ``SPECS``)."""

KINDS: dict[str, type[Algorithm]] = {d.algorithm.kind: d.algorithm for d in DECLARATIONS}
"""Each kind of state (``Algorithm.kind``, as a sharded checkpoint records it) and its algorithm."""


def title_of(kind: str) -> str:
    """How refusals name the optimizer that saved state of ``kind`` (the kind itself where none is known)."""
    return KINDS[kind].title if kind in KINDS else kind


def foreign_state(algorithm: type[Algorithm]) -> tuple[str, ...]:
    """The state keys another kind keeps and ``algorithm`` does not: an entry holding one was saved by
    another kind of optimizer."""
    known = {key for other in KINDS.values() for key in other.state_keys}
    return tuple(sorted(known - set(algorithm.state_keys)))


def resembling(group: dict, algorithm: type[Algorithm]) -> type[Algorithm] | None:
    """Another kind whose group keys ``group`` holds every one of (what a dict refused for lacking
    ``algorithm``'s keys looks like), or None."""
    return next((other for other in KINDS.values()
                 if other is not algorithm and all(key in group for key in other.group_keys)), None)


__all__ = ["BY_NAME", "DECLARATIONS", "KINDS", "TWINS", "foreign_state", "resembling", "title_of"]
