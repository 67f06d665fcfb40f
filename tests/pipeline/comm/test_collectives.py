"""The flat-tensor collectives under this torch's names (pipeline/comm/collectives.py): torch 2.13 has
``reduce_scatter_single`` / ``all_gather_single``, 2.11 only ``reduce_scatter_tensor`` /
``all_gather_into_tensor``. .ci/run runs the distributed tests on both, so both sides run; this says
which one this torch takes."""

import torch.distributed as dist

from fused_zero.pipeline.comm import collectives


def test_the_names_this_torch_has():
    if hasattr(dist, "reduce_scatter_single"):
        assert collectives._reduce_scatter is dist.reduce_scatter_single
        assert collectives._all_gather is dist.all_gather_single
    else:
        assert collectives._reduce_scatter is dist.reduce_scatter_tensor
        assert collectives._all_gather is dist.all_gather_into_tensor


def _gathers(rank, world):
    """Every shape of call fused_zero makes, through ``collectives.all_gather`` (gloo: broadcasts) and
    through torch's all-gather, over the world and over a subgroup of the last two ranks."""
    import torch

    out = {}
    sub = dist.new_group([1, 2])
    for name, group, members in (("world", None, range(world)), ("sub", sub, [1, 2])):
        if rank not in members:
            continue
        size, me = dist.get_world_size(group), dist.get_rank(group)
        n = 5
        base = torch.arange(size * n, dtype=torch.float32) + 100 * rank
        inplace = base.clone()
        work = collectives.all_gather(inplace, inplace[me * n:(me + 1) * n], group)  # fused_zero's call
        work.wait()
        copied = torch.full((size, n), -1.0)
        collectives.all_gather(copied, base[:n].clone() + 1000, group, async_op=False)
        ref_inplace, ref_copied = torch.empty(size * n), torch.empty(size * n)
        collectives._all_gather(ref_inplace, base[me * n:(me + 1) * n].clone(), group=group)
        collectives._all_gather(ref_copied, base[:n].clone() + 1000, group=group)
        out[name] = (torch.equal(inplace, ref_inplace), torch.equal(copied.view(-1), ref_copied),
                     collectives.broadcast_replaces_all_gather(group, inplace.device))
    return out


def test_gloo_all_gather_by_broadcasts_matches_torch():
    from distributed import run_ranks

    for rank, res in enumerate(run_ranks(_gathers, 3)):
        assert res["world"] == (True, True, True), rank
        if rank:
            assert res["sub"] == (True, True, True), rank
