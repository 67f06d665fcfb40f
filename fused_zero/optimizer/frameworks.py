"""What the framework integrations (fused_zero/accelerate.py, lightning.py, transformers.py) ask of a
fused_zero optimizer, as its public methods: the options it was given, the mode it runs in, the clip its
next update applies and the norm it measured, its skipped steps without a host sync, and the checkpoint
dict for a framework that writes from one rank. tests/test_package_layout.py holds the integrations to
public methods: a framework's wrapper is written against these, never the optimizer's internals."""

from __future__ import annotations

import torch

from ..checkpoint import canonical, loading
from . import protocol


class FrameworkMethods:
    """Mixed into every fused_zero optimizer (base.py ``ShardedOptimizer``)."""

    @property
    def sharding_options(self) -> dict:
        """The sharding options given at construction and at ``attach`` (options.OPTIONS), as given
        (``overlap="auto"`` resolves at attach: ``overlap``)."""
        return dict(self._options)

    @property
    def overlap(self) -> str:
        """The overlap mode: once attached, the one the optimizer runs in ("bucket", "backward" or "step");
        before, the one given."""
        return self._engine.overlap if self._engine is not None else self._options.get("overlap", "auto")

    @property
    def reads_grad_at_step(self) -> bool:
        """Whether ``step()`` updates from ``param.grad`` as it is then (overlap="step" with
        grad_reduce="all_reduce"), so that edits made after the backward (a framework's own clipping or
        unscaling) are honored as torch.optim honors them (pipeline/step_end/step_policy.py)."""
        options = self._attached_engine("reads_grad_at_step").options
        return options.overlap == "step" and options.grad_reduce == "all_reduce"

    def attached_to(self, module) -> bool:
        """Whether this optimizer is attached to ``module`` (the DDP module, or the plain one, it was given)."""
        return self._engine is not None and self._engine.ddp is module

    def reduced_parameters(self) -> list:
        """Every parameter the DDP module reduces (this optimizer's, its peers' over the module, and those
        no fused_zero optimizer updates): what a clip by the global norm covers."""
        return list(self._attached_engine("reduced_parameters()").params)

    @property
    def max_grad_norm(self) -> float | None:
        """What the next update clips the gradients' global norm to (every optimizer over the module
        shares it), None for no clip. Set it between the backward and ``step()`` to clip that step
        (overlap="step"; in "backward" the update has run): a framework's ``clip_grad_norm_`` does."""
        return self._engine.max_grad_norm if self._engine is not None else self._options.get("max_grad_norm")

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        self._attached_engine("max_grad_norm").clip_to(value)

    def grad_norm(self) -> torch.Tensor | None:
        """The global 2-norm of the reduced, unscaled gradients the last update read, before any clip (a
        device scalar, read on the current stream once ``step()`` joined the side stream: no host sync),
        where one update covered every bucket (overlap modes "step" and "backward"); else None."""
        sumsq = self._attached_engine("grad_norm()").grad_sumsq
        if sumsq is None:
            return None
        if sumsq.device.type == "cuda":  # written on the side stream, which step() joined
            sumsq.record_stream(torch.cuda.current_stream(sumsq.device))
        return sumsq.sqrt()

    def skipped_steps_on_device(self) -> torch.Tensor:
        """``skipped_steps`` as an int64 device scalar, a copy taken on the current stream: no host sync
        (compare two of them to learn whether the steps between skipped, reading only when asked)."""
        return self._attached_engine("skipped_steps_on_device()").skipped[self._member.index].clone()

    def state_dict_written_by(self, writer: int) -> dict:
        """For frameworks that build the checkpoint on every rank and write it from global rank ``writer``
        alone (Lightning, Accelerate): the whole dict there, gathered there alone; ``{}`` on the other
        ranks, once ``writer`` has been served (see canonical.written_by)."""
        return protocol.through_state_dict_hooks(
            self, lambda: loading.kept_state_dict(self, self._kept) if self._engine is None  # no communication
            else canonical.written_by(self._view, self._peers, writer))
