"""What fused_zero holds, launches and sends per rank and step at 8 to 8192 ranks, computed from the layout
code itself (fused_zero.pipeline.buckets.layout.BucketLayout) and DDP's own bucketing, for real model shapes built
on the meta device (no memory, no GPU):

    python bench/scale_model.py                 # the markdown tables of docs/performance-scale.md
    python bench/scale_model.py --json out.json # the same numbers, every field

Models (bf16 parameters, fp32 master weights and AdamW moments, DDP's default 25 MiB buckets):
GPT-2 small (124M, tied embedding), a Llama-style 7B (Llama-2 7B's shapes) and 70B (Llama-2 70B's:
grouped-query attention, 8 KV heads). Ranks: 8 GPUs per node. Configurations: DDP + torch.optim,
fused_zero flat (one shard group of W ranks: reduce-scatter and all-gather over all of them) and
fused_zero in shard groups of 8, one per node (reduce-scatter and all-gather on NVLink, this rank's
slice all-reduced across the W/8 replicas on the network).

**Buckets.** ``torch.distributed._compute_bucket_assignment_by_size`` on the parameters in reverse
registration order with DDP's limits ([1 MiB, 25 MiB]): what DDP's reducer builds when it rebuilds its
buckets in gradient-ready order after the first iteration (for these models the reverse of
registration order). Each bucket's ``BucketLayout.build(..., world_size=S, rank=0)`` gives its slice,
its replicated tail and the region a rank holds (ranks differ by under 4 alignment elements).

**Bytes sent per rank and step**, per collective as NCCL's ring runs it (bf16 gradients and parameters,
2 bytes an element): an all-reduce over n ranks sends ``2 (n-1)/n x B``, a reduce-scatter or an
all-gather ``(n-1)/n x B``. A ring over ranks that span nodes crosses each node boundary once per
channel, and NCCL lays its channels over the node's NICs, so on average 1/8 of what a rank sends goes
over the network (its NIC) and 7/8 over NVLink; a ring within a node is all NVLink; the all-reduce across
replicas (one rank per node) is all network. The tails are all-reduced over DDP's whole group.

**Time of those bytes**, an alpha-beta model: ``bandwidth = max(NVLink bytes / beta_nvl, network bytes /
beta_ib)`` over the whole step (a rank's NVLink and its NIC carry their shares at once, and the
collectives of successive buckets pipeline, so the busier link sets the pace), and ``latency`` summed
over the step's collectives (each waits for its own steps). Figures:

- beta_nvl = 450 GB/s per direction per GPU: NVLink 4 on H100/H200 SXM, 900 GB/s bidirectional
  (NVIDIA H100 / H200 Tensor Core GPU datasheets);
- beta_ib = 50 GB/s per direction per GPU: one 400 Gb/s NDR InfiniBand NIC per GPU (NVIDIA ConnectX-7,
  the DGX H100 / H200 network);
- latency: NCCL's own tuning model, Simple protocol (NVIDIA/nccl ``src/graph/tuning.cc``). Ring:
  ``8.4 + (steps - inter) x 3.4 + inter x 9.6`` us (``baseLat`` 8.4, ``hwLat`` 3.4 per NVLink step and
  9.6 per network step), ``steps = 2 (n-1)`` for an all-reduce and ``n - 1`` for a reduce-scatter or an
  all-gather, ``inter`` the same counts over nodes. All-reduces may also run as a tree, ``2 x ((ranks
  per node - 1) x 28 + log2(nodes) x 50)`` us, and take the lower of the two, as NCCL's tuner picks
  (its model gives the tree the ring's algorithm bandwidth for large groups, so the bytes stay the
  ring's); reduce-scatter and all-gather have only the ring there, which is what the flat
  configuration pays at scale.

**Store requests**: the c10d store requests of one training iteration, all ranks together: 0 for DDP and
for fused_zero (every per-iteration protocol runs in collectives; a rank-0-only ``state_dict()`` is
served from threads, checkpoint/serving/peers.py). Listed apart, what one rank-0-only ``state_dict()`` costs:
``STORE_PER_PEER`` requests for each rank it asks, which are the other ranks of its shard group only
(every shard group holds the whole state), as bench/checkpoint_rank0_cost.py measures it.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from fused_zero.pipeline.buckets.layout import BucketLayout

GPUS_PER_NODE = 8
BUCKET_CAP = 25 * 1024 * 1024  # DDP's default bucket_cap_mb=25
FIRST_BUCKET = 1024 * 1024  # DDP's _DEFAULT_FIRST_BUCKET_BYTES
GRAD_BYTES = PARAM_BYTES = 2  # bf16
STATE_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq per element a rank holds
BETA_NVL = 450e9
BETA_IB = 50e9
LAT_BASE, LAT_NVL, LAT_NET = 8.4e-6, 3.4e-6, 9.6e-6  # ring, Simple protocol
TREE_NVL, TREE_NET = 28e-6, 50e-6  # tree, Simple protocol
WORLDS = (8, 64, 512, 8192)
SHARD = 8


# ------------------------------------------------------------------ models, on the meta device

class _Block(nn.Module):
    def __init__(self, dim: int, ffn: int, heads: int, kv_heads: int, llama: bool):
        super().__init__()
        head = dim // heads
        if llama:  # RMSNorm weights, q/k/v/o without bias, SwiGLU
            self.n1, self.n2 = nn.Parameter(torch.empty(dim)), nn.Parameter(torch.empty(dim))
            self.q, self.o = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
            self.k = nn.Linear(dim, kv_heads * head, bias=False)
            self.v = nn.Linear(dim, kv_heads * head, bias=False)
            self.gate, self.up = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
            self.down = nn.Linear(ffn, dim, bias=False)
        else:  # GPT-2: LayerNorms, fused qkv, GELU MLP, all with biases
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.attn, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.fc, self.out = nn.Linear(dim, ffn), nn.Linear(ffn, dim)


class _LM(nn.Module):
    def __init__(self, vocab, dim, layers, heads, kv_heads, ffn, llama, block=1024):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        if not llama:
            self.pos = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(_Block(dim, ffn, heads, kv_heads, llama) for _ in range(layers))
        self.norm = nn.Parameter(torch.empty(dim)) if llama else nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if not llama:
            self.head.weight = self.emb.weight  # tied, as GPT-2


MODELS = {
    "GPT-2 small": dict(vocab=50257, dim=768, layers=12, heads=12, kv_heads=12, ffn=3072, llama=False),
    "Llama 7B": dict(vocab=32000, dim=4096, layers=32, heads=32, kv_heads=32, ffn=11008, llama=True),
    "Llama 70B": dict(vocab=32000, dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672, llama=True),
}


STORE_PER_PEER = 15
"""c10d store requests per rank a rank-0-only ``state_dict()`` asks, all ranks together: 15 at W=2, 45 at
W=4 (bench/checkpoint_rank0_cost.py, bench/results/2026-12-01-cpu-2core-rank0-checkpoint.json)."""

def build(name: str) -> nn.Module:
    with torch.device("meta"):
        return _LM(**MODELS[name]).to(torch.bfloat16)


def ddp_bucket_params(model: nn.Module) -> list[list[nn.Parameter]]:
    """DDP's buckets (their parameters, in bucket order) after its rebuild."""
    params = list(reversed([p for p in model.parameters() if p.requires_grad]))
    indices, _ = dist._compute_bucket_assignment_by_size(params, [FIRST_BUCKET, BUCKET_CAP], [False] * len(params))
    return [[params[i] for i in bucket] for bucket in indices]


