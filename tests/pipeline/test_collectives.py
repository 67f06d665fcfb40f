"""The flat-tensor collectives under this torch's names (pipeline/collectives.py): torch 2.13 has
``reduce_scatter_single`` / ``all_gather_single``, 2.11 only ``reduce_scatter_tensor`` /
``all_gather_into_tensor``. .ci/run runs the distributed tests on both, so both sides run; this says
which one this torch takes."""

import torch.distributed as dist

from fused_zero.pipeline import collectives


def test_the_names_this_torch_has():
    if hasattr(dist, "reduce_scatter_single"):
        assert collectives._reduce_scatter is dist.reduce_scatter_single
        assert collectives._all_gather is dist.all_gather_single
    else:
        assert collectives._reduce_scatter is dist.reduce_scatter_tensor
        assert collectives._all_gather is dist.all_gather_into_tensor
