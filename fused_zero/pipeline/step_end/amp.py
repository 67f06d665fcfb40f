"""torch.amp.GradScaler's side of the contract: the loss scale the kernels divide by, and the global
found-inf flag that ``scaler.update()`` reads.

GradScaler hands scaling to optimizers that set ``_step_supports_amp_scaling = True`` (torch's fused
AdamW does): ``scaler.step(opt)`` sets ``opt.grad_scale`` and ``opt.found_inf`` and calls
``opt.step()``; ``scaler.update()`` then reads the scaler's per-optimizer ``found_inf_per_device``.
Two things in that contract do not fit a sharded optimizer, and the link below bridges them:

- ``scaler.step()`` first checks every ``param.grad`` for infs (``_check_inf_per_device``: one pass
  over the whole local gradient, on every rank) unless its per-optimizer stage says the check is
  done. What that pass sees is each rank's *unreduced* gradient with ``grad_reduce="reduce_scatter"``,
  so the ranks' scalers would disagree. The engine instead checks its own reduced slices (1/W of the
  gradient, in the pass that also computes the clipping norm), all-reduces the flag, and hands it to
  the scaler as ``found_inf_per_device`` with a stage of its own (``PREPARED``), which is neither
  READY (so ``step()`` skips its pass) nor UNSCALED (so ``step()`` still passes the loss scale).
  ``scaler.unscale_(opt)`` keeps working as torch documents it: it unscales ``param.grad`` in place
  and takes over the stage, and the engine then writes its global flag into the scaler's tensors.
- With ``overlap="backward"`` the update runs inside the backward, before ``scaler.step()``: the
  optimizer must know the scaler then. The user passes it once, ``grad_scaler=scaler``, at
  construction; the loss scale is read from it (a device tensor, no host sync) when the last bucket
  is reduced. The same argument serves ``overlap="step"``, so one contract holds in both modes.

This reads two private attributes of GradScaler (``_scale`` and ``_per_optimizer_states``), the ones
the contract above is made of; tests/pipeline/step_end/test_mixed_precision.py checks them against the installed torch.

GradScaler keeps a state per optimizer, and so does the link: each fused_zero optimizer over a module
has its own (pipeline/members.py), its own flag (its own gradients' overflow: the others step) and its own
scale (None once the user unscaled its ``param.grad``), as torch's optimizers have.
"""

from __future__ import annotations

import torch

PREPARED = "fused_zero: found-inf known"  # a stage GradScaler does not know: see the module docstring


class ScalerLink:
    """The optimizer's view of the user's GradScaler."""

    def __init__(self, scaler, optimizer):
        if not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.scaler = scaler
        self.optimizer = optimizer

    @property
    def enabled(self) -> bool:
        return bool(self.scaler.is_enabled())

    def scale(self) -> torch.Tensor:
        """The loss scale the gradients of this backward carry (one-element device tensor)."""
        scale = self.scaler._scale
        if scale is None:
            raise RuntimeError("the optimizer was given grad_scaler=scaler, but scaler.scale(loss) was not "
                               "called before this backward: scale the loss, or drop grad_scaler=")
        return scale.reshape(1)

    def _state(self) -> dict:
        return self.scaler._per_optimizer_states[id(self.optimizer)]

    def unscaled(self) -> bool:
        """Whether the user has called ``scaler.unscale_(optimizer)`` in this iteration: its ``param.grad``
        is divided in place and its step gets no loss scale."""
        return self._state()["stage"] is torch.amp.grad_scaler.OptState.UNSCALED

    def prepare(self, device: torch.device) -> None:
        """Called when the last bucket of a backward is reduced: what ``scaler.step()`` and
        ``scaler.update()`` read from now on. A flag of the compute stream's own, 0-dim as
        ``scaler.unscale_`` makes them (``scaler.update()`` adds every optimizer's flags together), which
        ``publish`` fills once the side stream's checks of this optimizer are done."""
        state = self._state()
        state["found_inf_per_device"] = {device: torch.zeros((), dtype=torch.float32, device=device)}
        state["stage"] = PREPARED

    def publish(self, found_inf: torch.Tensor) -> None:
        """Make the scaler's found-inf tensors of this optimizer hold its own skip flag, all ranks' (ours
        from ``prepare``, or after a user's ``unscale_`` that rank's own check). Queued where ``found_inf``
        was written, after the compute stream (stepping.py)."""
        for t in self._state()["found_inf_per_device"].values():
            t.copy_(found_inf.reshape(t.shape).to(t.device, t.dtype))
