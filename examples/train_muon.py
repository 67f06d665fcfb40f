"""Muon for the hidden matrices beside AdamW for the rest, two fused_zero optimizers over one DDP module,
each with its own schedule. Run it with

    torchrun --nproc_per_node 2 examples/train_muon.py         # CPU ranks on gloo, or one per GPU on NCCL
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.demo.model import GPT, CharTokenizer, GPTConfig, batches, load_corpus

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)

text = load_corpus()
tok = CharTokenizer(text)
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=2, n_head=4, n_embd=64)).to(device)
ddp = DDP(model, gradient_as_bucket_view=True)

# Muon: the blocks' weight matrices; AdamW: embeddings (tied with the head), norms, biases
hidden = [p for name, p in model.named_parameters() if p.ndim == 2 and name.startswith("blocks.")]
chosen = {id(p) for p in hidden}
rest = [p for p in model.parameters() if id(p) not in chosen]
muon = fused_zero.Muon(hidden, ddp=ddp, lr=0.02, weight_decay=0.01)
adamw = fused_zero.AdamW(rest, ddp=ddp, lr=3e-3, weight_decay=0.0)
steps = 100
schedules = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps) for o in (muon, adamw)]

stream = batches(tok.encode(text), batch_size=16, block_size=64, rank=rank, world_size=world, seed=0)
for step in range(1, steps + 1):
    x, y = (t.to(device) for t in next(stream))
    _, loss = ddp(x, y)
    loss.backward()      # each bucket reduced; Muon's matrices orthogonalized on their owners
    muon.step()
    adamw.step()         # the last step() ends the iteration
    muon.zero_grad()
    adamw.zero_grad()
    for s in schedules:
        s.step()
    if rank == 0 and step % 20 == 0:
        print(f"step {step}: loss {loss.item():.3f}")

state = muon.state_dict()   # torch.optim.Muon's format: loads into torch.optim.Muon too
if rank == 0:
    print(f"Muon state: {len(state['state'])} matrices' momentum_buffer; "
          f"optimizer bytes on this rank: {muon.memory()['state'] + adamw.memory()['state']:,}")
dist.barrier()
dist.destroy_process_group()
