"""``fused-zero demo``: train a small GPT under DDP twice, with torch.optim and with fused_zero, side by
side on the same data, and show that they agree step by step.

Each rank builds both models from one seed, feeds both the same batches, and after every step
compares every parameter. Rank 0 prints per-step losses, the largest parameter difference, time per
iteration and optimizer-state bytes per rank; the exit status is non-zero if parity breaks.

What parity means depends on where it runs, and the report says which claim it checked: on CPU the
update runs torch's own ops in torch.optim's order, so fp32 parameters are bit-identical (at a world
size that is a power of two: dividing by another W rounds at another point); elsewhere (the Triton
kernels, Triton's interpreter) they agree to ``TOLERANCE``.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero

from .model import GPT, CharTokenizer, GPTConfig, batches, load_corpus
from .spawn import RanksFailed, run_ranks


@dataclass
class DemoConfig:
    world_size: int
    steps: int = 150
    optimizer: str = "AdamW"
    overlap: str = "bucket"
    grad_reduce: str = "reduce_scatter"
    bucket_cap_mb: float = 0.1
    dtype: str = "float32"
    lr: float = 3e-3
    batch_size: int = 16
    block_size: int = 64
    seed: int = 0
    backend: str = "auto"
    profile_dir: str | None = None


TOLERANCE = 1e-4
"""The largest parameter difference accepted where bit-identity is not claimed."""

PROFILED_STEPS = (4, 6)
"""The steps the torch.profiler trace holds (wait 2, warm up 1, record 3: ``_profiler``)."""


def claimed_bound(cfg: DemoConfig) -> tuple[float, str]:
    """The largest difference this configuration promises, and the promise in words."""
    w = cfg.world_size
    cpu_ops = not torch.cuda.is_available() and cfg.backend in ("auto", "torch")
    if cpu_ops and cfg.dtype == "float32" and w & (w - 1) == 0:
        return 0.0, "bit-identical (on CPU the update runs torch's own ops, in torch.optim's order)"
    return TOLERANCE, f"within {TOLERANCE:g} (the Triton kernels, or a world size that is not a power of two)"


def shown_steps(total: int) -> list[int]:
    """The steps both the progress lines and the table show: the first, every tenth of the run, the last."""
    every = max(total // 10, 1)
    return sorted({1, total, *range(every, total + 1, every)})


def _make(cfg: DemoConfig, vocab: int, device: torch.device):
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=cfg.block_size)).to(device, getattr(torch, cfg.dtype))
    ddp = DDP(model, bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=True,
              device_ids=[device.index] if device.type == "cuda" else None)
    return model, ddp


def _hparams(cfg: DemoConfig) -> dict:
    extra = {"momentum": 0.9} if cfg.optimizer == "SGD" else {"weight_decay": 0.1}
    return {"lr": cfg.lr, **extra}


MUON_LR = 0.02
"""Muon's lr in the demo (its authors' for GPTs of this size); AdamW beside it keeps ``--lr``."""


def _groups(model, cfg):
    """Weight decay on matrices only, as GPT recipes do: two param groups."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    hp = _hparams(cfg)
    return [{"params": decay, **hp}, {"params": rest, **hp, "weight_decay": 0.0}] if "weight_decay" in hp \
        else [{"params": decay + rest, **hp}]


def _optimizers(model, cfg, module, **options) -> list:
    """The optimizers of ``module`` (torch.optim, or fused_zero with ``options``): one, or for Muon two,
    as its users split a GPT: Muon over the blocks' matrices, AdamW over the embeddings, norms and biases."""
    if cfg.optimizer != "Muon":
        return [getattr(module, cfg.optimizer)(_groups(model, cfg), **options)]
    mats = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")]
    ids = {id(p) for p in mats}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [module.Muon(mats, lr=MUON_LR, **options),
            module.AdamW(rest, lr=cfg.lr, weight_decay=0.0, **options)]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(rank: int, world: int, cfg: DemoConfig) -> dict | None:
    """One rank of the demo (spawn.run_ranks has set up the process group); rank 0 returns the report."""
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    text = load_corpus()
    tok = CharTokenizer(text)
    data = tok.encode(text)
    ref_model, ref_ddp = _make(cfg, tok.vocab_size, device)
    model, ddp = _make(cfg, tok.vocab_size, device)
    ref_opts = _optimizers(ref_model, cfg, torch.optim)
    opts = _optimizers(model, cfg, fused_zero, ddp=ddp, overlap=cfg.overlap, grad_reduce=cfg.grad_reduce,
                       _backend=cfg.backend, master_weights=False)
    stream = batches(data, batch_size=cfg.batch_size, block_size=cfg.block_size, rank=rank,
                     world_size=world, seed=cfg.seed)
    prof = _profiler(cfg, rank)
    times = {"torch.optim": 0.0, "fused_zero": 0.0}
    worst, log = 0.0, []
    with prof if prof is not None else contextlib.nullcontext():
        for step in range(1, cfg.steps + 1):
            x, y = (t.to(device) for t in next(stream))
            losses = []
            for name, d, os_ in (("torch.optim", ref_ddp, ref_opts), ("fused_zero", ddp, opts)):
                _sync(device)
                t0 = time.perf_counter()
                _, loss = d(x, y)
                loss.backward()
                for o in os_:
                    o.step()
                for o in os_:
                    o.zero_grad(set_to_none=True)
                _sync(device)
                if step > 1:  # the first step compiles and rebuilds buckets
                    times[name] += time.perf_counter() - t0
                losses.append(loss.detach())
            opts[0].synchronize()
            diff = _largest_difference(model, ref_model)
            stats = torch.tensor([diff, *(float(v) for v in losses)], dtype=torch.float64, device=device)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            worst = max(worst, float(stats[0]))
            log.append((step, float(stats[1]), float(stats[2]), float(stats[0])))
            if rank == 0:
                _progress(step, cfg.steps, float(stats[1]), float(stats[2]), worst)
            if prof is not None:
                prof.step()
    if rank != 0:
        return None
    per_iter = {k: v / max(cfg.steps - 1, 1) for k, v in times.items()}
    memory = [o.memory() for o in opts]
    return {"log": log, "worst": worst, "per_iter": per_iter,
            "memory": {k: sum(m[k] for m in memory) for k in ("state", "reference_state", "elements")}}


