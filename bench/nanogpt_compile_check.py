"""nanoGPT's order with torch.compile's default backend (inductor): the demo GPT -> torch.compile -> DDP,
fused_zero.AdamW against torch.optim.AdamW on the same compiled model, 2 gloo ranks, 4 steps, in the
bucket and step overlaps: prints per step the loss and whether losses and parameters are bit for bit.

    python bench/nanogpt_compile_check.py       # about a minute on 2 cores (inductor's C++ compile)

tests/pipeline/test_compile.py covers compile in the suite with the aot_eager backend (inductor's C++
code generation would cost tens of seconds per graph there); this runs the default backend, as
nanoGPT's ``compile=True`` does, once per torch release (docs/install.md)."""
import os
import time

os.environ["TRITON_INTERPRET"] = "1"
from fused_zero.demo.spawn import run_ranks


def body(rank, world, overlap):
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero
    from fused_zero.demo.model import GPT, GPTConfig
    torch._dynamo.reset()
    cfg = GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)
    m = GPT(cfg)
    torch.manual_seed(0)
    r = GPT(cfg)
    d, rd = DDP(torch.compile(m)), DDP(torch.compile(r))
    opt = fused_zero.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, ddp=d, overlap=overlap)
    ro = torch.optim.AdamW(r.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    t0 = time.time()
    out = []
    for step in range(4):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randint(0, 65, (4, 32), generator=g)
        y = torch.randint(0, 65, (4, 32), generator=g)
        losses = []
        for dd, o in ((rd, ro), (d, opt)):
            logits = dd(x)
            logits = logits[0] if isinstance(logits, tuple) else logits
            loss = F.cross_entropy(logits.reshape(-1, 65), y.reshape(-1))
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.detach())
        opt.synchronize()
        same = torch.equal(losses[0], losses[1]) and all(
            torch.equal(p, q) for p, q in zip(m.parameters(), r.parameters()))
        out.append((step, float(losses[1]), same))
    return torch.__version__, overlap, f"{time.time()-t0:.0f}s", out

if __name__ == "__main__":
    for overlap in ("bucket", "step"):
        print(run_ranks(body, 2, overlap, backend="gloo", timeout=900)[0], flush=True)
