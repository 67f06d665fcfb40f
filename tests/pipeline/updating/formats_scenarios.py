"""Compact optimizer state against its oracle, on every rank: fused_zero with ``state_format`` "bf16" or
"8bit" (and ``master_weights="stochastic"``) next to DDP + torch.optim whose state is put through the same
format after every step.

The oracle's format is written in the tests, from the definition (kernel_reference.py: frexp, ldexp,
round half to even), not taken from fused_zero:

- bf16 moments: each moment rounded to bf16 (nearest even) after every step;
- 8-bit moments: each block of each moment encoded and decoded with its largest magnitude as scale,
  the blocks being the kernel rows fused_zero cuts its layout into (a block never spans two ranks or two
  parameters; which elements form one is part of the format): read from fused_zero's layout of every
  rank, which is DDP's buckets' (its bucket rebuild regroups the blocks, so the oracle applies the format
  before a step as well as after it: on blocks that did not change, that changes nothing);
- stochastic rounding: the bf16 weight is the fp32 result plus the hashed 16 random bits of
  (seed, step, parameter index, element index) under its last bit, truncated.

The optimizer order is the reference's too, so fp32 results are bit-identical where the reductions add
in DDP's order (1 and 2 ranks, all_reduce at 4): the comparison is then ``torch.equal``.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from scenarios import DEFAULT_HPARAMS, VOCAB, batch, twin_models
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.kernels import row_table, sr_key
from fused_zero.optimizer import TWINS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
from kernel_reference import decode8, encode8, round_stochastic

SIGNED = {"exp_avg": True, "momentum_buffer": True, "exp_avg_sq": False, "max_exp_avg_sq": False}
HPARAMS = {name: DEFAULT_HPARAMS[name] for name in ("AdamW", "SGD", *TWINS)}  # and torch.optim's elementwise twins


@dataclasses.dataclass(frozen=True)
class FormatCase:
    state_format: str = "8bit"
    opt: str = "AdamW"
    overlap: str = "bucket"
    grad_reduce: str = "reduce_scatter"
    stochastic: bool = False
    amsgrad: bool = False
    steps: int = 5
    same_data: bool = False  # every rank trains on the same batches (the world size then changes nothing)
    seed: int = 11
    backend: str = "torch"  # "triton": the kernels, interpreted on the CPU
    shard: int | None = None  # shard_group=: shards of this many consecutive ranks, replicated across
    # param groups, each with its own state_format (None: the group sets none, so the optimizer's
    # state_format): parameter i joins group i % len(groups), so every bucket mixes formats
    groups: tuple = ()
    bucket_cap_mb: float = 0.0001  # DDP's: one parameter a bucket; 0.002 (500 fp32) gathers several
    device: str = "cpu"  # "cuda": tests/gpu (the compiled kernels, backend="triton")

    def name(self) -> str:
        fmt = "+".join(f or self.state_format for f in self.groups) if self.groups else self.state_format
        return (f"{self.opt}-{fmt}{'-sr' if self.stochastic else ''}{'-ams' if self.amsgrad else ''}"
                f"-{self.overlap}-{self.grad_reduce}{'-same' if self.same_data else ''}-{self.backend}"
                f"{f'-shard{self.shard}' if self.shard else ''}{f'-cap{self.bucket_cap_mb}' if self.groups else ''}")


def grouping(case: FormatCase, n: int) -> list[list[int]]:
    """The parameters' indices (among those requiring grad, in model order) of each param group."""
    k = max(len(case.groups), 1)
    return [[i for i in range(n) if i % k == g] for g in range(k)]


def formats_of(case: FormatCase, n: int) -> list[str]:
    """Each parameter's moment format, by optimizer index (group order)."""
    if not case.groups:
        return [case.state_format] * n
    return [f or case.state_format for f, ids in zip(case.groups, grouping(case, n)) for _ in ids]


def build(case: FormatCase):
    model, ref = twin_models(case.device)
    if case.stochastic:
        model.bfloat16()
        ref.bfloat16()
    device = torch.device(case.device)
    kw = dict(bucket_cap_mb=case.bucket_cap_mb, device_ids=[device.index or 0] if device.type == "cuda" else None)
    ddp, ref_ddp = DDP(model, **kw), DDP(ref, **kw)
    hp = dict(HPARAMS[case.opt], **({"amsgrad": True} if case.amsgrad else {}))
    trained = [p for p in model.parameters() if p.requires_grad]
    ids = grouping(case, len(trained))
    groups = [dict({"params": [trained[i] for i in g]}, **({"state_format": f} if f else {}))
              for g, f in zip(ids, case.groups)] if case.groups else ddp.parameters()
    rounding = {"master_weights": "stochastic", "seed": case.seed} if case.stochastic else {}
    opt = getattr(fused_zero, case.opt)(groups, ddp=ddp, overlap=case.overlap, grad_reduce=case.grad_reduce,
                                        state_format=case.state_format, **rounding, _backend=case.backend,
                                        shard_group=case.shard, **hp)
    params = [p for p in ref.parameters() if p.requires_grad]
    params = [params[i] for g in ids for i in g]  # optimizer order: group by group
    work = [p.detach().float().requires_grad_(True) for p in params] if case.stochastic else params
    ends = list(itertools.accumulate(len(g) for g in ids))
    ref_opt = getattr(torch.optim, case.opt)([{"params": work[a:b]} for a, b in itertools.pairwise([0, *ends])],
                                             foreach=False, **hp)
    return model, ddp, opt, ref, ref_ddp, ref_opt, params, work


