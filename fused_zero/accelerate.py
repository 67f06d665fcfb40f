"""Hugging Face Accelerate: build the fused_zero optimizer as any other, prepare, then attach it.

    optimizer = fused_zero.AdamW(model.parameters(), lr=3e-4)          # no ddp= yet
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    fused_zero.accelerate.attach(accelerator, model, optimizer)        # model is now the DDP module

Accelerate builds the DDP module inside ``prepare`` (as it builds DeepSpeed's engine or FSDP there), so
the attachment comes right after it. Then the usual loop works: ``accelerator.backward``,
``accelerator.accumulate`` (DDP's ``no_sync``; the wrapped optimizer skips non-sync steps),
``accelerator.save_state`` / ``load_state`` (the state gathered only to the rank that writes
``optimizer.bin``: ``_save_from_the_writing_ranks``), ``accelerate launch``.

Clipping, which Accelerate does to ``param.grad`` between the backward and ``step()``, is never lost:

- with ``overlap="step", grad_reduce="all_reduce"`` ``step()`` reads ``param.grad``, so Accelerate's own
  ``clip_grad_norm_`` / ``clip_grad_value_`` (and its ``unscale_gradients``) run unchanged, exactly as
  with torch.optim;
- in the other modes ``accelerator.clip_grad_norm_`` of the model's parameters is routed to the optimizer
  (``ClipRoute``): the clip happens inside the update, and the call returns a tensor that holds the
  true pre-clip norm once ``step()`` has run. Norm queries (``max_norm=inf``) are answered the same way;
  a second clip in one step, ``clip_grad_value_``, clipping with ``overlap="bucket"``, and in
  ``overlap="backward"`` a ``max_norm`` other than the optimizer's ``max_grad_norm``, are refused.

The default ``overlap="auto"`` resolves to "step" here (to "backward" where the optimizer has its own
``max_grad_norm``), so that a clip after the backward is applied; ``overlap="bucket"`` stays one
argument away for loops that do not clip.

``mixed_precision="fp16"``: Accelerate's GradScaler (the one its optimizer wrapper steps through) is
handed to the optimizer at attachment (``grad_scaler=``), which ``overlap="bucket"`` refuses. The
wrapper then steps as it does for torch's fused optimizers (``scaler.step(optimizer)``,
``scaler.update()``), and its ``step_was_skipped`` (which Accelerate's scheduler wrapper reads so as not
to advance on an overflow) reports the optimizer's own found-inf flag. Where clipping is routed,
``accelerator.unscale_gradients()`` (``scaler.unscale_`` of every optimizer, which Accelerate's own
``clip_grad_norm_`` also calls) leaves this optimizer out: its update unscales the reduced gradients
itself; naming it explicitly is refused.

Needs the ``accelerate`` extra: ``pip install "fused-zero[accelerate]"``.
"""

from __future__ import annotations

import math

import torch
from accelerate.optimizer import AcceleratedOptimizer

from .optimizer import ShardedOptimizer
from .options import check_whole_step


def attach(accelerator, model, optimizer, **options) -> None:
    """Attach ``optimizer`` (what ``accelerator.prepare`` returned for a fused_zero optimizer) to
    ``model`` (what it returned for the model: a DistributedDataParallel module) and route
    ``accelerator.clip_grad_norm_`` of its parameters to the optimizer. ``options``: sharding options
    not given at construction (see ``fused_zero.AdamW``)."""
    opt = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
    if not isinstance(opt, ShardedOptimizer):
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
    options = {**options, **_default_overlap({**opt.sharding_options, **options})}
    opt.attach(model, **options)  # a TypeError naming what prepare returned unless it is a DDP module
    if not opt.reads_grad_at_step:  # else Accelerate's own clipping and unscaling edit what step() reads
        _route_clipping(accelerator, opt)
        if scaler is not None:
            _keep_unscaling_out(accelerator, opt)
    if scaler is not None and isinstance(optimizer, AcceleratedOptimizer):
        _report_skipped_steps(optimizer, opt)
    _unshare_saved_weights(accelerator, model)
    _save_from_the_writing_ranks(accelerator, opt)


def _default_overlap(merged: dict) -> dict:
    """``overlap="auto"`` here: Accelerate's loops clip with ``accelerator.clip_grad_norm_`` between
    the backward and ``step()``, at a value the optimizer learns only then, so the update runs in
    ``step()`` ("step") unless the optimizer's own ``max_grad_norm`` is known now ("backward", whose
    update clips to it inside the backward: the clip call must ask for that value)."""
    if merged.get("overlap", "auto") != "auto":
        return {}
    return {"overlap": "backward" if merged.get("max_grad_norm") is not None else "step"}


