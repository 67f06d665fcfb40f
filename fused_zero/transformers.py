"""Hugging Face transformers' ``Trainer``: give it a fused_zero optimizer its usual ways, then one line.

    trainer = Trainer(model=model, args=args, train_dataset=train_dataset,
                      optimizer_cls_and_kwargs=(fused_zero.AdamW, {"lr": 3e-4, "overlap": "step",
                                                                    "grad_reduce": "all_reduce"}))
    fused_zero.transformers.attach(trainer)
    trainer.train()

(or ``optimizers=(fused_zero.AdamW(model.parameters(), ...), scheduler)``). The Trainer builds its DDP
module inside ``train()``, in ``accelerator.prepare(model, optimizer)``, and loads ``optimizer.pt``
right after, before any callback runs; ``attach(trainer)`` makes that ``prepare`` attach the optimizer
to the DDP module it has just built (``fused_zero.accelerate.attach``), so everything after it finds
an attached optimizer. Nothing of the Trainer is overridden. What the Trainer does then works as it
does with torch's AdamW:

- ``max_grad_norm`` (1.0 by default): the Trainer clips through ``accelerator.clip_grad_norm_``. With
  ``overlap="step", grad_reduce="all_reduce"`` that is torch's own clip of ``param.grad``, which
  ``step()`` reads: bit for bit the Trainer with ``optim="adamw_torch"``, ``grad_norm`` included. With
  ``overlap="step"`` alone (ZeRO-2 traffic) the clip is routed into the update and the Trainer logs the
  true pre-clip norm of the reduced gradients (equal to rounding: summed in another order);
  ``overlap="backward"`` clips inside the backward to ``args.max_grad_norm`` (passed on here). The
  default ``overlap="auto"`` resolves here, from the arguments: "backward" where they clip or scale
  (the Trainer's defaults), else "bucket"; an explicit "bucket" with a clip is refused, before training.
- ``save_steps`` / ``resume_from_checkpoint``: the Trainer saves ``optimizer.state_dict()`` from rank 0
  alone, while the other ranks go on (into the next step's token-count gather); the other ranks serve
  their shards from a thread (checkpoint/serving/peers.py). The resumed run continues bit for bit.
- ``fp16``: the Trainer's GradScaler (Accelerate's) is handed to the optimizer; overflow steps are
  skipped on every rank and the scheduler does not advance. ``bf16``, gradient accumulation and the
  learning-rate schedulers need nothing.

Needs the ``transformers`` extra: ``pip install "fused-zero[transformers]"``.
"""

from __future__ import annotations

from accelerate.optimizer import AcceleratedOptimizer
from torch.nn.parallel import DistributedDataParallel

from .accelerate import attach as attach_to_accelerator
from .optimizer import ShardedOptimizer
from .options import check_whole_step, resolve_overlap


def attach(trainer, **options) -> None:
    """Make ``trainer`` attach its fused_zero optimizer to the DDP module it builds in ``train()``.

    ``options``: sharding options not given to the optimizer (see ``fused_zero.AdamW``). What the
    Trainer's arguments need of them is checked here, before anything trains."""
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or not hasattr(trainer, "args"):
        kind = type(trainer)
        raise TypeError(f"attach needs a transformers.Trainer, got {kind.__module__}.{kind.__qualname__}")
    if getattr(accelerator.prepare, "_fused_zero_attaches", False):
        raise RuntimeError("fused_zero.transformers.attach(trainer) was already called for this Trainer")
    given = _optimizer_options(trainer)
    settled = given is not None  # else the optimizer built in train() tells, at prepare
    if settled:
        options = {**options, **_settings(trainer.args, {**given, **options})}
    prepare = accelerator.prepare

    def prepare_and_attach(*args, **kwargs):
        out = prepare(*args, **kwargs)
        items = out if isinstance(out, tuple) else (out,)
        for item in items:
            if isinstance(item, AcceleratedOptimizer):
                _attach_prepared(accelerator, trainer, item, items, options, settled)
        return out

    prepare_and_attach._fused_zero_attaches = True
    accelerator.prepare = prepare_and_attach


