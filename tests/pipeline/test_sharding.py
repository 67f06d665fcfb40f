"""Sharding within groups and replicating across them (``shard_group``), and gradients reduced in 16 bits
(``grad_reduce_dtype``), against DDP + torch.optim and DDP + its own ``bf16_compress_hook`` /
``fp16_compress_hook`` + torch.optim: every parameter of every rank after each of 12 steps.

- ``test_shard_groups_four_ranks``: W=4 in shard groups of 2 (2 replicas), every overlap mode x both
  reductions x both reduction plans (gloo's one all-reduce; NCCL's reduce-scatter in the group and
  all-reduce across replicas, forced on gloo), the bucket size rotating; the group given as an int, a
  ProcessGroup and a 2-D DeviceMesh; bf16 parameters; groups of 1 (every rank a replica); clipping by
  the global norm (each element counted once, not once per replica). The optimizer
  state each rank holds is 1/S of torch.optim's plus the replicated tails, exactly.
- ``test_grad_reduce_dtype``: at W=2, 3 and 4 (flat and in shard groups of 2), every overlap mode x both
  reductions in bf16, fp16 cases; bit-identical (``torch.equal``) to DDP + ``bf16_compress_hook`` /
  ``fp16_compress_hook`` on gloo's plan at every W, three included (where dividing by W rounds, so
  dividing after the sum or in fp32 before the cast shows), within the bound ``_compare_reduced``
  states for NCCL's plan (its sums run in another order, each rounded to bf16).
- ``test_refusals_and_membership``: shard groups that do not tile DDP's group, a reduce dtype that is not
  16-bit, a backend that cannot sum bf16: refused at construction on every rank, naming the fix; and
  on every rank, the members of its shard and replica groups: consecutive ranks for ``shard_group=2``
  at W=4, a DeviceMesh's own rows.
"""

import itertools

import torch
import torch.distributed as dist
from distributed import run_ranks
from expect import refusal
from scenarios import Case, OddNet, run_cases
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.pipeline.comm import collectives

TINY, TWO, ONE = 0.0001, 0.0015, 25.0
OVERLAPS = ("bucket", "backward", "step")
REDUCES = ("reduce_scatter", "all_reduce")
MODES = list(itertools.product(OVERLAPS, REDUCES))
bf16 = torch.bfloat16


def check_state_per_rank(case: Case, out: dict) -> None:
    """Each rank's state, exactly: per bucket its slice (1/S of the head, ``(numel - tail) / S``), the
    replicated tail (fewer than S x 32 elements) and fewer than 2 x 3 alignment elements; in all, 1/S of
    torch.optim's state plus the tails."""
    size = {None: 4, 1: 1}.get(case.shard, 2)
    extra = 0
    for numel, world_size, tail, region in out["layouts"]:
        assert world_size == size, (case.name(), world_size)
        assert (numel - tail) % size == 0 and tail < size * 32, (case.name(), numel, tail)
        assert 0 <= region - tail - (numel - tail) // size <= 6, (case.name(), numel, tail, region)
        extra += region - (numel - tail) // size
    mem = out["memory"]
    assert mem["region_elements"] == sum(r for *_, r in out["layouts"])
    per_element = mem["reference_state"] // mem["elements"]  # torch.optim's bytes per element
    assert mem["state"] == per_element * mem["region_elements"]
    assert mem["state"] * size <= mem["reference_state"] + size * per_element * extra


def shard_cases():
    cases = [Case(overlap=o, grad_reduce=r, bucket_cap_mb=b, shard=2, plan=plan, groups=2)
             for ((o, r), b), plan in itertools.product(zip(MODES, itertools.cycle((TINY, TWO, ONE))),
                                                        ("auto", "nccl"))]
    cases += [Case(overlap="backward", bucket_cap_mb=TINY, shard="group:2", plan="nccl"),
              Case(overlap="step", grad_reduce="all_reduce", bucket_cap_mb=TWO, shard="mesh:2"),
              Case(dtype=bf16, bucket_cap_mb=TINY, shard=2),
              Case(overlap="step", bucket_cap_mb=TINY, shard=1, plan="nccl", param_sync="forward"),
              Case(opt="SGD", graph="find_unused", bucket_cap_mb=TINY, shard=2, plan="nccl"),
              # the global norm counts every element once: slices on the first replica, tails on one rank
              Case(overlap="step", bucket_cap_mb=TINY, shard=2, plan="nccl", max_grad_norm=0.05),
              Case(overlap="backward", bucket_cap_mb=TWO, shard=2, max_grad_norm=0.05)]
    return cases