def ddp_buckets(model: nn.Module) -> list[list[int]]:
    """DDP's buckets (element counts of their parameters, in bucket order) after its rebuild."""
    return [[p.numel() for p in bucket] for bucket in ddp_bucket_params(model)]


# ------------------------------------------------------------------ the model of one step

@dataclass
class Cost:
    nvl_bytes: float = 0.0
    ib_bytes: float = 0.0
    latency_s: float = 0.0
    collectives: int = 0

    @property
    def bandwidth_s(self) -> float:
        return max(self.nvl_bytes / BETA_NVL, self.ib_bytes / BETA_IB)

    def add(self, kind: str, n: int, nbytes: float, nodes: int) -> None:
        """One collective over ``n`` ranks spanning ``nodes`` nodes (``nodes == n``: one rank per node)."""
        if n <= 1:
            return
        sent = (2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n) * nbytes
        if nodes == 1:
            nvl, ib = sent, 0.0
        elif nodes == n:
            nvl, ib = 0.0, sent
        else:
            nvl, ib = sent * (GPUS_PER_NODE - 1) / GPUS_PER_NODE, sent / GPUS_PER_NODE
        steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
        inter = (2 * (nodes - 1) if kind == "all_reduce" else nodes - 1) if nodes > 1 else 0
        latency = LAT_BASE + (steps - inter) * LAT_NVL + inter * LAT_NET
        if kind == "all_reduce":
            tree = 2 * ((n // nodes - 1) * TREE_NVL + math.log2(nodes) * TREE_NET)
            latency = min(latency, tree)
        self.nvl_bytes += nvl
        self.ib_bytes += ib
        self.latency_s += latency
        self.collectives += 1


def nodes_of(n: int) -> int:
    return max(1, -(-n // GPUS_PER_NODE))


def row(model_name: str, buckets: list[list[int]], world: int, config: str) -> dict:
    """One configuration's figures per rank and step: ``config`` is "ddp", "flat" or "shard8"."""
    total = sum(sum(b) for b in buckets)
    cost = Cost()
    nodes = nodes_of(world)
    S = world if config == "flat" else min(SHARD, world)
    R = world // S
    regions = tails = 0
    for numels in buckets:
        n = sum(numels)
        if config == "ddp":
            cost.add("all_reduce", world, n * GRAD_BYTES, nodes)
            continue
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        lay = BucketLayout.build(range(len(numels)), numels, offsets, S, 0)
        regions += lay.region_size
        tails += lay.tail
        if lay.tail:
            cost.add("all_reduce", world, lay.tail * GRAD_BYTES, nodes)
        if lay.shard:
            cost.add("reduce_scatter", S, lay.head * GRAD_BYTES, nodes_of(S))
            cost.add("all_reduce", R, lay.shard * GRAD_BYTES, R)
            cost.add("all_gather", S, lay.head * PARAM_BYTES, nodes_of(S))
    state = total * STATE_BYTES if config == "ddp" else regions * STATE_BYTES
    return dict(model=model_name, params=total, world=world, config=config, shard_size=None if config == "ddp" else S,
                buckets=len(buckets), state_bytes=state, tail_share=tails / regions if regions else 0.0,
                launches_bucket_mode=len(buckets) if config != "ddp" else 1, launches_backward_step_mode=1,
                store_requests=0, store_requests_checkpoint=None if config == "ddp" else STORE_PER_PEER * (S - 1),
                bandwidth_s=cost.bandwidth_s, **asdict(cost))


def rows() -> list[dict]:
    out = []
    for name in MODELS:
        buckets = ddp_buckets(build(name))
        for world in WORLDS:
            for config in ("ddp", "flat", "shard8"):
                if config == "shard8" and world <= SHARD:
                    continue  # one node: the same as flat
                out.append(row(name, buckets, world, config))
    return out


# ------------------------------------------------------------------ output

def _gb(b: float) -> str:
    return f"{b / 1e9:.3g} GB" if b >= 1e8 else f"{b / 1e6:.3g} MB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g}"


def markdown(table: list[dict]) -> str:
    names = {"ddp": "DDP + AdamW", "flat": "fused_zero, flat", "shard8": "fused_zero, shards of 8"}
    lines = []
    for name in MODELS:
        mine = [r for r in table if r["model"] == name]
        lines += [f"**{name}** ({mine[0]['params'] / 1e9:.3g}B parameters, {mine[0]['buckets']} buckets of "
                  "25 MiB)", "",
                  "| W | configuration | optimizer state / rank | tail share | update launches (bucket mode) "
                  "| sent / rank: NVLink | sent / rank: network | bandwidth time ms | latency ms "
                  "| store requests / iteration (per rank-0 checkpoint) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            ddp = r["config"] == "ddp"
            tail = "-" if ddp else f"{r['tail_share']:.2%}"
            launches = "-" if ddp else r["launches_bucket_mode"]
            lines.append(
                f"| {r['world']} | {names[r['config']]} | {_gb(r['state_bytes'])} | {tail} | "
                f"{launches} | {_gb(r['nvl_bytes'])} | "
                f"{_gb(r['ib_bytes'])} | {_ms(r['bandwidth_s'])} | {_ms(r['latency_s'])} | "
                f"{r['store_requests']} ({'-' if ddp else r['store_requests_checkpoint']}) |")
        lines.append("")
    return "\n".join(lines)


def run(doc: str, table: list[dict], markdown_of, argv=None, **extra) -> None:
    """A scale model's command line: print ``markdown_of(table)``; ``--json FILE`` writes the rows
    (and ``extra``) there too. ``doc``: the script's docstring, whose first paragraph is the help."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--json", help="also write every row as JSON here")
    args = parser.parse_args(argv)
    print(markdown_of(table))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": table, **extra}, f, indent=1)


def main(argv=None) -> None:
    run(__doc__, rows(), markdown, argv,
        figures=dict(beta_nvl=BETA_NVL, beta_ib=BETA_IB, lat_base=LAT_BASE, lat_nvl=LAT_NVL, lat_net=LAT_NET,
                     tree_nvl=TREE_NVL, tree_net=TREE_NET, gpus_per_node=GPUS_PER_NODE, bucket_cap=BUCKET_CAP))


if __name__ == "__main__":
    main()