def _save_from_the_writing_ranks(accelerator, opt: ShardedOptimizer) -> None:
    """``save_state`` runs on every rank and asks every rank for ``optimizer.state_dict()``, but
    ``optimizer.bin`` is written from the main process alone (from each node's local main process with
    ``ProjectConfiguration(save_on_each_node=True)``: ``accelerate.utils.save``), and the other ranks'
    dicts are dropped. So within ``save_state`` the state is gathered to the writing ranks alone:
    ``state_dict(to=0)`` (one whole dict, W - 1 transfers), or on each node's local main process
    (``to=None``) with ``save_on_each_node``; the other ranks' optimizer state is ``{}``. ``load_state``
    reads the written file on every rank, as before.

    Each writing rank is served by the others' threads (checkpoint/serving/peers.py): no rank may leave, and
    perhaps exit, while a writer still needs its shards. So ``save_state`` ends with
    ``wait_for_everyone()``."""
    save, whole = accelerator.save_state, opt.state_dict

    def saved_state() -> dict:
        if accelerator.project_configuration.save_on_each_node:
            return whole() if _writes_here(accelerator) else {}
        return opt.state_dict_written_by(0)  # the main process: global rank 0

    def save_state(*args, **kwargs):
        opt.state_dict = saved_state  # what AcceleratedOptimizer.state_dict() returns, within save_state only
        try:
            out = save(*args, **kwargs)
        finally:
            del opt.state_dict
        accelerator.wait_for_everyone()
        return out

    accelerator.save_state = save_state


def _writes_here(accelerator) -> bool:
    """Whether this rank writes ``save_state``'s files (``accelerate.utils.save``): the main process, or
    with ``save_on_each_node`` each node's local main process."""
    if accelerator.project_configuration.save_on_each_node:
        return accelerator.is_local_main_process
    return accelerator.is_main_process


def _check_loss_scaling(accelerator, opt: ShardedOptimizer, scaler, options: dict) -> None:
    """Accelerate's GradScaler must be the optimizer's (it scales the loss of every backward, which the
    optimizer's update divides by), in a mode that can take one."""
    own = opt.sharding_options.get("grad_scaler") or options.get("grad_scaler")
    if own is not None and own is not scaler:
        raise ValueError("the optimizer was given grad_scaler=..., but Accelerate steps it through "
                         + ("its own GradScaler (accelerator.scaler)" if scaler is not None else
                            f"no GradScaler (mixed_precision={accelerator.mixed_precision!r})")
                         + ": leave grad_scaler out, attach hands Accelerate's scaler over")
    if scaler is None:
        return
    check_whole_step("mixed_precision='fp16' (a GradScaler; mixed_precision='bf16' needs none)", "scaler",
                     options.get("overlap", opt.sharding_options.get("overlap", "auto")))


def _keep_unscaling_out(accelerator, opt: ShardedOptimizer) -> None:
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


def _report_skipped_steps(accelerated: AcceleratedOptimizer, opt: ShardedOptimizer) -> None:
    counts = [opt.skipped_steps_on_device()]  # the optimizer's skipped-step counter, as of the last step

    def after_step(*_):
        now = opt.skipped_steps_on_device()
        accelerated._fused_zero_skipped = now != counts[0]  # device tensors: read only when asked
        counts[0] = now

    accelerated._fused_zero_skipped = None
    accelerated.__class__ = _ShardedAcceleratedOptimizer
    opt.register_step_post_hook(after_step)