def blocks(opt) -> dict[int, list[tuple[int, int]]]:
    """Every parameter's 8-bit blocks (element ranges) over every rank's layout, by optimizer index."""
    out: dict[int, set] = {}
    for shard in opt._engine.shards():
        layout = shard.layout
        for r in range(layout.world_size):
            pieces = [(so, n, po, go, layout.pids[local], elem)
                      for so, n, po, go, local, elem in dataclasses.replace(layout, rank=r).rows()]
            for _, n, _, _, pid, elem, _, _ in row_table(pieces).tolist():
                out.setdefault(pid, set()).add((elem, elem + n))
    return {pid: sorted(ranges) for pid, ranges in out.items()}


def through_format(ref_opt, work, case: FormatCase, layout_blocks) -> None:
    """Put the oracle's moments through each one's format."""
    for pid, (p, fmt) in enumerate(zip(work, formats_of(case, len(work)))):
        state = ref_opt.state.get(p, {})
        for name, t in state.items():
            if name == "step" or not isinstance(t, torch.Tensor) or t.dim() == 0:
                continue  # the count, and the 0-dim scalars (NAdam's mu_product), kept in fp32
            flat = t.view(-1)
            if fmt == "bf16":
                flat.copy_(flat.to(torch.bfloat16).float())
            elif fmt == "8bit":
                for lo, hi in layout_blocks[pid]:
                    x = flat[lo:hi]
                    s = x.abs().max()
                    y = torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0.0)
                    flat[lo:hi] = decode8(encode8(y, SIGNED[name]), SIGNED[name]) * s


def train(case: FormatCase, rank: int, world: int, built=None, start: int = 1, steps: int | None = None,
          held: bool = False):
    """``held``: the optimizer has just loaded a checkpoint into DDP's first buckets, so its moments are
    held in fp32 until DDP's rebuild (docs/compact-state.md, "An exact resume"): the oracle puts them
    through no format in the first step; the next one's encodes them in the rebuilt layout's blocks."""
    model, ddp, opt, ref, ref_ddp, ref_opt, params, work = built or build(case)
    for step in range(start, start + (steps or case.steps)):
        formatted = not (held and step == start)
        x, y = (t.to(case.device) for t in batch(step, 0, 0 if case.same_data else rank))
        F.cross_entropy(ddp(x, use_branch=True).float().reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        layout_blocks = blocks(opt)
        F.cross_entropy(ref_ddp(x, use_branch=True).float().reshape(-1, VOCAB), y.reshape(-1)).backward()
        for p, w in zip(params, work):
            if w is not p:
                w.grad = p.grad.float()
        if formatted:
            through_format(ref_opt, work, case, layout_blocks)  # a rebuild regroups the blocks
        ref_opt.step()
        ref_opt.zero_grad()
        if formatted:
            through_format(ref_opt, work, case, layout_blocks)
        with torch.no_grad():
            for pid, (p, w) in enumerate(zip(params, work)):
                p.grad = None
                if w is not p:  # stochastic rounding, and the next step starts from the rounded weight
                    steps_done = int(ref_opt.state[w]["step"]) if case.opt == "AdamW" else step
                    key = torch.tensor(sr_key(case.seed, steps_done, pid), device=w.device)
                    p.copy_(round_stochastic(w.detach().reshape(-1), key, torch.arange(w.numel(), device=w.device))
                            .view_as(p))
                    w.copy_(p.float())
        compare(case, model, ref, opt, ref_opt, work, step, rank, world)
    return model, ddp, opt, ref, ref_ddp, ref_opt, params, work


def exact(case: FormatCase, world: int) -> bool:
    """Bit-identical to the oracle: torch's ops do the update (the kernels' arithmetic is another, held
    to a reference of its own in tests/kernels/test_kernel_exact.py, formats included) and the
    reductions add in DDP's order."""
    if case.backend != "torch":
        return False
    return world <= 2 or (case.grad_reduce == "all_reduce" and world & (world - 1) == 0) or case.same_data


def compare(case, model, ref, opt, ref_opt, work, step, rank, world) -> None:
    where = f"{case.name()} rank {rank} world {world} step {step}"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if exact(case, world):
            assert torch.equal(p, q), f"{where} {name}: largest difference {(p.float() - q.float()).abs().max():.3e}"
        else:  # an 8-bit code one step off moves a weight by a share of lr; a bf16 weight by an ulp
            tol = dict(rtol=1e-2, atol=1e-3) if p.dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(p.float(), q.float(), **tol, msg=lambda m, n=name: f"{where} {n}: {m}")
    if not exact(case, world):
        return
    ours = opt.state_dict()["state"]  # decoded to fp32: torch.optim's form
    for i, w in enumerate(work):
        for key, theirs in ref_opt.state.get(w, {}).items():
            if key != "step":
                assert torch.equal(ours[i][key], theirs), f"{where} parameter {i} {key} differs from the oracle's"


def run_format_cases(rank: int, world: int, cases: list[FormatCase]) -> list[str]:
    out = []
    for case in cases:
        *_, opt = train(case, rank, world)[:3]
        out.append(case.name())
        opt._engine.close()
    return out
