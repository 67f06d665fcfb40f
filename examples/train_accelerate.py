"""fused_zero with Hugging Face Accelerate: accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py
(on a machine without GPUs the 2 processes train on the CPU, with gloo)"""
import torch
import torch.nn.functional as F
from accelerate import Accelerator

import fused_zero
import fused_zero.accelerate

accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=2)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 257), torch.nn.GELU(), torch.nn.Linear(257, 10))
opt = fused_zero.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)   # no ddp= yet
x = torch.randn(1024, 32)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :10].argmax(dim=1)), batch_size=32)
model, opt, loader = accelerator.prepare(model, opt, loader)
fused_zero.accelerate.attach(accelerator, model, opt)      # model is the DDP module now: shard over it
for x, y in loader:
    with accelerator.accumulate(model):
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)   # applied inside opt.step()
        opt.step()
        opt.zero_grad()
accelerator.print(f"last loss {loss.item():.4f}")
accelerator.save_state("out/checkpoint")    # every rank, as Accelerate requires