def _route_clipping(accelerator, opt: ShardedOptimizer) -> None:
    """Accelerate clips ``param.grad`` between the backward and ``step()``, which this optimizer's update
    does not read (its mode reads its own reduced slices, or ran in the backward): so a clip of the
    optimizer's parameters becomes its next ``step()``'s ``max_grad_norm`` (see ``ClipRoute``)."""
    ours = {id(p) for p in opt.reduced_parameters()}
    route = ClipRoute(opt)
    clip_norm, clip_value = accelerator.clip_grad_norm_, accelerator.clip_grad_value_

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        params = list(parameters)
        if not any(id(p) in ours for p in params):
            return clip_norm(params, max_norm, norm_type)
        if not ours <= {id(p) for p in params}:
            raise ValueError("fused_zero clips all of the optimizer's parameters together; pass them all "
                             "(model.parameters())")
        return route(max_norm, norm_type)

    def clip_grad_value_(parameters, clip_value_):
        params = list(parameters)
        if any(id(p) in ours for p in params):
            raise RuntimeError("clip_grad_value_ is not supported with fused_zero: it sees the reduced gradients "
                               "only inside its update; clip by norm (accelerator.clip_grad_norm_, "
                               "overlap='step'), or build the optimizer with overlap='step', "
                               "grad_reduce='all_reduce', whose step() reads param.grad")
        return clip_value(params, clip_value_)

    accelerator.clip_grad_norm_ = clip_grad_norm_
    accelerator.clip_grad_value_ = clip_grad_value_
    opt.register_step_post_hook(route.step_ended)


class ClipRoute:
    """``clip_grad_norm_`` of all of a fused_zero optimizer's parameters, in a mode whose update does not
    read ``param.grad``: applied inside the update, exactly as torch applies it, or refused.

    Per step: any number of norm queries (``max_norm=inf``, which torch answers without changing the
    gradients) and at most one clip. A clip in ``overlap="step"`` sets that step's ``max_grad_norm``;
    in ``overlap="backward"`` the update ran in the backward, so only the optimizer's own
    ``max_grad_norm`` can be asked for. Every call returns the same 0-dim tensor, which holds the true
    pre-clip norm of the reduced gradients (what torch returns) once ``step()`` has run (NaN until
    then: the norm is computed inside the update); frameworks that log it (the Trainer, Accelerate
    loops) read it after the step. A call after the clip is refused: torch would return the norm of
    the clipped gradients, or clip twice, and neither exists before the single update.
    """

    def __init__(self, opt: ShardedOptimizer):
        self.opt = opt
        self.device = opt.reduced_parameters()[0].device  # the updates' (and their norm's)
        self.base = opt.max_grad_norm  # the optimizer's own, restored after each step
        self.norm: torch.Tensor | None = None  # what this step's calls return
        self.clipped: float | None = None  # this step's clip

    def __call__(self, max_norm, norm_type=2) -> torch.Tensor:
        opt = self.opt
        check_whole_step("clip_grad_norm_ of a fused_zero optimizer's parameters", "clip", opt.overlap, RuntimeError)
        if float(norm_type) != 2.0:
            raise ValueError(f"fused_zero clips by the 2-norm; got norm_type={norm_type}")
        max_norm = float(max_norm)
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        if self.clipped is not None:
            raise RuntimeError(
                f"clip_grad_norm_(max_norm={max_norm}) after this step's clip to {self.clipped}: fused_zero "
                "clips once, inside optimizer.step(), so it cannot clip again nor give the norm of the clipped "
                "gradients (what torch returns now). The first call's result holds the pre-clip norm once "
                "step() has run: read that one")
        if max_norm != math.inf:
            if opt.overlap == "backward" and max_norm != self.base:
                raise RuntimeError(
                    f"clip_grad_norm_(max_norm={max_norm}) with overlap='backward': the update ran inside the "
                    f"backward, clipped to the optimizer's max_grad_norm={self.base}; build the optimizer with "
                    f"max_grad_norm={max_norm} (or use overlap='step')")
            opt.max_grad_norm = self.clipped = max_norm
        if self.norm is None:
            self.norm = torch.full((), math.nan, dtype=torch.float32, device=self.device)
        return self.norm

    def step_ended(self, *_) -> None:
        """Step post-hook: the returned norm gets its value; the next step clips as configured."""
        norm = self.opt.grad_norm() if self.norm is not None else None  # read on this stream
        if norm is not None:
            self.norm.copy_(norm)
        self.opt.max_grad_norm, self.norm, self.clipped = self.base, None, None


def _unshare_saved_weights(accelerator, ddp) -> None:
    """fused_zero's parameters are views into one flat buffer per bucket. safetensors, which
    ``save_state`` uses by default, takes tensors sharing a storage for tied weights: it would save one
    of them and drop the rest, and refuses to load into such a model. So the saved weights become
    host copies on the ranks that write them (``_writes_here``; the other ranks' weights are dropped
    unwritten), and a load reads the module's state dict as copies too (only while it loads)."""

    def before_save(models, weights, output_dir):
        if not _writes_here(accelerator):
            return
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
