"""The whole DDP loop with fused_zero. Run it with

    torchrun --nproc_per_node 2 examples/train_ddp.py          # CPU ranks on gloo, or one per GPU on NCCL
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 257), torch.nn.GELU(), torch.nn.Linear(257, 10)).to(device)
ddp = DDP(model, gradient_as_bucket_view=True)
opt = fused_zero.AdamW(ddp.parameters(), ddp=ddp, lr=3e-3, weight_decay=0.1)   # registers the comm hook
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)

g = torch.Generator().manual_seed(rank)
for step in range(100):
    x = torch.randn(64, 32, generator=g).to(device)
    y = (x[:, :10].argmax(dim=1)).to(device)
    loss = F.cross_entropy(ddp(x), y)
    loss.backward()          # reduces each bucket, updates this rank's slice, starts the all-gathers
    opt.step()               # ends the iteration (overlap="step" runs the updates here)
    opt.zero_grad()
    sched.step()
    if rank == 0 and step % 20 == 0:
        print(f"step {step:3d}  loss {loss.item():.4f}")

opt.synchronize()            # parameters final before reading them outside a forward
if rank == 0:
    print("optimizer bytes on this rank:", opt.memory())
dist.barrier()               # with gloo, a rank tearing its group down while a peer still uses it aborts
dist.destroy_process_group()
