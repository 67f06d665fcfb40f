"""Hugging Face Trainer runs on every rank, launched as torchrun does: the spawner's process group is torn
down and the Trainer (Accelerate) builds its own from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.

Each run trains a tiny GPT-2 built from a config (nothing downloaded), with gradient accumulation, a
linear schedule with warmup and clipping on (``max_grad_norm=1.0``), and records the parameters after
every optimizer step and the Trainer's log (loss, grad_norm, learning_rate). The reference is the same
Trainer with ``optim="adamw_torch"`` (torch.optim.AdamW, single-tensor on CPU).
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState
from expect import refusal
from torch.utils.data import Dataset

os.environ["HF_HUB_OFFLINE"] = "1"
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import fused_zero
import fused_zero.transformers

VOCAB, LENGTH, STEPS = 61, 16, 20
LR, WARMUP, CLIP = 5e-3, 3, 0.3
NATIVE = {"lr": LR, "overlap": "step", "grad_reduce": "all_reduce"}  # step() reads the Trainer's own clip


class Tokens(Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Injected(GPT2LMHeadModel):
    """GPT-2 whose loss turns infinite on the last rank at one forward (``inject``, counted from 1)."""

    inject: int | None = None

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == self.inject and dist.get_rank() == dist.get_world_size() - 1:
            out.loss = out.loss * float("inf")
        return out


class Record(TrainerCallback):
    """The parameters and the loss scale after every optimizer step; what trains (the optimizer that
    steps, attached or not, and the dtype the first attention projection computes in)."""

    def __init__(self, trainer):
        self.trainer, self.params, self.scales, self.dtypes = trainer, [], [], set()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.transformer.h[0].attn.c_attn.register_forward_hook(lambda m, a, out: self.dtypes.add(str(out.dtype)))

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.params.append([p.detach().float().clone() for p in model.parameters()])
        scaler = self.trainer.accelerator.scaler
        self.scales.append(None if scaler is None else scaler.get_scale())
        inner = optimizer.optimizer
        self.stepping = (type(inner).__module__, getattr(inner, "attached", None))


def model(inject=None) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=24, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    m = Injected(config)
    m.inject = inject
    return m


def run_trainer(out_dir, *, optim_cls=None, optimizers=None, attach=True, steps=STEPS, resume=None, fp16=False,
                bf16=False, inject=None, attach_options=None, **args_kw):
    """One Trainer run; returns (parameters after every step, loss scales, the log, the trainer); the
    trainer's ``record`` holds what trained."""
    args = TrainingArguments(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=LR, lr_scheduler_type="linear",
                             warmup_steps=WARMUP, max_grad_norm=CLIP, logging_steps=1, save_strategy="steps",
                             save_steps=10, report_to=[], disable_tqdm=True, use_cpu=True, seed=0,
                             ddp_backend="gloo", optim="adamw_torch", fp16=fp16, bf16=bf16,
                             remove_unused_columns=False, **args_kw)
    m = model(inject)
    if callable(optimizers):
        optimizers = optimizers(m)
    trainer = Trainer(model=m, args=args, train_dataset=Tokens(steps * 2 * 2 * dist_world()),
                      optimizer_cls_and_kwargs=optim_cls, **({"optimizers": optimizers} if optimizers else {}))
    if fp16:  # Accelerate leaves fp16 off on CPUs: the two attributes it sets on a GPU, with a CPU scaler
        trainer.accelerator.native_amp = True
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    record = Record(trainer)
    trainer.add_callback(record)
    if attach:
        fused_zero.transformers.attach(trainer, **(attach_options or {}))
    trainer.train(resume_from_checkpoint=resume)
    trainer.record = record
    return record.params, record.scales, [h for h in trainer.state.log_history if "loss" in h], trainer


def dist_world() -> int:
    return int(os.environ["WORLD_SIZE"])


def differences(ours, ref, exact=True):
    assert len(ours) == len(ref) > 0, (len(ours), len(ref))
    out = []
    for step, (a, b) in enumerate(zip(ours, ref)):
        for i, (p, q) in enumerate(zip(a, b)):
            if not (torch.equal(p, q) if exact else torch.allclose(p, q, rtol=1e-4, atol=1e-5)):
                out.append(f"step {step + 1} param {i}: max diff {float((p - q).abs().max()):.3g}")
    return out


def logs_equal(ours, ref, keys=("loss", "grad_norm", "learning_rate"), rel=0.0):
    if len(ours) != len(ref):
        return [f"{len(ours)} logs vs {len(ref)}"]
    return [f"step {a['step']} {k}: {a[k]} vs {b[k]}" for a, b in zip(ours, ref) for k in keys
            if not (a[k] == b[k] if rel == 0 else math.isclose(a[k], b[k], rel_tol=rel))]


def saved_optimizers_equal(ours_dir, ref_dir) -> list[str]:
    ours = torch.load(os.path.join(ours_dir, "optimizer.pt"), weights_only=True)
    ref = torch.load(os.path.join(ref_dir, "optimizer.pt"), weights_only=True)
    out = [] if ours["state"].keys() == ref["state"].keys() else ["different parameters"]
    for k, st in ref["state"].items():
        out += [f"state {k} {name}" for name, v in st.items() if not torch.equal(ours["state"][k][name], v)]
    return out