def _optimizer_options(trainer) -> dict | None:
    """The sharding options the Trainer's optimizer is (or will be) built with; None where only the
    optimizer built in ``train()`` can tell (a Trainer subclass's own ``create_optimizer``)."""
    if trainer.optimizer is not None:
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        if not isinstance(opt, ShardedOptimizer):
            raise TypeError(_not_ours(type(opt)))
        return opt.sharding_options
    if trainer.optimizer_cls_and_kwargs is not None:
        cls, kwargs = trainer.optimizer_cls_and_kwargs
        if not (isinstance(cls, type) and issubclass(cls, ShardedOptimizer)):
            raise TypeError(_not_ours(cls))
        return dict(kwargs)
    if type(trainer).create_optimizer is _trainer_create_optimizer(trainer):
        optim = getattr(trainer.args.optim, "value", trainer.args.optim)
        raise TypeError(f"the Trainer builds its optimizer from TrainingArguments(optim={optim!r}): "
                        "pass a fused_zero optimizer, optimizer_cls_and_kwargs=(fused_zero.AdamW, {...}) or "
                        "optimizers=(fused_zero.AdamW(model.parameters(), ...), None)")
    return None


def _trainer_create_optimizer(trainer):
    for cls in type(trainer).__mro__:
        if cls.__name__ == "Trainer" and cls.__module__.startswith("transformers"):
            return cls.create_optimizer
    return None


def _not_ours(kind) -> str:
    name = f"{kind.__module__}.{kind.__qualname__}" if isinstance(kind, type) else repr(kind)
    return (f"fused_zero.transformers.attach needs a fused_zero optimizer (fused_zero.AdamW, Adam or SGD) given "
            f"to the Trainer, got {name}")


def _settings(args, given: dict) -> dict:
    """What the Trainer's arguments need of the sharding options (returned: the ones to add), or why
    they cannot work. ``given``: the options the optimizer gets otherwise."""
    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        raise ValueError("fused_zero shards DDP's buckets; DeepSpeed and FSDP shard the optimizer themselves: "
                         "use one of them")
    overlap, own_norm = given.get("overlap", "auto"), given.get("max_grad_norm")
    clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
    fp16 = bool(getattr(args, "fp16", False))
    if clip is not None:
        check_whole_step(f"TrainingArguments(max_grad_norm={clip}) (a clip every step; 0 turns it off)", "clip",
                         overlap)
    if fp16:
        check_whole_step("TrainingArguments(fp16=True) (a GradScaler; bf16 needs none)", "scaler", overlap)
    if own_norm is not None and own_norm != clip:
        raise ValueError(f"the optimizer clips to max_grad_norm={own_norm} and TrainingArguments(max_grad_norm="
                         f"{args.max_grad_norm}) says otherwise: set it in TrainingArguments only")
    settings = {}
    if overlap == "auto":  # known here, from the arguments (Accelerate's attach would pick "step")
        overlap = settings["overlap"] = resolve_overlap("auto", clip, True if fp16 else None)
    if overlap == "backward" and clip is not None:
        settings["max_grad_norm"] = clip  # the update runs in the backward: it must know the norm by then
    return settings


def _attach_prepared(accelerator, trainer, prepared: AcceleratedOptimizer, items: tuple, options: dict,
                     settled: bool) -> None:
    opt = prepared.optimizer
    while isinstance(opt, AcceleratedOptimizer):
        opt = opt.optimizer
    if not isinstance(opt, ShardedOptimizer):
        raise TypeError(_not_ours(type(opt)))
    if opt.attached:  # a later train() call: prepared again, attached once
        return
    if not settled:  # built by the Trainer subclass's create_optimizer
        options = {**options, **_settings(trainer.args, {**opt.sharding_options, **options})}
    models = [m for m in items if isinstance(m, DistributedDataParallel)]
    models += [m for m in getattr(accelerator, "_models", []) if isinstance(m, DistributedDataParallel)]
    model = models[0] if models else next((m for m in items if not isinstance(m, AcceleratedOptimizer)), None)
    attach_to_accelerator(accelerator, model, prepared, **options)
