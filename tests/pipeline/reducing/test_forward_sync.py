"""param_sync="forward" with the all-gathers still pending when the next forward starts: each module's
forward pre-hook must wait for every bucket its forward reads, including parameters it reads without
calling their module (torch's nn.MultiheadAttention reads ``out_proj.weight``; nn.TransformerEncoderLayer
reads its children's weights on its fast path).

The gathers are held back (scenarios.held_gathers): their data lands only when the Work is waited
for, so a missing wait reads stale parameters and changes the loss, whatever the timing. Nothing calls
``synchronize()`` between steps; every step's loss is compared with DDP + torch.optim's, exactly
(fp32 on CPU is bit-identical), and every parameter at the end.
"""

import torch
import torch.nn.functional as F
from distributed import run_ranks
from scenarios import held_gathers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero

VOCAB, DIM, HEADS, SEQ = 17, 16, 2, 6


class PreLNBlock(nn.Module):
    """A pre-LayerNorm transformer block on torch's own attention."""

    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([PreLNBlock(), PreLNBlock()])
        self.torch_layer = nn.TransformerEncoderLayer(DIM, HEADS, 2 * DIM, dropout=0.0, batch_first=True,
                                                      norm_first=True)
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        mask = torch.triu(torch.full((SEQ, SEQ), float("-inf")), diagonal=1)
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x, mask)
        x = self.torch_layer(x, src_mask=mask, is_causal=True)
        return self.head(self.ln_f(x))


def train_without_synchronize(rank, world, overlap, steps):
    torch.manual_seed(0)
    model, ref_model = TinyTransformer(), TinyTransformer()
    ref_model.load_state_dict(model.state_dict())
    ddp = DDP(model, bucket_cap_mb=0.001, gradient_as_bucket_view=True)  # a bucket per one or two params
    ref_ddp = DDP(ref_model, bucket_cap_mb=0.001, gradient_as_bucket_view=True)
    opt = fused_zero.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1, ddp=ddp, overlap=overlap,
                           param_sync="forward")
    ref_opt = torch.optim.AdamW(ref_ddp.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(rank)
    mismatches = []
    with held_gathers():
        for step in range(1, steps + 1):
            x, y = (torch.randint(0, VOCAB, (4, SEQ), generator=g) for _ in range(2))
            losses = []
            for d, o in ((ref_ddp, ref_opt), (ddp, opt)):
                loss = F.cross_entropy(d(x).reshape(-1, VOCAB), y.reshape(-1))
                loss.backward()
                o.step()
                o.zero_grad()
                losses.append(float(loss.detach()))
            if losses[0] != losses[1]:
                mismatches.append((step, *losses))
        pending = sum(s.gather.pending is not None for s in opt._engine.shards())
        opt.synchronize()
    worst = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref_model.parameters()))
    return {"mismatches": mismatches, "worst": worst, "pending_before_sync": pending,
            "buckets": len(opt._engine.shards())}


def train_each(rank, world, overlaps, steps):
    return [train_without_synchronize(rank, world, overlap, steps) for overlap in overlaps]


def test_torch_attention_waits_for_what_it_reads_with_gathers_pending():
    overlaps = ("step", "bucket")
    for results in run_ranks(train_each, 2, overlaps, 15):
        for overlap, r in zip(overlaps, results):
            assert r["pending_before_sync"] > 0, "no gather was pending: the test would not see a missing wait"
            assert r["mismatches"] == [], f"{overlap}: the forward read stale parameters: {r['mismatches'][:3]}"
            assert r["worst"] == 0.0
