"""PyTorch Lightning: ``Trainer(strategy=FusedZeroStrategy(...))`` with ``configure_optimizers`` returning
a fused_zero optimizer built from ``self.parameters()``.

Lightning wraps the module in DDP before it calls ``configure_optimizers``; the strategy then attaches
the optimizer to that DDP module (``opt.attach``). What Lightning does around the optimizer is mapped or
refused here, at setup:

- ``gradient_clip_val`` with ``gradient_clip_algorithm="norm"`` becomes the optimizer's
  ``max_grad_norm`` (the default ``overlap="auto"`` then resolves to "backward"; an explicit "bucket" is
  refused, options.WHOLE_STEP), and Lightning's own clipping of ``param.grad`` is skipped. Clipping by
  value is refused.
- ``precision="16-mixed"``: Lightning's GradScaler (its ``MixedPrecision`` plugin's) is handed to the
  optimizer at attachment (``grad_scaler=``: "auto" resolves to "backward"; an explicit "bucket" is
  refused at setup). The plugin then steps as it does for torch's fused
  optimizers: no ``scaler.unscale_`` (the optimizer sets ``_step_supports_amp_scaling``: the kernel
  unscales), ``scaler.step(optimizer)``, ``scaler.update()``; a clip maps to ``max_grad_norm``, which
  clips the unscaled gradients. ``"bf16-mixed"``, ``"bf16-true"``, ``"16-true"`` and 32-bit need no
  scaler.
- ``accumulate_grad_batches`` works through Lightning's own ``no_sync``; LR schedulers as usual.
- Checkpoints: Lightning builds the checkpoint dict on every rank and writes it from global rank 0
  alone (``Strategy.save_checkpoint``: ``checkpoint_io`` runs where ``is_global_zero``); the other
  ranks' dicts go only through the ``on_save_checkpoint`` hooks. So the optimizer's state is gathered
  to rank 0 alone (``state_dict(to=0)``: one whole dict, W - 1 transfers) and the other ranks' entry
  in ``optimizer_states`` is ``{}``, as Lightning's own ``optimizer_state`` gives sharded optimizers
  (torch's ZeroRedundancyOptimizer). A resume loads the file rank 0 wrote, on every rank.

Needs the ``lightning`` extra: ``pip install "fused-zero[lightning]"``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy

from .optimizer import ShardedOptimizer
from .options import OPTIONS, check_whole_step, normalize_options

_MAPPED = ("stochastic_rounding", "backend", "_backend")  # normalize_options maps (or keeps) them

LIGHTNING_OWNS = {
    "ddp": "Lightning wraps the module in DDP itself; the strategy attaches the optimizer to that module",
    "max_grad_norm": "Lightning owns clipping: pass Trainer(gradient_clip_val=...), which becomes max_grad_norm",
    "grad_scaler": "Lightning owns the loss scaler: pass Trainer(precision='16-mixed'), whose scaler is handed "
                   "over",
}
"""The sharding options Lightning sets through its own arguments, refused here naming them."""

SHARDING_OPTIONS = tuple(name for name, _, _ in OPTIONS if name not in LIGHTNING_OWNS)
"""The sharding options FusedZeroStrategy forwards to the optimizer's ``attach`` (options.OPTIONS)."""


