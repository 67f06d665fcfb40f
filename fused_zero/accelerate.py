"""Hugging Face Accelerate: build the fused_zero optimizer as any other, prepare, then attach it.

    optimizer = fused_zero.AdamW(model.parameters(), lr=3e-4)          # no ddp= yet
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    fused_zero.accelerate.attach(accelerator, model, optimizer)        # model is now the DDP module

Accelerate builds the DDP module inside ``prepare`` (as it builds DeepSpeed's engine or FSDP there), so
the attachment comes right after it. Then the usual loop works: ``accelerator.backward``,
``accelerator.accumulate`` (DDP's ``no_sync``; the wrapped optimizer skips non-sync steps),
``accelerator.save_state`` / ``load_state`` (``state_dict()`` is called on every rank, as fused_zero
needs), ``accelerate launch``. ``accelerator.clip_grad_norm_`` of the model's parameters becomes this
step's ``max_grad_norm`` (``overlap="step"`` only; it returns None, as Accelerate does under DeepSpeed:
the norm is computed inside ``step()``; no ``scaler.unscale_`` either: the optimizer clips the unscaled
gradients). Refused with a message: ``clip_grad_value_`` and clipping in the other overlap modes.

``mixed_precision="fp16"``: Accelerate's GradScaler (the one its optimizer wrapper steps through) is
handed to the optimizer at attachment (``grad_scaler=``), which needs ``overlap="step"`` or
``"backward"``; ``overlap="bucket"`` is refused there. The wrapper then steps as it does for torch's
fused optimizers (``scaler.step(optimizer)``, ``scaler.update()``), and its ``step_was_skipped`` (which
Accelerate's scheduler wrapper reads so as not to advance on an overflow) reports the optimizer's own
found-inf flag. ``accelerator.unscale_gradients()`` (``scaler.unscale_`` of every optimizer, which
Accelerate's own ``clip_grad_norm_`` also calls) leaves this optimizer out: its update unscales the
reduced gradients itself; naming it explicitly is refused.

Needs the ``accelerate`` extra: ``pip install "fused-zero[accelerate]"``.
"""

from __future__ import annotations

from accelerate.optimizer import AcceleratedOptimizer

from .optimizer import _ShardedOptimizer


def attach(accelerator, model, optimizer, **options) -> None:
    """Attach ``optimizer`` (what ``accelerator.prepare`` returned for a fused_zero optimizer) to
    ``model`` (what it returned for the model: a DistributedDataParallel module) and route
    ``accelerator.clip_grad_norm_`` of its parameters to the optimizer. ``options``: sharding options
    not given at construction (see ``fused_zero.AdamW``)."""
    opt = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
    if not isinstance(opt, _ShardedOptimizer):
        raise TypeError(f"attach needs the fused_zero optimizer that accelerator.prepare returned, got "
                        f"{type(opt).__module__}.{type(opt).__qualname__}")
    scaler = optimizer.scaler if isinstance(optimizer, AcceleratedOptimizer) else getattr(accelerator, "scaler", None)
    _check_loss_scaling(accelerator, opt, scaler, options)
    if "DistributedDataParallel" not in type(model).__name__ and accelerator.num_processes == 1:
        raise TypeError(f"accelerator.prepare returned a {type(model).__name__}, not a DistributedDataParallel "
                        "module: this is one process. fused_zero shards over DDP ranks: launch several "
                        "(accelerate launch --multi_gpu --num_processes N script.py; on CPUs build "
                        "Accelerator(cpu=True))")
    if scaler is not None:
        options = {**options, "grad_scaler": scaler}
    opt.attach(model, **options)  # a TypeError naming what prepare returned unless it is a DDP module
    _route_clipping(accelerator, opt)
    if scaler is not None:
        _keep_unscaling_out(accelerator, opt)
        if isinstance(optimizer, AcceleratedOptimizer):
            _report_skipped_steps(optimizer, opt)
    _unshare_saved_weights(accelerator, model)


def _check_loss_scaling(accelerator, opt: _ShardedOptimizer, scaler, options: dict) -> None:
    """Accelerate's GradScaler must be the optimizer's (it scales the loss of every backward, which the
    optimizer's update divides by), in a mode that can take one."""
    own = opt._options.get("grad_scaler") or options.get("grad_scaler")
    if own is not None and own is not scaler:
        raise ValueError("the optimizer was given grad_scaler=..., but Accelerate steps it through "
                         + ("its own GradScaler (accelerator.scaler)" if scaler is not None else
                            f"no GradScaler (mixed_precision={accelerator.mixed_precision!r})")
                         + ": leave grad_scaler out, attach hands Accelerate's scaler over")
    if scaler is None:
        return
    overlap = options.get("overlap", opt._options.get("overlap", "bucket"))
    if overlap not in ("step", "backward"):
        raise ValueError(f"mixed_precision='fp16' (a GradScaler) needs overlap='step' or overlap='backward' "
                         f"(got overlap={overlap!r}): with overlap='bucket' a bucket is updated before the later "
                         "buckets' overflow check is known. Build the optimizer with overlap='step' (or "
                         "'backward'), or use mixed_precision='bf16', which needs no scaler")


