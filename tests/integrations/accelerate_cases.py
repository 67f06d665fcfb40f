"""Accelerate loops on every rank, launched as ``accelerate launch`` does: the rank's process group is
torn down and Accelerate builds its own from RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.

Each loop trains the same model with Accelerate + torch.optim.AdamW and with Accelerate + fused_zero,
with gradient accumulation and a scheduler, recording every parameter after every optimizer step.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from expect import refusal
from memory import peak_bytes, state_bytes, tensor_bytes
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fused_zero
import fused_zero.accelerate

ACCUMULATE, STEPS, BATCH = 2, 6, 4


def model_and_data(world, hidden=33):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 17), nn.Tanh(), nn.Linear(17, 5))
    g = torch.Generator().manual_seed(7)
    n = STEPS * ACCUMULATE * BATCH * world
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 5, (n,), generator=g))
    return model, DataLoader(data, batch_size=BATCH, shuffle=False)


def fp16_accelerator(**kwargs) -> Accelerator:
    """``Accelerator(mixed_precision="fp16")`` as it is on a GPU. On CPU Accelerate leaves fp16 off (no
    autocast, no GradScaler: ``Accelerator.__init__`` sets them only for other devices); these are the
    two attributes it sets there, with a CPU scaler. From ``prepare`` on, Accelerate's own fp16 code
    runs: the autocast forward, ``backward`` scaling the loss, the optimizer wrapper stepping through
    ``scaler.step``/``scaler.update`` and reporting ``step_was_skipped`` to the scheduler wrapper."""
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", **kwargs)
    accelerator.native_amp = True
    accelerator.scaler = scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    accelerator.unscale_calls = []  # scaler.unscale_ must never reach a fused_zero optimizer
    unscale = scaler.unscale_
    scaler.unscale_ = lambda opt: (accelerator.unscale_calls.append(type(opt).__module__), unscale(opt))[1]
    return accelerator


def train(world, fused: bool, *, clip=None, query=None, save_at=None, load=None, options=None, fp16=False,
          inject=None, extra=None):
    """Returns the parameters after every optimizer step (and what clip_grad_norm_ returned, read after
    the step). ``query``: a norm query (max_norm=inf) "before" or "after" the clip, whose result (or
    refusal) is recorded too. ``inject``: the batch at which the last rank's loss (so its gradient) turns
    infinite; ``extra`` gets the loss scale, ``optimizer_step_was_skipped``, the LR and the first layer's
    output dtype after every optimizer step."""
    make = fp16_accelerator if fp16 else lambda **kw: Accelerator(cpu=True, **kw)
    accelerator = make(gradient_accumulation_steps=ACCUMULATE)
    model, loader = model_and_data(world)
    linear_out = []  # the dtype the first layer computes in (fp16 under Accelerate's autocast)
    model[0].register_forward_hook(lambda module, args, output: linear_out.append(str(output.dtype)))
    if fused:
        opt = fused_zero.AdamW(model.parameters(), lr=0.02, weight_decay=0.1, **(options or {}))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)  # built before prepare, as users do
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    if fused:
        fused_zero.accelerate.attach(accelerator, model, opt)
    skip = 0
    if load is not None:
        accelerator.load_state(load)
        skip = save_at * ACCUMULATE
        loader = accelerator.skip_first_batches(loader, skip)
    record, returned = [], []
    for i, (x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            if i == inject and accelerator.process_index == world - 1:
                loss = loss * float("inf")
            accelerator.backward(loss)
            if clip is not None and accelerator.sync_gradients:
                calls = [clip] if query is None else [math.inf, clip] if query == "before" else [clip, math.inf]
                for max_norm in calls:
                    try:
                        returned.append(accelerator.clip_grad_norm_(model.parameters(), max_norm))
                    except RuntimeError as e:
                        returned.append(str(e))
            opt.step()
            sched.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            record.append([p.detach().clone() for p in model.parameters()])
            if extra is not None:
                extra.append((accelerator.scaler.get_scale(), accelerator.optimizer_step_was_skipped,
                              sched.get_last_lr()[0], linear_out[-1]))
            if save_at is not None and load is None and len(record) == save_at:
                accelerator.save_state("state")  # every rank calls it: the optimizer's state_dict() is a collective
    returned = [float(r) if isinstance(r, torch.Tensor) else r for r in returned]  # after the steps
    return record, returned, accelerator


def measured_save(accelerator, opt, path) -> dict:
    """``accelerator.save_state(path)`` and what it cost this rank: the peak of torch's allocations
    during it, the tensor bytes of the optimizer states Accelerate got to save (written on the main
    process, dropped elsewhere), and ``memory.state_bytes``."""
    import accelerate.checkpointing

    held, save = [], accelerate.checkpointing.save

    def recorded(obj, f, **kwargs):
        if os.path.basename(f).startswith("optimizer"):
            held.append(tensor_bytes(obj))
        return save(obj, f, **kwargs)

    accelerate.checkpointing.save = recorded
    try:
        peak = peak_bytes(lambda: accelerator.save_state(path))
    finally:
        accelerate.checkpointing.save = save
    assert held, "save_state saved no optimizer state"
    return {"peak": peak, "held": sum(held), **state_bytes(opt.optimizer)}


def differences(ours, ref, exact=True):
    assert len(ours) == len(ref) > 0, (len(ours), len(ref))
    out = []
    for step, (a, b) in enumerate(zip(ours, ref)):
        for i, (p, q) in enumerate(zip(a, b)):
            if not (torch.equal(p, q) if exact else torch.allclose(p, q, rtol=1e-5, atol=1e-6)):
                out.append(f"step {step} param {i}: max diff {float((p - q).abs().max()):.3g}")
    return out



def launched(rank: int, world: int, port: int, tmp: str) -> None:
    dist.destroy_process_group()  # the spawner's; Accelerate initializes its own from the launcher's env
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.chdir(tmp)


def checkpoint(rank: int, world: int, port: int, tmp: str) -> list[dict]:
    """One optimizer step, then save_state, by default and with ``save_on_each_node`` (this node's local
    main process writes, rank 0 here): what each cost each rank (``measured_save``)."""
    launched(rank, world, port, tmp)
    accelerator = Accelerator(cpu=True)
    model, loader = model_and_data(world, hidden=1024)  # shards far above Accelerate's own small tensors
    opt = fused_zero.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    fused_zero.accelerate.attach(accelerator, model, opt)
    x, y = next(iter(loader))
    accelerator.backward(F.cross_entropy(model(x), y))
    opt.step()
    saves = [measured_save(accelerator, opt, "state")]
    accelerator.project_configuration.save_on_each_node = True
    saves.append(measured_save(accelerator, opt, "state-each-node"))
    return saves


def run(rank: int, world: int, port: int, tmp: str) -> dict:
    launched(rank, world, port, tmp)
    out = {}
    ref, _, _ = train(world, fused=False)
    ours, _, acc = train(world, fused=True, options={"overlap": "bucket"})
    out["distributed"] = str(acc.distributed_type)
    out["plain"] = differences(ours, ref)

    ref, ref_returned, _ = train(world, fused=False, clip=0.05)
    ours, returned, _ = train(world, fused=True, clip=0.05)  # fused_zero's defaults: "auto" picks "step" here
    unclipped, _, _ = train(world, fused=True, options={"overlap": "step"})
    out["clip"] = differences(ours, ref, exact=False)  # the norm is summed in another order
    out["clip_moved"] = not torch.equal(ours[-1][0], unclipped[-1][0])
    # the true pre-clip norm, as torch returns it (to rounding: summed in another order)
    out["clip_returned"] = (len(returned) == STEPS and
                            all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(returned, ref_returned)), returned)
    # a norm query after the clip (the Trainer's _get_grad_norm) is refused, and the clip still applies;
    # one before it is honored as torch honors it (the same norm, then the clip)
    after, returned_after, _ = train(world, fused=True, clip=0.05, query="after", options={"overlap": "step"})
    before, returned_before, _ = train(world, fused=True, clip=0.05, query="before", options={"overlap": "step"})
    out["query_after"] = (differences(after, ours), sorted({type(r).__name__ for r in returned_after[1::2]}),
                          returned_after[1], returned_after[0::2] == returned)
    out["query_before"] = (differences(before, ours), returned_before == [r for r in returned for _ in range(2)])
    # where step() reads param.grad, Accelerate's own clip runs unchanged: bit for bit, queries too
    native = {"overlap": "step", "grad_reduce": "all_reduce"}
    ref, ref_returned, _ = train(world, fused=False, clip=0.05, query="after")
    ours, returned, _ = train(world, fused=True, clip=0.05, query="after", options=native)
    out["clip_native"] = (differences(ours, ref), returned == ref_returned)

    whole, _, _ = train(world, fused=True, save_at=3)
    resumed, _, _ = train(world, fused=True, save_at=3, load=os.path.join(tmp, "state"))
    out["resume"] = differences(resumed, whole[3:])

    def attached(options=None, fp16=False, torch_opt=False, unwrap=False):
        accelerator = fp16_accelerator() if fp16 else Accelerator(cpu=True)
        model, _ = model_and_data(world)
        opt = (torch.optim.AdamW if torch_opt else fused_zero.AdamW)(model.parameters(), **(options or {}))
        model, opt = accelerator.prepare(model, opt)
        fused_zero.accelerate.attach(accelerator, accelerator.unwrap_model(model) if unwrap else model, opt)
        return accelerator, model

    def clip_in_bucket_mode():
        accelerator, model = attached({"overlap": "bucket"})
        accelerator.clip_grad_norm_(model.parameters(), 1.0)

    def clip_by_value():
        accelerator, model = attached({"overlap": "step"})
        accelerator.clip_grad_value_(model.parameters(), 1.0)

    out["refusals"] = [
        refusal(clip_in_bucket_mode, RuntimeError, r"clip_grad_norm_ of a fused_zero optimizer's parameters needs "
                r"overlap='backward' or overlap='step' \(got overlap='bucket'\)"),
        refusal(clip_by_value, RuntimeError, "clip_grad_value_ is not supported"),
        refusal(lambda: attached(torch_opt=True), TypeError, "needs the fused_zero optimizer .*torch.optim"),
        refusal(lambda: attached(unwrap=True), TypeError,
                "ddp got a plain torch.nn.modules.container.Sequential while a process group of 2 ranks"),
        refusal(lambda: attached({"overlap": "step", "grad_scaler": torch.amp.GradScaler("cpu")}), ValueError,
                r"Accelerate steps it through no GradScaler \(mixed_precision='no'\)"),
    ]

    # fp16: Accelerate's GradScaler steps both; the last rank's loss is infinite at batch 5 (step 2)
    AcceleratorState._reset_state()  # mixed_precision is fixed per process; the process group stays
    out["fp16"], out["fp16_extra"], out["fp16_unscale_calls"] = {}, {}, {}
    for name, overlap, clip in (("backward", "backward", None), ("step-clip", "step", 0.05)):
        ref_extra, extra = [], []
        ref, _, _ = train(world, fused=False, clip=clip, fp16=True, inject=5, extra=ref_extra)
        ours, _, acc = train(world, fused=True, clip=clip, fp16=True, inject=5, extra=extra,
                             options={"overlap": overlap})
        out["fp16"][name] = differences(ours, ref, exact=clip is None)
        out["fp16_extra"][name] = (extra, ref_extra)
        out["fp16_unscale_calls"][name] = acc.unscale_calls
    def unscale(named):
        accelerator, _ = attached({"overlap": "step"}, fp16=True)
        accelerator.unscale_gradients(accelerator._optimizers[0] if named else None)
        return accelerator.unscale_calls

    out["fp16_unscale_all"] = unscale(named=False)  # Accelerate's unscaling of every optimizer skips ours
    out["fp16_refusals"] = [
        refusal(lambda: unscale(named=True), RuntimeError, r"unscale_gradients\(\) of a fused_zero optimizer"),
        refusal(lambda: attached({"overlap": "bucket"}, fp16=True), ValueError, r"mixed_precision='fp16' \(a "
                r"GradScaler.*\) needs overlap='backward' or overlap='step' \(got overlap='bucket'\)"),
        refusal(lambda: attached({"overlap": "step", "grad_scaler": torch.amp.GradScaler("cpu")}, fp16=True),
                ValueError, r"Accelerate steps it through its own GradScaler \(accelerator.scaler\)"),
    ]
    return out
