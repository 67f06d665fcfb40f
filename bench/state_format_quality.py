"""Training quality of the compact state formats: the demo's GPT (fused_zero/demo/model.py, made wider
and deeper here so that the formats separate) trained on its corpus under DDP with fused_zero.AdamW,
once per format, from the same initialization on the same batches; the held-out loss at the end of
each run against fp32 AdamW's.

Run: ``python bench/state_format_quality.py --out bench/results/<date>-state-formats [--steps 1000]``,
and for the run-to-run spread ``... --runs fp32 --seeds 1 2 3 --tag spread``. It writes ``quality.json``
(every run's loss curve, its final train and held-out losses, the optimizer bytes per rank) and
``quality.png`` (the curves), and prints the table of docs/performance-compact-state.md.

Runs (2 gloo ranks by default):

    fp32                fp32 parameters, fp32 moments (torch.optim's AdamW, bit for bit)
    bf16 moments        fp32 parameters, bf16 moments (rounded to nearest even after every step)
    int8 moments        fp32 parameters, 8-bit block-wise moments (kernels/codecs.py)
    bf16 params + master   bf16 parameters with fp32 masters, fp32 moments (the usual mixed precision)
    bf16 params, nearest   bf16 parameters, no master, rounded to nearest: what stochastic rounding fixes
    int8 + SR, no master   bf16 parameters, no master, stochastic rounding, 8-bit moments (~4 B/param)

The held-out loss is the mean over ``eval_batches`` fixed windows of the corpus' last 10%, which no
run trains on; the train loss is the mean of the last 50 steps (all ranks).
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.demo.model import GPT, CharTokenizer, GPTConfig, batches, load_corpus
from fused_zero.demo.spawn import run_ranks

RUNS = {  # name: (parameter dtype, fused_zero options)
    "fp32": ("float32", {}),
    "bf16 moments": ("float32", {"state_format": "bf16"}),
    "int8 moments": ("float32", {"state_format": "8bit"}),
    "bf16 params + master": ("bfloat16", {"master_weights": True}),
    "bf16 params, nearest": ("bfloat16", {"master_weights": False}),
    "int8 + SR, no master": ("bfloat16", {"master_weights": "stochastic", "state_format": "8bit"}),
}


def _train(rank: int, world: int, name: str, steps: int, width: int, layers: int, lr: float,
           eval_batches: int, seed: int) -> dict:
    torch.set_num_threads(1)
    dtype, options = RUNS[name]
    text = load_corpus()
    tok = CharTokenizer(text)
    data = tok.encode(text)
    split = int(0.9 * data.numel())
    train, held = data[:split], data[split:]
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=layers, n_head=4, n_embd=width))
    model = model.to(getattr(torch, dtype))
    ddp = DDP(model, bucket_cap_mb=1.0, gradient_as_bucket_view=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = fused_zero.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                           lr=lr, betas=(0.9, 0.95), ddp=ddp, **options)
    sched = torch.optim.lr_scheduler.LambdaLR(  # warm-up, then cosine to 10%
        opt, lambda s: min(1.0, (s + 1) / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    stream = batches(train, batch_size=16, block_size=64, rank=rank, world_size=world, seed=1 + seed)
    curve = []
    for _ in range(steps):
        x, y = next(stream)
        _, loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        mean = loss.detach().float().reshape(1)
        dist.all_reduce(mean)
        curve.append(float(mean) / world)
    opt.synchronize()
    model.eval()
    evals = batches(held, batch_size=16, block_size=64, rank=rank, world_size=world, seed=7)
    with torch.no_grad():
        held_loss = sum(float(model(*next(evals))[1].float()) for _ in range(eval_batches)) / eval_batches
    total = torch.tensor([held_loss])
    dist.all_reduce(total)
    mem = opt.memory()
    params = sum(p.numel() for p in model.parameters())
    return {"name": name if seed == 0 else f"{name}, seed {seed}", "seed": seed, "curve": curve,
            "held_out": float(total) / world,
            "train_last50": sum(curve[-50:]) / len(curve[-50:]), "params": params,
            "state_bytes_per_rank": int(mem["state"]), "param_dtype": dtype, "options": options}


def _plot(runs: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    k = 25  # a moving mean over k steps
    for r in runs:
        c = r["curve"]
        smooth = [sum(c[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(c))]
        ax.plot(range(1, len(c) + 1), smooth, label=f"{r['name']} (held-out {r['held_out']:.4f})", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss (mean of {k} steps)")
    ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("fused_zero.AdamW state formats: the demo GPT, 2 gloo ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(runs: list[dict]) -> str:
    base = next((r for r in runs if r["name"] == "fp32"), runs[0])
    lines = ["| run | held-out loss | gap to fp32 | train loss (last 50) | optimizer bytes/param (x W) |",
             "|---|---|---|---|---|"]
    for r in runs:
        per_param = r["state_bytes_per_rank"] * r["world"] / r["params"]
        lines.append(f"| {r['name']} | {r['held_out']:.4f} | {r['held_out'] - base['held_out']:+.4f} "
                     f"({(r['held_out'] / base['held_out'] - 1) * 100:+.2f}%) | {r['train_last50']:.4f} | "
                     f"{per_param:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-batches", type=int, default=40)
    ap.add_argument("--runs", nargs="+", default=list(RUNS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="initialization and data seeds of every run (others than 0: the run-to-run spread)")
    ap.add_argument("--tag", default="quality", help="the output files' name")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs = []
    for name, seed in [(n, s) for s in args.seeds for n in args.runs]:
        out = run_ranks(_train, args.world, name, args.steps, args.width, args.layers, args.lr,
                        args.eval_batches, seed, backend="gloo", timeout=3600.0)[0]
        out["world"] = args.world
        runs.append(out)
        print(f"{out['name']}: held-out {out['held_out']:.4f}, train {out['train_last50']:.4f}", flush=True)
    meta = {"torch": torch.__version__, "world": args.world, "steps": args.steps, "width": args.width,
            "layers": args.layers, "lr": args.lr, "eval_batches": args.eval_batches, "runs": runs}
    with open(os.path.join(args.out, f"{args.tag}.json"), "w") as f:
        json.dump(meta, f, indent=1)
    _plot(runs, os.path.join(args.out, f"{args.tag}.png"))
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
