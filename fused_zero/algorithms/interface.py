"""What every optimizer of fused_zero declares, in one place: ``Algorithm``, the interface its update
and its state answer to, ``Runs``, how its update runs, and ``Declaration``, the public optimizer made of
it. The pipeline (pipeline/) and the checkpoints (checkpoint/) ask these members and nothing else: they
never test an optimizer's name, nor probe for an attribute it may lack. Each optimizer declares itself
in its own module (adam.py, sgd.py, muon.py, elementwise.py's ``SPECS``, adafactor.py); registry.py
lists them, and everything that enumerates optimizers (the public names, the table ``fused-zero
options`` prints, the tests' and benchmarks' hyperparameters) reads that list.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from . import step_columns


class Runs(enum.Enum):
    """How an algorithm's update runs over the buckets (each value names the driver)."""

    SLICES = "slices"
    """Elementwise, on this rank's slices of the buckets, one ``apply`` per launch (launches.py)."""
    WHOLE_MATRIX = "whole_matrix"
    """In phases with collectives between: the elementwise halves on the slices, a matrix-wide step on the
    matrix's owner rank (Muon: pipeline/updating/whole_matrix.py)."""
    WHOLE_PARAMS = "whole_params"
    """On each parameter whole, assembled on every rank of the shard group, by the algorithm's ``step``
    and ``step_on_device`` (Adafactor: pipeline/updating/whole_params.py)."""

    @property
    def phased(self) -> bool:
        """Whether the update runs in a phase of its own, with collectives, not in the launches."""
        return self is not Runs.SLICES


