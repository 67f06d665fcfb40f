"""The engine's parameter table, the face its stages read the parameters through: the parameters DDP
reduces (requiring grad), what each is to the engine and the members that update them.

Built once by the engine (pipeline/engine.py) and handed to each stage that reads it, in place of the
engine. Its fields are never rebound: a param group joining a member (pipeline/added_groups.py) writes
the arrays in place, so every stage holding the table sees the change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ParamTable:
    """Attributes:
        tensors: the parameters, by their index in the engine (``pid``).
        pid_of: parameter -> its index.
        member_of: each parameter's member (its index among ``members``), or ``NO_MEMBER`` (options.py):
            reduced as DDP reduces it and left to its owner.
        group_of: each parameter's param group in its member.
        state_formats: each parameter's state format (its param group's; "fp32" for ``NO_MEMBER``'s).
        members: the fused_zero optimizers over the module (pipeline/members.py), in the order they attached.
    """

    tensors: list
    pid_of: dict
    member_of: np.ndarray
    group_of: np.ndarray
    state_formats: list
    members: list
    _group_index: dict = field(default_factory=dict, repr=False)

    def group_index(self, member: int) -> np.ndarray:
        """Each parameter's param group in ``member`` (0 for the other members' parameters: their rows
        of the member's table are inactive)."""
        if member not in self._group_index:
            self._group_index[member] = np.where(self.member_of == member, self.group_of, 0)
        return self._group_index[member]

    def regrouped(self, member: int) -> None:
        """``member``'s parameters or param groups changed (a group joined it): its index is made anew."""
        self._group_index.pop(member, None)
