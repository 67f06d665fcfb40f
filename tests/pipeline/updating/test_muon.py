"""fused_zero.Muon beside fused_zero.AdamW on one DDP module, against DDP + torch.optim.Muon +
torch.optim.AdamW (scenarios.py, ``opt="Muon"``: Muon over OddNet's matrices, whose odd sizes straddle
the ranks' slices and the buckets' tails, AdamW over the embedding, norms and biases): every parameter
of every rank compared after each of 12 steps, bit for bit, with the lr of both optimizers changed by
a schedule every step.

Then what Muon must also hold: its Newton-Schulz runs once per matrix and step over all ranks (matmul
FLOPs counted), the owners balance it, a GradScaler's skipped step and scale agree with torch's (bit
for bit) and so does clipping by the global norm of both optimizers' gradients (an ulp), and bad
splits are refused at construction, naming the parameter.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from scenarios import Case, build, loss_of, optimizer_groups, run_cases
from test_parity import MODES, ONE, TINY, TWO, bf16, check
from torch.utils.flop_counter import FlopCounterMode

import fused_zero
from fused_zero.algorithms.muon import ADJUST_LR_FNS
from fused_zero.pipeline.updating.whole_matrix import owners


def test_every_mode_and_bucket_size_two_ranks():
    cases = [Case(opt="Muon", overlap=o, grad_reduce=r, bucket_cap_mb=b) for (o, r) in MODES for b in (TINY, ONE)]
    check(cases, run_ranks(run_cases, 2, cases))


OPTIONS = {
    "two Muon groups": dict(groups=2),
    "no_sync accumulation, no grad views": dict(accumulate=2, as_view=False),
    "nanoGPT accumulation": dict(accumulate=2, nanogpt_accumulate=True),
    "find_unused: a matrix with no gradient": dict(graph="find_unused"),
    "static_graph": dict(graph="static"),
    "bf16 with master weights": dict(dtype=bf16),
    "plain momentum, AdamW's rms": dict(kwargs={"nesterov": False, "adjust_lr_fn": "match_rms_adamw",
                                                "momentum": 0.9, "ns_steps": 3}),
}
if "spectral_unclamped" in ADJUST_LR_FNS:  # torch 2.14 on: sqrt(A / B), below 1 for a wide matrix
    OPTIONS["Bernstein's unclamped lr"] = dict(kwargs={"adjust_lr_fn": "spectral_unclamped"})


def test_adjust_lr_fn_is_the_installed_torchs():
    """What torch.optim.Muon of this torch takes, fused_zero.Muon takes; what it refuses, refused too."""
    for fn in ("original", "match_rms_adamw", "spectral_unclamped", "rms"):
        weight = torch.nn.Parameter(torch.zeros(4, 3))
        try:
            torch.optim.Muon([weight], adjust_lr_fn=fn)
            torch_takes = True
        except ValueError:
            torch_takes = False
        model = torch.nn.Linear(3, 4, bias=False)
        if torch_takes:
            fused_zero.Muon(model.parameters(), ddp=model, adjust_lr_fn=fn)
        else:
            with pytest.raises(ValueError, match=f"Adjust learning rate function {fn} is not supported"):
                fused_zero.Muon(model.parameters(), ddp=model, adjust_lr_fn=fn)


def test_options_two_ranks():
    cases = [Case(opt="Muon", overlap=o, grad_reduce=r, bucket_cap_mb=b, **options)
             for options, ((o, r), b) in zip(OPTIONS.values(), zip(itertools.cycle(MODES),
                                                                     itertools.cycle((TINY, TWO, ONE))))]
    check(cases, run_ranks(run_cases, 2, cases))


@pytest.mark.parametrize("world", [1, 4])
def test_other_world_sizes(world):
    modes = MODES if world > 1 else [m for m in MODES if m[1] == "reduce_scatter"]
    cases = [Case(opt="Muon", overlap=o, grad_reduce=r, bucket_cap_mb=b)
             for (o, r), b in zip(modes, itertools.cycle((TINY, ONE)))]
    if world == 4:  # two shard groups of two: each matrix's Newton-Schulz runs once in each
        cases += [Case(opt="Muon", overlap=o, shard=2, bucket_cap_mb=TINY, graph="find_unused")
                  for o in ("bucket", "step")]
    check(cases, run_ranks(run_cases, world, cases))


def _ns_flops(rank: int, world: int, overlap: str) -> dict:
    """Matmul FLOPs of one step: ours on this rank (the backward and step, less the reference's
    backward: the same model, the same FLOPs), and torch.optim.Muon's step on one rank (every matrix)."""
    case = Case(opt="Muon", overlap=overlap, bucket_cap_mb=TINY)
    model, ddp, opt, ref_model, ref_ddp, ref_opt, _ = build(case, rank)
    for step in (1, 2, 3):  # past DDP's bucket rebuild
        counts = {}
        whole = opt._engine.updates._whole_matrix
        before = whole[0].ns_flops if whole else 0
        for name, d, o in (("ref", ref_ddp, ref_opt), ("ours", ddp, opt)):
            loss = loss_of(d, case, step, 0, rank)
            with FlopCounterMode(display=False) as backward:
                loss.backward()
            with FlopCounterMode(display=False) as stepping:
                o.step()
            o.zero_grad()
            counts[name] = (backward.get_total_flops(), stepping.get_total_flops())
    opt._engine.close()
    (ref_backward, ref_step), (backward, stepping) = counts["ref"], counts["ours"]
    return {"ours": backward - ref_backward + stepping, "torch": ref_step,
            "owner": opt._engine.updates._whole_matrix[0].ns_flops - before}


