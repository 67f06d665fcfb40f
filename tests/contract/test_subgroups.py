"""DDP on process subgroups of a 4-rank world, as torch's own DDP tests lay them out (``{0, 2}, {1, 3}``)
and as nodes do (``{0, 1}, {2, 3}``): every group fused_zero makes is made by its own members, never as
a collective of ranks outside DDP's group (the contract suite: conftest.py).

Each replica group trains its own model against DDP + torch.optim on the same subgroup: every overlap
mode and reduction, with shard groups of one rank (each rank a replica: its shard group made by itself,
the replicas' all-reduce on DDP's subgroup), Muon beside AdamW, and fused_zero on one subgroup only
while the other trains with torch.optim.
"""

from __future__ import annotations

import torch.distributed as dist
from distributed import run_ranks
from harness import models, optimizer, split, twin
from test_several_optimizers import MATRICES, MODES, _plain_loop

LAYOUTS = {"strided": [[0, 2], [1, 3]], "blocks": [[0, 1], [2, 3]]}


def _make(kinds, names, fused_here: bool, **options):
    def make(model, ddp, fused, run):
        first, rest = split(model, names)
        use = fused and fused_here
        opts = dict(ddp=ddp, **options) if use else {}
        return [optimizer(kinds[0], first, use, **opts), optimizer(kinds[1], rest, use, **opts)]
    return make


def _subgroups(rank, world, layout, cases):
    groups = [dist.new_group(ranks) for ranks in LAYOUTS[layout]]  # every rank makes both, as torch's tests do
    mine = next(i for i, ranks in enumerate(LAYOUTS[layout]) if rank in ranks)
    out = []
    for kinds, mode, shard, fused_groups in cases:
        overlap, reduce = mode
        names = MATRICES if kinds[0] == "Muon" else ("emb", "l1", "norm")
        options = dict(overlap=overlap, grad_reduce=reduce, shard_group=shard)
        twin(rank, world, _plain_loop, _make(kinds, names, mine in fused_groups, **options), steps=4,
             group=groups[mine])
        out.append((kinds, mode, shard, "ok"))
    return out


def test_ddp_on_strided_subgroups():
    """``{0, 2}`` and ``{1, 3}``: every mode, flat and with shard groups of one; Muon + AdamW in three
    modes; fused_zero on ``{0, 2}`` only (``{1, 3}`` trains with torch.optim) in two."""
    cases = [(("AdamW", "SGD"), mode, shard, (0, 1)) for mode in MODES for shard in (None, 1)]
    cases += [(("Muon", "AdamW"), mode, None, (0, 1)) for mode in MODES[::2]]
    cases += [(("AdamW", "SGD"), mode, None, (0,)) for mode in (MODES[0], MODES[-1])]
    for results in run_ranks(_subgroups, 4, "strided", cases):
        assert all(r[-1] == "ok" for r in results), results


def test_ddp_on_blocks_of_ranks():
    """``{0, 1}`` and ``{2, 3}``: the three overlap modes, Muon + AdamW in one."""
    cases = [(("AdamW", "SGD"), mode, None, (0, 1)) for mode in MODES[1::2]]
    cases += [(("Muon", "AdamW"), MODES[2], 1, (0, 1))]
    for results in run_ranks(_subgroups, 4, "blocks", cases):
        assert all(r[-1] == "ok" for r in results), results


def _uneven_history(rank, world):
    groups = [dist.new_group(ranks) for ranks in LAYOUTS["strided"]]
    if rank == 0:  # a group of its own that rank 2, its DDP peer, does not make
        dist.new_group([0], use_local_synchronization=True)
    (model, ddp), _ = models({"process_group": groups[rank % 2]})
    try:
        optimizer("AdamW", list(ddp.parameters()), True, ddp=ddp, overlap="bucket")
    except ValueError as e:
        return str(e)
    return "built"


def test_a_subgroup_whose_ranks_made_different_groups_is_refused_not_hung():
    """The members of a group made by them alone must have made as many groups before (torch names it
    after that count): where they have not, construction refuses on every rank of DDP's group, saying so."""
    out = run_ranks(_uneven_history, 4)
    assert out[1] == out[3] == "built", out
    for message in (out[0], out[2]):
        assert "different numbers of process groups" in message, message


def _history(rank, world, scenario):
    """Groups made before DDP's: "A", every rank makes ``{0, 1}`` (ranks 2 and 3 are not in it); "B", A and
    then rank 2 alone a group of its own. Returns whether torch would give the next group made by
    ``{0, 2}`` alone the same name on both (its own naming function), and what building the optimizer did."""
    groups = [dist.new_group(ranks) for ranks in LAYOUTS["strided"]]
    dist.new_group([0, 1])
    if scenario == "B" and rank == 2:
        dist.new_group([2], use_local_synchronization=True)
    name = dist.distributed_c10d._hash_ranks_to_str([0, 2])
    (model, ddp), _ = models({"process_group": groups[rank % 2]})
    try:
        opt = optimizer("AdamW", list(ddp.parameters()), True, ddp=ddp, overlap="bucket")
        outcome = "built"
        opt._engine.close()
    except ValueError as e:
        outcome = str(e)
    names = [None] * world
    dist.all_gather_object(names, name)
    return names[0] == names[2], outcome


def test_the_group_count_is_the_one_the_installed_torch_names_groups_by():
    """torch 2.13 names a group made by its members alone after the groups a rank registered; 2.14 on, after
    the group creations it reached (members or not). Where {0, 2}'s next name agrees on both ranks the
    optimizer builds (an needless refusal before); where it does not, it refuses on both instead of the
    ranks waiting for each other forever."""
    for scenario in ("A", "B"):
        out = run_ranks(_history, 4, scenario)
        agree, built = out[0][0], [o[1] for o in out]
        assert out[2][0] == agree, out
        if agree:
            assert built[0] == built[2] == "built", (scenario, built)
        else:
            for message in (built[0], built[2]):
                assert "different numbers of process groups" in message, (scenario, message)