def _keep_unscaling_out(accelerator, opt: _ShardedOptimizer) -> None:
    """``scaler.unscale_(opt)`` unscales ``param.grad``, which the update mostly does not read (it divides
    its own reduced slices by the loss scale), and then tells the update the gradients are unscaled
    already. So Accelerate's unscaling of every optimizer (``clip_grad_norm_`` of other parameters does
    it too) skips this one, and a request naming this one is refused."""
    unscale = accelerator.unscale_gradients

    def unwrap(o):
        while isinstance(o, AcceleratedOptimizer):
            o = o.optimizer
        return o

    def unscale_gradients(optimizer=None):
        if optimizer is None:
            named, optimizers = False, list(accelerator._optimizers)
        else:
            named, optimizers = True, list(optimizer) if isinstance(optimizer, (tuple, list)) else [optimizer]
        if named and any(unwrap(o) is opt for o in optimizers):
            raise RuntimeError("accelerator.unscale_gradients() of a fused_zero optimizer: its update divides the "
                               "reduced gradients by the loss scale itself, and param.grad keeps the scaled "
                               "values. Clip with accelerator.clip_grad_norm_(model.parameters(), ...) "
                               "(overlap='step'), which needs no unscaling")
        others = [o for o in optimizers if unwrap(o) is not opt]
        if others:
            unscale(others)

    accelerator.unscale_gradients = unscale_gradients


class _ShardedAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper, for a fused_zero optimizer stepped through a GradScaler.

    Accelerate learns that ``scaler.step()`` skipped an overflow step from the wrapped ``step()`` not
    being called; a fused_zero optimizer (like torch's fused ones) is always called and skips the update
    itself. ``step_was_skipped`` reads the optimizer's own flag instead, when asked: no host sync on the
    step path, one where Accelerate asks (its scheduler wrapper, every step; GradScaler's own step makes
    that sync for torch.optim optimizers)."""

    @property
    def step_was_skipped(self) -> bool:
        skipped = self._fused_zero_skipped
        return False if skipped is None else bool(skipped)


def _report_skipped_steps(accelerated: AcceleratedOptimizer, opt: _ShardedOptimizer) -> None:
    engine = opt._engine
    counts = [engine.skipped.clone()]  # the optimizer's skipped-step counter, as of the last step

    def after_step(*_):
        now = engine.skipped.clone()
        accelerated._fused_zero_skipped = now != counts[0]  # device tensors: read only when asked
        counts[0] = now

    accelerated._fused_zero_skipped = None
    accelerated.__class__ = _ShardedAcceleratedOptimizer
    opt.register_step_post_hook(after_step)


def _route_clipping(accelerator, opt: _ShardedOptimizer) -> None:
    """Accelerate clips ``param.grad`` between the backward and ``step()``, which fused_zero never reads
    there; so a clip of the optimizer's parameters sets the norm its next ``step()`` clips to."""
    engine = opt._engine
    ours = {id(p) for p in engine.params}
    base = engine.max_grad_norm
    clip_norm, clip_value = accelerator.clip_grad_norm_, accelerator.clip_grad_value_

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        params = list(parameters)
        if not any(id(p) in ours for p in params):
            return clip_norm(params, max_norm, norm_type)
        if engine.overlap != "step":
            raise RuntimeError(f"accelerator.clip_grad_norm_ with fused_zero needs overlap='step' (got "
                               f"overlap={engine.overlap!r}): the global gradient norm is known only once every "
                               "bucket is reduced, and the other modes update the parameters during the backward")
        if float(norm_type) != 2.0:
            raise ValueError(f"fused_zero clips by the 2-norm; got norm_type={norm_type}")
        if not ours <= {id(p) for p in params}:
            raise ValueError("fused_zero clips all of the optimizer's parameters together; pass them all "
                             "(model.parameters())")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        engine.max_grad_norm = float(max_norm)
        return None

    def clip_grad_value_(parameters, clip_value_):
        params = list(parameters)
        if any(id(p) in ours for p in params):
            raise RuntimeError("clip_grad_value_ is not supported with fused_zero: it sees the reduced gradients "
                               "only inside its update; clip by norm (accelerator.clip_grad_norm_, "
                               "overlap='step')")
        return clip_value(params, clip_value_)

    def reset(*_):  # a clip applies to the step it precedes, as torch's clip_grad_norm_ does
        engine.max_grad_norm = base

    accelerator.clip_grad_norm_ = clip_grad_norm_
    accelerator.clip_grad_value_ = clip_grad_value_
    opt.register_step_post_hook(reset)


def _unshare_saved_weights(accelerator, ddp) -> None:
    """fused_zero's parameters are views into one flat buffer per bucket. safetensors, which
    ``save_state`` uses by default, takes tensors sharing a storage for tied weights: it would save one
    of them and drop the rest, and refuses to load into such a model. So the saved weights become
    host copies, and a load reads the module's state dict as copies too (only while it loads)."""

    def before_save(models, weights, output_dir):
        for model, state in zip(models, weights):
            if model is ddp or model is ddp.module:
                for key, value in state.items():
                    state[key] = value.detach().to("cpu", copy=True)

    def before_load(models, input_dir):
        if any(m is ddp or m is ddp.module for m in models):
            handles = [ddp.module.register_state_dict_post_hook(_copies)]

            def loaded(module, incompatible_keys):
                for handle in handles:
                    handle.remove()

            handles.append(ddp.module.register_load_state_dict_post_hook(loaded))

    accelerator.register_save_state_pre_hook(before_save)
    accelerator.register_load_state_pre_hook(before_load)


def _copies(module, state_dict, prefix, local_metadata):
    for key, value in state_dict.items():
        state_dict[key] = value.detach().clone()