def _largest_difference(model, ref_model) -> float:
    """The largest |difference| over every parameter, with NaN as infinitely far: Python's max() and
    the all-reduce's MAX both drop a NaN, which would let NaN parameters pass as parity."""
    diffs = torch.stack([(p.detach().float() - q.detach().float()).abs().max()
                         for p, q in zip(model.parameters(), ref_model.parameters()) if p.numel()])
    return float(torch.nan_to_num(diffs.max(), nan=math.inf))


def _parity_held(cfg: DemoConfig, report: dict) -> bool:
    return report["worst"] <= claimed_bound(cfg)[0]  # False for NaN too


def _profiler(cfg: DemoConfig, rank: int):
    if cfg.profile_dir is None or rank != 0:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities, schedule=torch.profiler.schedule(wait=2, warmup=1, active=3, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(cfg.profile_dir), record_shapes=False)


def _progress(step: int, total: int, ref_loss: float, loss: float, worst: float) -> None:
    """A log file gets the table's steps, a terminal one bar redrawn in place."""
    if not sys.stderr.isatty() and step not in shown_steps(total):
        return
    width = 30
    done = int(width * step / total)
    bar = "#" * done + "." * (width - done)
    end = "\n" if step == total or not sys.stderr.isatty() else ""
    print(f"\r[{bar}] step {step:4d}/{total}  loss torch.optim {ref_loss:.4f} fused_zero {loss:.4f}  "
          f"max |param diff| so far {worst:.2e}", end=end, file=sys.stderr, flush=True)


def run(cfg: DemoConfig) -> int:
    """Spawn the ranks, print the report, return the exit status (0: parity held)."""
    if cfg.world_size < 1:
        raise ValueError("world size must be >= 1")
    if cfg.profile_dir is not None:
        os.makedirs(cfg.profile_dir, exist_ok=True)
    started = time.perf_counter()
    try:
        report = run_ranks(_train, cfg.world_size, cfg, timeout=1800.0)[0]
    except RanksFailed as e:
        print(f"demo failed:\n{e}", file=sys.stderr)
        return 2
    _print_report(cfg, report)
    if cfg.profile_dir is not None:
        _print_trace(cfg.profile_dir)
    print(f"took {time.perf_counter() - started:.1f} s ({cfg.world_size} ranks spawned, "
          f"{cfg.steps} steps of each optimizer)")
    return 0 if _parity_held(cfg, report) else 1


def _print_trace(directory: str) -> None:
    traces = sorted(Path(directory).glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not traces:
        print(f"no torch.profiler trace was written to {directory} (the run is shorter than step "
              f"{PROFILED_STEPS[1]})")
        return
    print(f"torch.profiler trace of rank 0, steps {PROFILED_STEPS[0]}-{PROFILED_STEPS[1]}: {traces[-1]} "
          "(open it in https://ui.perfetto.dev or chrome://tracing; fused_zero's ranges are named fused_zero.*)")


def _print_report(cfg: DemoConfig, report: dict) -> None:
    dev = "cuda (nccl)" if torch.cuda.is_available() else "cpu (gloo)"
    name = f"Muon (lr {MUON_LR}) + AdamW" if cfg.optimizer == "Muon" else cfg.optimizer
    print(f"\n{name}, {cfg.world_size} ranks on {dev}, overlap={cfg.overlap}, "
          f"grad_reduce={cfg.grad_reduce}, bucket_cap_mb={cfg.bucket_cap_mb}, {cfg.dtype}")
    print(f"each value is the maximum over the {cfg.world_size} ranks (each rank's loss is on its own batch)")
    print(f"{'step':>6} {'loss torch.optim':>17} {'loss fused_zero':>16} {'max |param diff|':>17}")
    log = report["log"]
    for step in shown_steps(len(log)):
        _, a, b, d = log[step - 1]
        print(f"{step:>6} {a:>17.6f} {b:>16.6f} {d:>17.2e}")
    it = report["per_iter"]
    mem = report["memory"]
    print(f"\ntime per iteration on rank 0 (forward+backward+step, mean of steps 2-{len(log)}): "
          f"torch.optim {it['torch.optim'] * 1e3:.1f} ms, fused_zero {it['fused_zero'] * 1e3:.1f} ms")
    if not torch.cuda.is_available():
        print("  on CPU both updates run torch's CPU ops and fused_zero adds its gloo collectives "
              "(reduce-scatter, all-gather); its Triton kernels and its overlap with the backward are "
              "CUDA's, so this is no measure of GPU speed (docs/benchmarks.md)")
    print(f"optimizer state per rank: fused_zero {mem['state']:,} B (moments of this rank's slices), "
          f"torch.optim {mem['reference_state']:,} B "
          f"({mem['elements']:,} parameters)")
    verdict = "PARITY OK" if _parity_held(cfg, report) else "PARITY BROKEN"
    print(f"largest parameter difference over {len(log)} steps, every rank: {report['worst']:.3e}; "
          f"claimed: {claimed_bound(cfg)[1]}: {verdict}")
