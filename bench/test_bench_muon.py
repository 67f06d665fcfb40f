"""Muon for the demo GPT's hidden matrices, AdamW for the rest: fused_zero against DDP + torch.optim.Muon
+ torch.optim.AdamW, where every rank runs every matrix's Newton-Schulz (NS).

The ranks (gloo on CPU with one thread each, world 2; NCCL with one rank per GPU, at most 2) build every
system on the same model and batches and run each for ``WARMUP`` untimed and ``ITERS`` timed
iterations in the ranks (forward, backward, both ``step()``, ``zero_grad``; on CUDA timed with events),
one system after the other. Per system and rank they also count, over the timed iterations:

- NS FLOPs per rank and step: torch's FlopCounterMode around torch.optim.Muon's ``step()`` (every
  matrix, on every rank); fused_zero's owners' own count (pipeline/updating/whole_matrix.py), which
  tests/pipeline/updating/test_muon.py checks against FlopCounterMode;
- bytes sent per rank and step by fused_zero's collectives (pipeline/comm/collectives.py wrapped), under
  the ring model NCCL's algorithms follow: reduce-scatter and all-gather ``(W-1)/W`` of the whole
  buffer, all-reduce twice that, all-to-all what leaves the rank; and the same count for
  ``fused_zero.AdamW`` over every parameter (ZeRO-1's bytes for the same model: the baseline the
  Muon exchange is measured against).

    pytest bench/test_bench_muon.py --benchmark-only

pytest-benchmark's statistics are rank 0's in-rank iteration times (replayed through ``ReplayClock``).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.distributed as dist
from test_bench_step import ReplayClock

from fused_zero.demo import spawn

CUDA = torch.cuda.is_available()
WORLD = min(torch.cuda.device_count(), 2) if CUDA else 2
BACKEND = "nccl" if CUDA else "gloo"
MODEL = dict(n_embd=384, n_layer=6, n_head=6) if CUDA else dict(n_embd=64, n_layer=2, n_head=4)
BATCH, BLOCK, BUCKET_MB = 4, 64, 0.1
WARMUP, ITERS = 3, 12 if CUDA else 8
SYSTEMS = ["ddp+torch-muon", "fused_zero-muon-bucket", "fused_zero-muon-backward", "fused_zero-muon-step",
           "fused_zero-adamw-bucket"]
MUON_LR, ADAMW_LR = 0.02, 1e-3


def _split(model) -> tuple[list, list]:
    """Muon's parameters: the blocks' 2-D weights (torch's and Muon's authors' split); AdamW: the rest."""
    mats = [p for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("blocks.")]
    ids = {id(p) for p in mats}
    return mats, [p for p in model.parameters() if id(p) not in ids]


class _Bytes:
    """Bytes each collective of fused_zero's sends from this rank (ring model), while installed."""

    def __init__(self, world: int):
        from fused_zero.pipeline.comm import collectives

        self.mod, self.world, self.total, self.real = collectives, world, 0.0, {}
        share = (world - 1) / world
        sizes = {"all_reduce": lambda t, *a, **k: 2 * share * t.nbytes,
                 "reduce_scatter": lambda out, inp, *a, **k: share * inp.nbytes,
                 "all_gather": lambda out, inp, *a, **k: share * out.nbytes,
                 "all_to_all_single": lambda out, inp, *a, **k: inp.nbytes}
        for name, size in sizes.items():
            real = self.real[name] = getattr(collectives, name)

            def counted(*args, _real=real, _size=size, **kwargs):
                self.total += _size(*args, **kwargs)
                return _real(*args, **kwargs)
            setattr(collectives, name, counted)

    def close(self) -> None:
        for name, real in self.real.items():
            setattr(self.mod, name, real)


class _System:
    def __init__(self, name: str, vocab: int, device: torch.device):
        from torch.nn.parallel import DistributedDataParallel as DDP

        import fused_zero
        from fused_zero.demo.model import GPT, GPTConfig

        self.name = name
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(GPTConfig(vocab_size=vocab, block_size=BLOCK, **MODEL))
        self.ddp = DDP(model, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=True,
                       device_ids=[device.index] if device.type == "cuda" else None)
        mats, rest = _split(model)
        self.matrices = sum(p.numel() for p in mats)
        if name == "ddp+torch-muon":
            self.opts = [torch.optim.Muon(mats, lr=MUON_LR), torch.optim.AdamW(rest, lr=ADAMW_LR)]
        elif name == "fused_zero-adamw-bucket":
            self.opts = [fused_zero.AdamW(model.parameters(), lr=ADAMW_LR, ddp=self.ddp, overlap="bucket")]
        else:
            overlap = name.rsplit("-", 1)[1]
            self.opts = [fused_zero.Muon(mats, lr=MUON_LR, ddp=self.ddp, overlap=overlap),
                         fused_zero.AdamW(rest, lr=ADAMW_LR, ddp=self.ddp, overlap=overlap)]

    def ns_flops(self) -> float:
        engine = getattr(self.opts[0], "_engine", None)
        if engine is None:
            return 0.0
        whole = engine.updates._whole_matrix
        return float(whole[0].ns_flops) if whole else 0.0

    def iteration(self, x, y, flops: list | None = None) -> None:
        loss = self.ddp(x, y)[1]
        loss.backward()
        for o in self.opts:
            if flops is not None and isinstance(o, torch.optim.Muon):
                from torch.utils.flop_counter import FlopCounterMode

                with FlopCounterMode(display=False) as counter:
                    o.step()
                flops.append(counter.get_total_flops())
            else:
                o.step()
        for o in self.opts:
            o.zero_grad(set_to_none=True)

    def close(self) -> None:
        engine = getattr(self.opts[0], "_engine", None)
        if engine is not None:
            engine.synchronize()
            engine.close()


def _clock(device):
    if device.type == "cuda":
        def mark():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return mark, lambda a, b: a.elapsed_time(b) / 1e3, torch.cuda.synchronize
    return time.perf_counter, lambda a, b: b - a, lambda: None


def _rank_main(rank: int, world: int) -> dict:
    from fused_zero.demo.model import CharTokenizer, load_corpus

    if not CUDA:
        torch.set_num_threads(1)
    device = torch.device("cuda", rank) if CUDA else torch.device("cpu")
    text = load_corpus()
    tok = CharTokenizer(text)
    data = torch.tensor(tok.encode(text), dtype=torch.long)
    gen = torch.Generator().manual_seed(rank)
    starts = torch.randint(0, len(data) - BLOCK - 1, (WARMUP + ITERS, BATCH), generator=gen)
    batches = [(torch.stack([data[s:s + BLOCK] for s in row]).to(device),
                torch.stack([data[s + 1:s + 1 + BLOCK] for s in row]).to(device)) for row in starts]
    mark, seconds, sync = _clock(device)
    out = {}
    for name in SYSTEMS:
        system = _System(name, tok.vocab_size, device)
        for x, y in batches[:WARMUP]:
            system.iteration(x, y)
        sync()
        counted, flops, before = _Bytes(world), [], system.ns_flops()
        times = []
        try:
            for x, y in batches[WARMUP:]:
                a = mark()
                system.iteration(x, y, flops)
                times.append((a, mark()))
            system.close()
            sync()
        finally:
            counted.close()
        ns = (system.ns_flops() - before) / ITERS if name.startswith("fused_zero") else statistics.fmean(flops)
        out[name] = dict(iter=[seconds(a, b) for a, b in times], ns_flops=ns, bytes=counted.total / ITERS,
                         matrices=system.matrices)
        dist.barrier()
    return out


_RESULTS: dict = {}
CLOCK = ReplayClock()
pytestmark = pytest.mark.benchmark(timer=CLOCK)


def _results() -> list[dict]:
    if "ranks" not in _RESULTS:
        _RESULTS["ranks"] = spawn.run_ranks(_rank_main, WORLD, timeout=1200, backend=BACKEND,
                                            collective_timeout=300)
    return _RESULTS["ranks"]


@pytest.mark.parametrize("system", SYSTEMS)
def test_muon_iteration(benchmark, system):
    ranks = _results()
    r0 = ranks[0][system]
    zero1 = [r["fused_zero-adamw-bucket"]["bytes"] for r in ranks]
    torch_ms = statistics.median(ranks[0]["ddp+torch-muon"]["iter"]) * 1e3
    info = dict(system=system, world=WORLD, backend=BACKEND, model=f"demo GPT {MODEL}", bucket_cap_mb=BUCKET_MB,
                muon_elements=r0["matrices"], iter_ms_median=statistics.median(r0["iter"]) * 1e3,
                iter_vs_ddp_torch_muon=statistics.median(r0["iter"]) * 1e3 / torch_ms,
                ns_gflop_per_rank=[r[system]["ns_flops"] / 1e9 for r in ranks],
                bytes_per_rank=[r[system]["bytes"] for r in ranks], zero1_adamw_bytes_per_rank=zero1)
    if system.startswith("fused_zero-muon"):
        info["bytes_vs_zero1_adamw"] = [r[system]["bytes"] / z for r, z in zip(ranks, zero1)]
        info["ns_flops_all_ranks_vs_one_torch_step"] = (sum(r[system]["ns_flops"] for r in ranks)
                                                        / ranks[0]["ddp+torch-muon"]["ns_flops"])
    benchmark.group = "muon-iteration"
    benchmark.extra_info.update(info)
    durations = r0["iter"]
    benchmark.pedantic(CLOCK.replay(durations), rounds=len(durations), iterations=1, warmup_rounds=0)
