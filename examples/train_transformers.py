"""fused_zero with the Hugging Face Trainer: torchrun --nproc_per_node 2 examples/train_transformers.py
(CPU processes on gloo where there is no GPU, one GPU per process with NCCL where there are). A tiny GPT-2
built from its config (nothing downloaded), 20 steps, a checkpoint every 10 under out/trainer_out; run it again
to resume."""
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import fused_zero
import fused_zero.transformers

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                   bos_token_id=0, eos_token_id=0))
tokens = torch.randint(0, 64, (320, 32), generator=torch.Generator().manual_seed(0))
train_dataset = [{"input_ids": t, "labels": t} for t in tokens]
args = TrainingArguments(output_dir="out/trainer_out", max_steps=20, per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, learning_rate=3e-3, warmup_steps=2, max_grad_norm=1.0,
                         logging_steps=5, save_steps=10, report_to=[], use_cpu=not torch.cuda.is_available())
trainer = Trainer(model=model, args=args, train_dataset=train_dataset,
                  optimizer_cls_and_kwargs=(fused_zero.AdamW, {"lr": 3e-3}))  # max_grad_norm: overlap "backward"
fused_zero.transformers.attach(trainer)  # the one line: attaches when the Trainer builds its DDP module
last = os.path.join("out", "trainer_out", "checkpoint-20")
trainer.train(resume_from_checkpoint="out/trainer_out/checkpoint-10" if os.path.isdir(last) else None)
if trainer.is_world_process_zero():
    print(f"last loss {trainer.state.log_history[-2]['loss']:.4f}")