def reduce_cases(world: int):
    if world == 3:  # exact on gloo's plan; NCCL's (a reduce-scatter of 3) within _compare_reduced's bound
        return [Case(overlap="bucket", bucket_cap_mb=TINY, reduce_dtype=bf16),
                Case(overlap="backward", bucket_cap_mb=TWO, reduce_dtype=bf16),
                Case(overlap="step", grad_reduce="all_reduce", bucket_cap_mb=TINY, reduce_dtype=bf16),
                Case(overlap="backward", bucket_cap_mb=TINY, reduce_dtype=torch.float16, groups=2),
                Case(overlap="step", bucket_cap_mb=TINY, reduce_dtype=bf16, plan="nccl")]
    if world == 2:
        cases = [Case(overlap=o, grad_reduce=r, bucket_cap_mb=b, reduce_dtype=bf16)
                 for (o, r), b in zip(MODES, itertools.cycle((TINY, TWO, ONE)))]
        cases += [Case(overlap="bucket", bucket_cap_mb=TINY, reduce_dtype=bf16, plan="nccl"),
                  Case(overlap="step", bucket_cap_mb=TWO, reduce_dtype=torch.float16, groups=2)]
        return cases
    return [Case(overlap=o, grad_reduce=r, bucket_cap_mb=b, reduce_dtype=bf16, shard=shard, plan=plan)
            for ((o, r), b), (shard, plan) in zip(zip(MODES, itertools.cycle((TINY, TWO, ONE))),
                                                  itertools.cycle(((None, "auto"), (2, "auto"), (2, "nccl"))))]


def run_and_check(world, cases, state=False):
    for rank_results in run_ranks(run_cases, world, cases):
        for case, (name, out) in zip(cases, rank_results):
            assert name == case.name()
            if state:
                check_state_per_rank(case, out)


def test_shard_groups_four_ranks():
    run_and_check(4, shard_cases(), state=True)


def test_grad_reduce_dtype():
    run_and_check(2, reduce_cases(2))
    run_and_check(3, reduce_cases(3))
    run_and_check(4, reduce_cases(4))


def refusals(rank, world):
    torch.manual_seed(0)
    model = OddNet()
    model.never.requires_grad_(False)
    ddp = DDP(model)
    build = lambda **kw: fused_zero.AdamW(ddp.parameters(), ddp=ddp, **kw)  # noqa: E731
    odd = dist.new_group([0, 1, 2])
    alone = dist.new_group([3])
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    crossed = [dist.new_group([0, 1]), dist.new_group([1, 2])]
    out = {
        "size 3": refusal(lambda: build(shard_group=3), ValueError, r"shard_group=3 does not tile .* 4 ranks.*1, 2, 4"),
        "size 0": refusal(lambda: build(shard_group=0), ValueError, "shard_group=0"),
        "unequal groups": refusal(lambda: build(shard_group=odd if rank < 3 else alone), ValueError,
                                  r"sizes \[1, 3\]"),
        "overlapping groups": refusal(lambda: build(shard_group=crossed[0] if rank < 2 else crossed[1] if rank == 2
                                                    else pairs[1]), ValueError, "shard_group: rank"),
        "a string": refusal(lambda: build(shard_group="node"), TypeError, "int .*ProcessGroup or a DeviceMesh"),
        "float64 reduce": refusal(lambda: build(grad_reduce_dtype=torch.float64), ValueError, "grad_reduce_dtype"),
    }
    real = collectives.REDUCE_DTYPES["gloo"]
    collectives.REDUCE_DTYPES["gloo"] = (torch.float32,)
    try:
        out["backend without bf16"] = refusal(lambda: build(grad_reduce_dtype=bf16), ValueError,
                                              "'gloo' backend .* cannot sum torch.bfloat16")
    finally:
        collectives.REDUCE_DTYPES["gloo"] = real
    # a refused optimizer left DDP as it was: a good one attaches afterwards
    opt = build(shard_group=pairs[rank // 2])
    out["tiling groups accepted"] = "ok" if opt._engine.topology.replicas == 2 else "not 2 replicas"
    return {**out, **memberships(rank)}


def memberships(rank) -> dict:
    """Who shares this rank's traffic: the members of its shard group and of its replica group, as the
    topology lists them and as their process groups hold them. ``shard_group=2`` gives consecutive ranks
    (a node's); a DeviceMesh its own rows, here strided ones."""
    from torch.distributed.device_mesh import DeviceMesh

    out = {}
    for name, spec, shards in (("int 2", lambda: 2, ((0, 1), (2, 3))),
                               ("mesh rows", lambda: DeviceMesh("cpu", [[0, 2], [1, 3]]), ((0, 2), (1, 3)))):
        torch.manual_seed(0)
        model = OddNet()
        model.never.requires_grad_(False)
        ddp = DDP(model)
        topo = fused_zero.AdamW(ddp.parameters(), ddp=ddp, shard_group=spec())._engine.topology
        mine = next(m for m in shards if rank in m)
        expected = (shards, mine, tuple(m[mine.index(rank)] for m in shards), mine.index(rank))
        got = (topo.shards, tuple(dist.get_process_group_ranks(topo.shard_group)),
               tuple(dist.get_process_group_ranks(topo.replica_group)), dist.get_rank(topo.shard_group))
        out[f"membership {name}"] = "ok" if got == expected else \
            f"(shards, shard group, replica group, rank in it) {got}, expected {expected}"
    return out


def test_refusals_and_membership():
    for rank, out in enumerate(run_ranks(refusals, 4)):
        bad = {k: v for k, v in out.items() if v != "ok"}
        assert not bad, f"rank {rank}: {bad}"