class Algorithm(ABC):
    """One optimizer's maths and state, as the engine and the checkpoints ask them.

    A coefficient table is made in two halves: ``coefficients`` on the host, from the param groups (the
    step-dependent columns hold placeholders), then ``fill_steps`` on the device, from the step counts
    kept there and the ``step_inputs`` uploaded before (step_columns.py). The fill reads device memory
    only, so a CUDA graph can hold it (pipeline/step_end/step_graph.py)."""

    kind: ClassVar[str]
    """The name a sharded checkpoint records (checkpoint/sharded.py), one per kind of state: Adam and AdamW
    share ``"adam"``."""
    title: ClassVar[str]
    """How refusals name this kind of optimizer ("Adam/AdamW")."""
    runs: ClassVar[Runs] = Runs.SLICES
    """How its update runs (``Runs``)."""
    group_keys: ClassVar[tuple[str, ...]]
    """The hyperparameters every param group of its state dict holds (a dict lacking one is another
    optimizer's, checkpoint/checks.py)."""
    state_keys: ClassVar[tuple[str, ...]]
    """Every per-parameter state key its state dict may hold besides ``step`` (and ``fp32_master``); a
    key another registered optimizer keeps and this one does not marks a dict saved by another kind."""
    keeps_step: ClassVar[bool] = True
    """Whether torch.optim keeps ``step`` in each parameter's state (not SGD's, nor Muon's)."""
    state_order: ClassVar[tuple[str, ...]] = ("step",)
    """The keys of a parameter's state-dict entry in torch's order, as far as it fixes one (the rest
    follow in the layout's order, ``fp32_master`` last)."""
    kept_names: ClassVar[tuple[str, ...]] = ()
    """Per-parameter state kept on every rank beside the regions (NAdam's ``mu_product``, Adafactor's
    statistics): ``kept_entries``, ``check_kept``, ``load_kept`` serve it."""
    finishes: ClassVar[bool] = False
    """Whether ``finish`` has work: kept state that every step advances on every rank."""
    uniform_keys: ClassVar[tuple[str, ...]] = ()
    """Flags that must be equal in every param group (compile-time constants of the kernel): ``flags``."""

    def __init__(self, param_groups: list[dict], defaults: dict):
        """``defaults``: the optimizer's, as torch.optim's constructor made them."""
        self.flags: dict[str, bool] = {}
        self.refresh(param_groups)

    # -- the param groups ------------------------------------------------------------------------------

    def refresh(self, param_groups: list[dict]) -> None:
        """Check the groups' hyperparameters and read the kernel's compile-time flags from them."""
        for i, group in enumerate(param_groups):
            self.check_group(group, i)
        for key in self.uniform_keys:
            values = {bool(g[key]) for g in param_groups}
            if len(values) > 1:
                raise ValueError(f"{key} must be the same in every param group (it is a compile-time "
                                 f"flag of the fused kernel); got {sorted(values)}")
        self.flags = {key: bool(param_groups[0][key]) for key in self.uniform_keys}

    @abstractmethod
    def check_group(self, group: dict, i: int) -> None:
        """Refuse what param group ``i`` holds that torch's step would refuse, in torch's words (its
        constructor has checked the defaults)."""

    def check_options(self, options: dict, where: str) -> None:
        """Refuse the sharding options (``state_format``, ``stochastic_rounding``) its state cannot take;
        ``where`` names the optimizer or the param group in the message."""
        return None

    def check_engine(self, engine, member) -> None:
        """Refuse at construction what it cannot run with the engine's options and the member's groups."""
        return None

    # -- its state ------------------------------------------------------------------------------------

    @abstractmethod
    def state_names(self) -> list[str]:
        """The state tensors it keeps in the regions, shaped as the parameters (1/W per rank)."""

    def has_state(self, count: float, group: dict) -> bool:
        """Whether torch.optim holds state for a parameter of ``group`` stepped ``count`` times (made at
        its first step; SGD's only with momentum; Adagrad's when it is built)."""
        return count > 0

    def group_has(self, name: str, group: dict) -> bool:
        """Whether torch.optim keeps state ``name`` for a parameter of ``group`` (RMSprop's momentum
        buffer only with momentum)."""
        return True

    def fresh(self, name: str, group: dict) -> float:
        """The value of state ``name`` before the parameter's first step (Adagrad's accumulator)."""
        return 0.0

    def saved_count(self, saved: dict) -> float:
        """The step count a saved state-dict entry stands for (where torch keeps none, what its state
        says)."""
        step = saved.get("step", 0.0)
        return float(step.item() if isinstance(step, torch.Tensor) else step)

    def kept_entries(self, pid: int, group: dict, device) -> dict[str, torch.Tensor]:
        """Engine parameter ``pid``'s kept state (``kept_names``), as torch.optim's state dict holds it."""
        return {}

    def kept_needed(self, name: str, param) -> bool:
        """Whether a stepped parameter's saved entry must hold kept state ``name``."""
        return True

    def check_kept(self, name: str, value, shape) -> str | None:
        """Why a saved value of kept state ``name`` cannot load for a parameter of ``shape``, or None."""
        return None

    def load_kept(self, pid: int, saved: dict, device) -> None:
        """Load engine parameter ``pid``'s kept state from its saved entry (none saved: made afresh at
        its first step)."""
        return None

    def bytes_kept(self) -> int:
        """State this rank keeps beside the regions (``kept_names``), for ``memory()``."""
        return 0

    def reference_bytes(self, params) -> int:
        """torch.optim's state of ``params``, fp32, for ``memory()``."""
        return sum(p.numel() for p in params) * 4 * len(self.state_names())

    # -- the coefficient table ------------------------------------------------------------------------

    @abstractmethod
    def coefficients(self, groups: list[dict], group_idx: np.ndarray, active: np.ndarray,
                     grad_div: float) -> torch.Tensor:
        """The host half of the table: a row per parameter (its group ``group_idx``), ``active`` where it
        has a gradient, ``grad_div`` what its reduced gradient is divided by; step columns left to
        ``fill_steps``."""

    def step_inputs(self, groups: list[dict], group_idx: np.ndarray, bound: int, group: torch.Tensor, upload,
                    scratch) -> tuple:
        """What the step columns read besides the counts, on the device: uploaded now (``upload(host,
        out=)``, pipeline/comm/streams.py), from each parameter's param group (``group_idx`` on the host,
        ``group`` on the device) and the counts' host ``bound``; ``scratch`` holds what is uploaded
        every step (pipeline/comm/scratch.py)."""
        return ()

    def fill_steps(self, table: torch.Tensor, inputs: tuple, counts, sr_seed: int | None, scratch) -> None:
        """Write ``table``'s step-dependent columns on the device (queued where the caller is: the side
        stream), from ``counts`` (pipeline.updating.step_counts.StepCounts) and ``inputs`` (``step_inputs``);
        ``sr_seed``: stochastic rounding's seed, or None without it."""
        after = counts.after(scratch)
        self._fill(table, inputs, after, scratch)
        if sr_seed is not None:
            step_columns.fill_sr_keys(table, after, sr_seed)

    @abstractmethod
    def _fill(self, table: torch.Tensor, inputs: tuple, after: torch.Tensor, scratch) -> None:
        """``fill_steps``' own columns, from the counts ``after`` this step."""

    # -- the update -----------------------------------------------------------------------------------

    def compile(self, backend: str, rows: list, segments, coefs: torch.Tensor, args) -> None:
        """Compile its kernels now, at construction, not in the first comm hook (nothing to compile:
        torch's own ops)."""
        return None

    def apply(self, backend: str, rows: list, segments, coefs: torch.Tensor, args) -> None:
        """One launch: update ``rows`` of the regions from ``args`` (fused.UpdateArgs) with ``coefs``
        (``Runs.SLICES`` only; a phased update runs in its driver)."""
        raise RuntimeError(f"{self.title} updates in phases of its own ({self.runs.value}: its driver in "
                           "pipeline/updating/), not in one launch")

    def finish(self, pids, table: torch.Tensor, args) -> None:
        """After a step's launches, on every rank: advance the kept state of ``pids`` (the member's
        parameters of the buckets just updated), pieces here or not (``finishes`` says whether it does)."""
        return None


@dataclass(frozen=True)
class Declaration:
    """One public optimizer of fused_zero, as registry.py lists it.

    Attributes:
        name: its class name, ``fused_zero.<name>``, and its twin's in torch.optim.
        torch_class: the torch.optim optimizer it is the twin of.
        algorithm: its ``Algorithm``, built as ``algorithm(param_groups, defaults)``.
        state: its state per parameter, in words (the optimizer table).
        compact: the compact ``state_format`` values it takes ("-": none).
        how: how its update runs, in words.
        generic: its class is made from torch's constructor signature (optimizer/twins.py); else it is
            written out in optimizer/__init__.py.
        test: the hyperparameters the tests train it with (tests/scenarios.py: each option that changes
            the update, on).
        bench: those the benchmarks run it with (bench/test_bench_optimizers.py; None: not there).
        constructor_only: hyperparameters torch reads from its constructor only (Adagrad's
            ``initial_accumulator_value``): the tests give them to the constructor, not the groups.
    """

    name: str
    torch_class: type
    algorithm: type[Algorithm]
    state: str
    compact: str
    how: str
    generic: bool = False
    test: dict = field(default_factory=dict)
    bench: dict | None = None
    constructor_only: tuple[str, ...] = ()


__all__ = ["Algorithm", "Declaration", "Runs"]
