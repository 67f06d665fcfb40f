"""Twin runs of one user loop: fused_zero's optimizers against torch.optim's under plain DDP.

``twin(rank, loop, make, ...)`` builds two copies of OddNet (scenarios.py: odd sizes, a tied weight), each
under its own DDP module, gives ``make(model, ddp, fused)`` the chance to build the optimizers a user
would (``fused``: fused_zero's where the user would use them, else torch.optim's), and runs
``loop(run, step)`` on both for every step (DDP with ``gradient_as_bucket_view=True`` unless ``ddp_kw``
says otherwise: every gradient then views its bucket, the case where one optimizer's change of its own
gradients is seen on the others'). ``run`` holds what the loop uses (the DDP module, the
optimizers, a GradScaler, the rank). After every step every parameter of every rank is compared with
the oracle's, bit for bit, and with rank 0's; at the end every optimizer's ``state_dict()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from scenarios import DEFAULT_HPARAMS, VOCAB, batch, twin_models
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero

HP = DEFAULT_HPARAMS  # each optimizer's, as it declares them (fused_zero/algorithms/registry.py)


@dataclass
class Run:
    """What a loop uses: its DDP module, its optimizers (in the order the user built them), its
    GradScaler (or None), its rank and world size, and anything the loop keeps between steps."""

    ddp: DDP
    opts: list
    scaler: torch.amp.GradScaler | None
    rank: int
    world: int
    fused: bool
    keep: dict = field(default_factory=dict)

    def loss(self, step: int, micro: int = 0, use_branch: bool = True) -> torch.Tensor:
        x, y = batch(step, micro, self.rank)
        return F.cross_entropy(self.ddp(x, use_branch=use_branch).float().reshape(-1, VOCAB), y.reshape(-1))

    def params_of(self, i: int) -> list:
        return [p for g in self.opts[i].param_groups for p in g["params"]]


def split(model, names: tuple[str, ...]) -> tuple[list, list]:
    """The trainable parameters whose name starts with one of ``names``, and the rest."""
    chosen, rest = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (chosen if n.startswith(names) else rest).append(p)
    return chosen, rest


def optimizer(kind: str, params, fused: bool, **options):
    """``kind`` (a class name of both torch.optim and fused_zero) over ``params``: fused_zero's, with the
    sharding ``options``, or torch.optim's (single-tensor, the CPU's exact reference)."""
    hp = {**HP[kind], **options.pop("hp", {})}
    if fused:
        return getattr(fused_zero, kind)(params, **hp, _backend="torch", **options)
    return getattr(torch.optim, kind)(params, **hp, **({} if kind == "Muon" else {"foreach": False}))


def models(ddp_kw: dict):
    model, ref = twin_models()
    return (model, DDP(model, **ddp_kw)), (ref, DDP(ref, **ddp_kw))


def twin(rank: int, world: int, loop, make, steps: int = 6, ddp_kw: dict | None = None, scaler: bool = False,
         group=None, state: bool = True) -> dict:
    """Run ``loop`` ``steps`` times with the optimizers ``make`` builds, and with torch.optim's; compare.
    ``group``: DDP's process group (None: the world). Returns what the runs kept (``keep``) and the
    largest difference seen (0.0 when bit for bit)."""
    kw = {"gradient_as_bucket_view": True, **(ddp_kw or {})}
    if group is not None:
        kw["process_group"] = group
    (model, ddp), (ref_model, ref_ddp) = models(kw)
    runs = []
    for fused, (m, d) in ((False, (ref_model, ref_ddp)), (True, (model, ddp))):
        s = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3) if scaler else None
        run = Run(d, [], s, rank, world, fused)
        run.opts = make(m, d, fused, run)
        runs.append(run)
    ref, ours = runs
    for step in range(1, steps + 1):
        for run in runs:
            loop(run, step)
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            same(p.detach(), q.detach(), f"rank {rank} step {step} {name}", exact(group))
        _ranks_agree(model, step, group)
    if state:
        for i, (o, r) in enumerate(zip(ours.opts, ref.opts)):
            if isinstance(o, fused_zero.optimizer.ShardedOptimizer):
                compare_state(o.state_dict(), r.state_dict(), f"rank {rank} optimizer {i}", exact(group))
        dist.barrier(group)  # every rank served before any lets its optimizers go (checkpointing.md)
    for o in ours.opts:
        if getattr(o, "_engine", None) is not None:
            o._engine.close()
    return {"keep": ours.keep, "ref_keep": ref.keep}


def exact(group=None) -> bool:
    """Whether fp32 results must be bit-identical to torch.optim's: at a power-of-two world size (at 3
    ranks fused_zero divides the reduced sums by 3 where DDP divides before summing; scenarios._exact)."""
    world = dist.get_world_size(group)
    return world & (world - 1) == 0


def same(a: torch.Tensor, b: torch.Tensor, where: str, bits: bool = True) -> None:
    """``a`` is ``b``: bit for bit, or (``bits`` False) within the parity tests' tolerance."""
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    if bits:
        assert torch.equal(a, b), f"{where}: largest difference {float((a - b).abs().max()):.3e}"
    else:
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=lambda m: f"{where}: {m}")


def ours_alone(rank: int, world: int, loop, make, steps: int = 3, scaler: bool = False) -> None:
    """Run ``loop`` with the optimizers ``make`` builds (fused_zero's) and nothing to compare with: for
    a mode that refuses the pattern, which raises on the way."""
    (model, ddp), _ = models({"gradient_as_bucket_view": True})
    s = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3) if scaler else None
    run = Run(ddp, [], s, rank, world, True)
    run.opts = make(model, ddp, True, run)
    try:
        for step in range(1, steps + 1):
            loop(run, step)
    finally:
        for o in run.opts:
            if getattr(o, "_engine", None) is not None:
                o._engine.close()


def compare_state(ours: dict, ref: dict, where: str, bits: bool = True) -> None:
    """torch.optim's state dict against fused_zero's: the same entries, bit for bit (fused_zero adds
    nothing for fp32 parameters)."""
    assert sorted(ours["state"]) == sorted(ref["state"]), f"{where}: state of {sorted(ours['state'])} vs " \
        f"{sorted(ref['state'])}"
    for i, entry in ref["state"].items():
        for key, value in entry.items():
            same(ours["state"][i][key], value, f"{where}: state[{i}][{key!r}]", bits)
    for g, h in zip(ours["param_groups"], ref["param_groups"]):
        for key in ("lr", "params"):
            assert g[key] == h[key], f"{where}: param group {key}: {g[key]} vs {h[key]}"


def _ranks_agree(model, step: int, group) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat, group=group)
    for r, other in enumerate(gathered):
        assert torch.equal(other, gathered[0]), f"step {step}: rank {r} of DDP's group differs from its rank 0"


def refused(fn, match: str) -> str:
    """``fn()`` raises a RuntimeError or ValueError whose message matches ``match``: the message."""
    import re

    try:
        fn()
    except (RuntimeError, ValueError) as e:
        assert re.search(match, str(e)), f"refused with {e!r}, not matching {match!r}"
        return str(e)
    raise AssertionError(f"not refused (expected {match!r})")