@pytest.mark.parametrize("world,overlap", [(2, "bucket"), (4, "step")])
def test_newton_schulz_runs_once_per_matrix(world, overlap):
    """Summed over the ranks, the Newton-Schulz matmuls of one step are one torch.optim.Muon step's:
    each matrix is orthogonalized by its owner alone (DeepSpeed's and Moonlight's ZeRO Muon run it
    wherever a rank holds a piece: up to W times). Each rank's count is what its owner share says."""
    out = run_ranks(_ns_flops, world, overlap)
    total = sum(r["ours"] for r in out)
    assert total == out[0]["torch"] > 0, (total, out[0]["torch"])
    assert [r["ours"] for r in out] == [r["owner"] for r in out]


def gpt2_small_matrices() -> list[tuple[int, int]]:
    """GPT-2 small's hidden matrices (12 layers: attention in and out, MLP in and out)."""
    return [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_owners_balance_the_newton_schulz_cost(world):
    """Longest-processing-time first over GPT-2 small's 48 matrices: the busiest rank's Newton-Schulz
    cost within 25% of an even share up to 16 ranks (beyond, a rank gets a handful of matrices and the
    largest one bounds it: docs/performance-scale.md's scale rows)."""
    shapes = gpt2_small_matrices()
    owner = owners(shapes, world)
    cost = [m * n * min(m, n) for m, n in shapes]
    load = [sum(c for c, o in zip(cost, owner) if o == r) for r in range(world)]
    assert max(load) <= 1.25 * sum(cost) / world, load
    assert owners(shapes, world) == owner  # the same on every rank: a function of the shapes alone


def _refused(rank: int, world: int, what: str) -> str:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    mats = [model[0].weight, model[2].weight]
    rest = [model[0].bias, model[1].weight, model[1].bias, model[2].bias]
    try:
        if what == "1-D":
            fused_zero.Muon([*mats, model[1].weight], ddp=ddp)
        elif what == "named 1-D":
            fused_zero.Muon(list(model.named_parameters()), ddp=ddp)
        elif what == "twice":
            fused_zero.Muon(mats, ddp=ddp)
            fused_zero.AdamW([*rest, model[2].weight], ddp=ddp)
        elif what == "late":
            fused_zero.Muon(mats, ddp=ddp)
            ddp(torch.randn(3, 4))  # the first forward settles the layout: Muon's, the rest left to its owner
            fused_zero.AdamW(rest, ddp=ddp)
        elif what == "8-bit":
            fused_zero.Muon(mats, ddp=ddp, state_format="8bit")
            fused_zero.AdamW(rest, ddp=ddp)
    except (ValueError, RuntimeError) as e:
        dist.barrier()
        return str(e)
    return "accepted"


@pytest.mark.parametrize("what,named", [
    ("1-D", "parameter with size: torch.Size([6]): parameter 2 of param group 0;"),
    ("named 1-D", "parameter with size: torch.Size([6]): '0.bias';"),
    ("twice", "2.weight"),
    ("late", "attached to a DDP module whose layout is already settled, with the fused_zero optimizers "
             "attached by its first forward (Muon)"),
    ("8-bit", "state_format='8bit' is not supported for Muon"),
])
def test_bad_splits_are_refused(what, named):
    for message in run_ranks(_refused, 2, what):
        assert named in message, message


def _scaled(rank: int, world: int, overlap: str, clip: float | None) -> dict:
    """Muon + AdamW through a GradScaler (fp32 model, scale 2^10), an inf on the last rank at step 3
    (the step is skipped on every rank and the scale halved), ``clip`` by the global norm; against
    torch.optim.Muon + AdamW with their own scaler, ``unscale_`` and ``clip_grad_norm_`` of every
    parameter."""
    case = Case(opt="Muon", overlap=overlap, bucket_cap_mb=TINY, max_grad_norm=clip)
    model, ddp, opt, ref_model, ref_ddp, ref_opt, _ = build(case, rank)
    opt._engine.close()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=TINY)
    scaler, ref_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2))
    opts = [getattr(fused_zero, kind)(groups, ddp=ddp, overlap=overlap, grad_scaler=scaler, max_grad_norm=clip)
            for kind, groups in optimizer_groups(model, case)]
    worst = 0.0
    for step in range(1, 9):
        for d, os_, sc in ((ref_ddp, ref_opt.opts, ref_scaler), (ddp, opts, scaler)):
            loss = loss_of(d, case, step, 0, rank)
            if step == 3 and rank == world - 1:
                loss = loss * float("inf")
            sc.scale(loss).backward()
            if os_ is ref_opt.opts and clip is not None:
                for o in os_:
                    sc.unscale_(o)
                torch.nn.utils.clip_grad_norm_(list(ref_model.parameters()), clip)
            for o in os_:
                sc.step(o)
            sc.update()
            for o in os_:
                o.zero_grad()
        opts[0].synchronize()
        assert scaler.get_scale() == ref_scaler.get_scale(), step
        for p, q in zip(model.parameters(), ref_model.parameters()):
            worst = max(worst, float((p.detach() - q.detach()).abs().max()))
    skipped = opts[0].skipped_steps
    opts[0]._engine.close()
    return {"worst": worst, "skipped": skipped}


@pytest.mark.parametrize("overlap,clip", [("step", None), ("backward", None), ("step", 0.05)])
def test_grad_scaler_and_clipping(overlap, clip):
    """Bit for bit without clipping (fused_zero's Muon unscales as GradScaler.unscale_ does, by the fp32
    reciprocal); with it, the global norm is summed in another order than clip_grad_norm_'s, so its
    coefficient may differ in the last bit: an fp32 ulp after 8 steps."""
    for out in run_ranks(_scaled, 2, overlap, clip):
        assert out["skipped"] == 1
        assert out["worst"] <= (0.0 if clip is None else 1e-6), out