def run(rank: int, world: int, port: int, tmp: str) -> dict:
    dist.destroy_process_group()  # the spawner's; the Trainer initializes its own from the launcher's env
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    transformers.logging.set_verbosity_error()
    out = {}
    at = lambda name: os.path.join(tmp, name)  # noqa: E731

    ref, _, ref_log, _ = run_trainer(at("ref"), attach=False)
    ours, _, log, trainer = run_trainer(at("ours"), optim_cls=(fused_zero.AdamW, NATIVE))
    out["distributed"] = str(trainer.accelerator.distributed_type)
    out["stepping"] = trainer.record.stepping
    out["parity"] = differences(ours, ref)
    out["log"] = logs_equal(log, ref_log)
    out["clipped"] = [round(h["grad_norm"], 3) for h in ref_log]  # clipping mattered on these steps
    out["saved"] = saved_optimizers_equal(at("ours/checkpoint-10"), at("ref/checkpoint-10")) if rank == 0 else []

    resumed, _, resumed_log, _ = run_trainer(at("ours"), optim_cls=(fused_zero.AdamW, NATIVE),
                                             resume=at("ours/checkpoint-10"))
    out["resume"] = differences(resumed, ours[10:])
    out["resume_log"] = logs_equal(resumed_log[10:], log[10:])  # the log resumes from the checkpoint's

    def built(m):  # the optimizers=(opt, sched) route, ZeRO-2 traffic, the clip routed into the update
        opt = fused_zero.AdamW(m.parameters(), lr=LR, weight_decay=0.0, overlap="step")
        return opt, transformers.get_linear_schedule_with_warmup(opt, WARMUP, STEPS)

    zero2, _, zero2_log, trainer = run_trainer(at("zero2"), optimizers=built)
    inner = trainer.optimizer.optimizer
    out["zero2_mode"] = (inner._engine.grad_reduce, inner.reads_grad_at_step)
    out["zero2"] = differences(zero2, ref, exact=False)  # the norm is summed in another order
    out["zero2_log"] = logs_equal(zero2_log, ref_log, rel=1e-5)

    # fused_zero's defaults with the Trainer's clip: "auto" resolves to "backward", and the update runs in
    # the last bucket's hook, clipped there to the max_grad_norm that attach passes on from
    # TrainingArguments (the norm summed in another order: to rounding)
    defaults, _, defaults_log, trainer = run_trainer(at("defaults"), optim_cls=(fused_zero.AdamW, {"lr": LR}))
    out["defaults_mode"] = trainer.optimizer.optimizer._engine.overlap
    out["defaults_clip"] = trainer.optimizer.optimizer._engine.max_grad_norm
    out["defaults"] = differences(defaults, ref, exact=False)
    out["defaults_log"] = logs_equal(defaults_log, ref_log, rel=1e-5)

    bf16_ref, _, _, _ = run_trainer(at("bf16_ref"), attach=False, steps=4, bf16=True)
    AcceleratorState._reset_state()  # the mixed precision is fixed per process
    bf16, _, _, _ = run_trainer(at("bf16"), optim_cls=(fused_zero.AdamW, NATIVE), steps=4, bf16=True)
    out["bf16"] = differences(bf16, bf16_ref)

    # fp16 with the Trainer's scaler; the last rank's loss is infinite at forward 5 (optimizer step 3)
    AcceleratorState._reset_state()
    fp16_ref, ref_scales, ref_log, _ = run_trainer(at("fp16_ref"), attach=False, steps=6, fp16=True, inject=5)
    AcceleratorState._reset_state()
    fp16, scales, fp16_log, trainer = run_trainer(at("fp16"), optim_cls=(fused_zero.AdamW, NATIVE), steps=6,
                                                  fp16=True, inject=5)
    out["fp16_dtypes"] = sorted(trainer.record.dtypes)
    out["fp16"] = differences(fp16, fp16_ref)
    out["fp16_scales"] = (scales, ref_scales)
    out["fp16_skipped"] = torch.equal(fp16[2][0], fp16[1][0]) and not torch.equal(fp16[3][0], fp16[2][0])
    out["fp16_lr"] = logs_equal(fp16_log, ref_log, keys=("learning_rate",))

    def refused(optim_cls, **kw):
        return lambda: run_trainer(at("refused"), optim_cls=optim_cls, steps=1, **kw)

    out["refusals"] = [
        refusal(refused((fused_zero.AdamW, {"lr": LR, "overlap": "bucket"})), ValueError,
                r"TrainingArguments\(max_grad_norm=0.3\) \(a clip every step.*\) needs overlap='backward' or "
                r"overlap='step' \(got overlap='bucket'\)"),
        refusal(refused(None), TypeError, r"builds its optimizer from TrainingArguments\(optim='adamw_torch'\)"),
        refusal(refused((torch.optim.AdamW, {"lr": LR})), TypeError, "needs a fused_zero optimizer .*torch.optim"),
        refusal(refused((fused_zero.AdamW, {**NATIVE, "max_grad_norm": 0.5})), ValueError,
                r"clips to max_grad_norm=0.5 and TrainingArguments\(max_grad_norm=0.3\)"),
    ]
    return out