class FusedZeroStrategy(DDPStrategy):
    """DDP with a fused_zero optimizer attached to the DDP module.

    Args:
        **kwargs: fused_zero's sharding options (``SHARDING_OPTIONS``: every one of options.OPTIONS but
            those Lightning owns, ``LIGHTNING_OWNS``), forwarded to the optimizer's ``attach``; not given,
            the optimizer's own (or the default) apply. The rest is what ``DDPStrategy`` takes
            (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``, ``gradient_as_bucket_view``,
            ``process_group_backend``, ...).
    """

    strategy_name = "fused_zero"

    def __init__(self, **kwargs: Any) -> None:
        owned = sorted(k for k in kwargs if k in LIGHTNING_OWNS)
        if owned:
            raise ValueError(f"FusedZeroStrategy does not take {', '.join(owned)}: "
                             + "; ".join(LIGHTNING_OWNS[k] for k in owned))
        sharding = {k: kwargs.pop(k) for k in list(kwargs) if k in SHARDING_OPTIONS or k in _MAPPED}
        super().__init__(**kwargs)
        self._sharding = normalize_options(sharding, "FusedZeroStrategy", stacklevel=3)
        self._max_grad_norm: float | None = None

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        ours = [o for o in self.optimizers if isinstance(o, ShardedOptimizer)]
        if len(self.optimizers) != 1 or not ours:
            kinds = [type(o).__name__ for o in self.optimizers]
            raise TypeError("FusedZeroStrategy needs configure_optimizers to return exactly one fused_zero "
                            f"optimizer (e.g. fused_zero.AdamW(self.parameters(), ...)); got {kinds}. Use "
                            "strategy='ddp' for torch.optim optimizers")
        opt = ours[0]
        options = dict(self._sharding)
        clip = self._map_gradient_clipping(trainer, opt)
        if clip is not None:
            options["max_grad_norm"] = clip
        scaler = self._loss_scaler(opt)
        if opt.attached:  # built with ddp=self.trainer.strategy.model: nothing left to do but check
            if not opt.attached_to(self.model):
                raise RuntimeError("the optimizer is attached to another DDP module than the strategy's")
            if options:
                raise ValueError(f"the optimizer was attached in configure_optimizers; give {sorted(options)} "
                                 "there, not to FusedZeroStrategy")
            if opt.sharding_options.get("grad_scaler") is not scaler:
                raise ValueError("the optimizer was attached in configure_optimizers without Lightning's "
                                 "GradScaler: give it grad_scaler=self.trainer.precision_plugin.scaler there, "
                                 "or leave ddp= out and let FusedZeroStrategy attach it")
        else:
            if scaler is not None:
                options["grad_scaler"] = scaler
            opt.attach(self.model, **options)
        self._wrap_clipping(opt)

    def _map_gradient_clipping(self, trainer: pl.Trainer, opt: ShardedOptimizer) -> float | None:
        """``Trainer(gradient_clip_val=...)`` as the optimizer's max_grad_norm, or a refusal saying why."""
        value = trainer.gradient_clip_val
        if value is None or value <= 0:
            return None
        algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
                        or "norm").lower()
        if algorithm != "norm":
            raise ValueError(f"gradient_clip_algorithm={algorithm!r} is not supported with FusedZeroStrategy: "
                             "fused_zero sees the reduced gradients only inside its update; clip by norm "
                             "(gradient_clip_algorithm='norm'), which maps to the optimizer's max_grad_norm")
        check_whole_step("gradient_clip_val", "clip", self._overlap(opt))
        self._max_grad_norm = float(value)
        return self._max_grad_norm

    def _loss_scaler(self, opt: ShardedOptimizer):
        """Lightning's GradScaler (``precision="16-mixed"``), which the optimizer must know from the
        backward on (``grad_scaler=``); None without one. Refused where the mode cannot take it, or
        where the optimizer was given a scaler Lightning does not step through."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        own = opt.sharding_options.get("grad_scaler")
        if own is not None and own is not scaler:
            raise ValueError("the optimizer was given grad_scaler=..., but Lightning steps it through "
                             + ("its own GradScaler" if scaler is not None else "no GradScaler (this precision "
                                f"is {self.precision_plugin.precision!r})")
                             + ": leave grad_scaler out, FusedZeroStrategy hands Lightning's scaler over")
        if scaler is None:
            return None
        check_whole_step("precision='16-mixed' (a GradScaler; 'bf16-mixed' needs none)", "scaler", self._overlap(opt))
        return scaler

    def _overlap(self, opt: ShardedOptimizer) -> str:
        """The overlap mode given (to the strategy or the optimizer); "auto" resolves at attach from the
        clip and the scaler mapped here."""
        return self._sharding.get("overlap", opt.sharding_options.get("overlap", "auto"))

    def _wrap_clipping(self, opt: ShardedOptimizer) -> None:
        """Lightning clips ``param.grad`` between the backward and ``step()``; the optimizer clips the
        reduced gradients itself (``max_grad_norm``), so Lightning's clipping of our optimizer is skipped,
        and a request the optimizer would not honour (another value, by value) raises."""
        plugin = self.precision_plugin
        original = plugin.clip_gradients
        mapped = self._max_grad_norm

        def clip_gradients(optimizer, clip_val=0.0, gradient_clip_algorithm=None):
            if getattr(optimizer, "_optimizer", optimizer) is not opt or not clip_val or clip_val <= 0:
                return original(optimizer, clip_val, gradient_clip_algorithm)
            algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm")
            if algorithm != "norm" or clip_val != mapped:
                raise RuntimeError(f"clip_gradients({clip_val}, {algorithm!r}) cannot be applied by fused_zero: "
                                   f"it clips by norm at the value of Trainer(gradient_clip_val=...) "
                                   f"({mapped}), inside step()")
            return None  # the optimizer clips in step()

        plugin.clip_gradients = clip_gradients

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """The optimizer's canonical state dict on global rank 0, the rank whose checkpoint is written
        (module docstring), gathered there alone; ``{}`` on the other ranks, once rank 0 has been served.
        A subclass whose ``save_checkpoint`` writes from other ranks must gather to them instead."""
        return getattr(optimizer, "_optimizer", optimizer).state_dict_written_by(0)

