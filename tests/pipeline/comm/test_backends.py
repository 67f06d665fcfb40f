"""Which backend runs a device's tensors (pipeline/comm/collectives.py): every backend-dependent choice asks per
device, so it follows the backend that actually runs that device's tensors.

- ``test_choices_per_device_on_a_gpu_machine``: what a process group reports on a GPU machine after
  ``init_process_group`` with "nccl", "cpu:gloo,cuda:nccl", no backend, and torch 2.14's NCCL variants
  "nccl2", "nccl-lazy", "nccl-legacy" (stubbed: no CUDA here, and
  a CPU build of torch cannot make an NCCL group): CUDA tensors take NCCL's choices (the reduce-scatter,
  its future handed to DDP, the all-gather, bf16 from NCCL 2.10), CPU tensors of the mixed group gloo's,
  and a device no backend runs is refused, naming the fix.
- ``test_bf16_reduction_after_init_with_no_backend``: 2 CPU ranks after ``init_process_group()`` with no
  backend (torch's default, "cpu:gloo" here), then with a mixed group's and an explicit "gloo" group's
  reports: ``grad_reduce_dtype`` bf16 and fp16 accepted and bit-identical to DDP + its compression
  hook + torch.optim.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from scenarios import Case, run_case

from fused_zero.pipeline.comm import collectives
from fused_zero.testing.streamcheck import backends

CUDA, CPU = torch.device("cuda", 1), torch.device("cpu")
GROUP = object()  # the stubbed reports answer for any group
OLDER_DEFAULT = ("undefined", "cpu:gloo,cuda:nccl")
"""``init_process_group()`` on a GPU machine before torch listed the accelerator's default only."""


@pytest.mark.parametrize("reports", [backends.GPU_REPORTS[b] for b in backends.GPU_REPORTS] + [OLDER_DEFAULT],
                         ids=[str(b) for b in backends.GPU_REPORTS] + ["older default"])
def test_choices_per_device_on_a_gpu_machine(reports):
    with backends.reported(*reports):
        assert collectives.backend_of(GROUP, CUDA) == "nccl"
        assert collectives.reduce_scatter_has_future(GROUP, CUDA)
        assert not collectives.all_reduce_replaces_reduce_scatter(GROUP, CUDA)
        assert not collectives.broadcast_replaces_all_gather(GROUP, CUDA)
        assert collectives.reduces_in(GROUP, torch.bfloat16, CUDA)
        if "cpu:gloo" in reports[1]:  # the mixed group's CPU tensors run on gloo
            assert collectives.backend_of(GROUP, CPU) == "gloo"
            assert not collectives.reduce_scatter_has_future(GROUP, CPU)
            assert collectives.all_reduce_replaces_reduce_scatter(GROUP, CPU)
            assert collectives.broadcast_replaces_all_gather(GROUP, CPU)
        else:
            with pytest.raises(ValueError, match=rf"no backend of the process group \({reports[1]}\) runs cpu tensors"):
                collectives.backend_of(GROUP, CPU)
    with backends.reported(*reports, nccl=(2, 9, 6)):
        assert not collectives.reduces_in(GROUP, torch.bfloat16, CUDA)  # NCCL sums bf16 from 2.10


def _reduced_in_16_bits(rank, world):
    """The default group's real reports, then a mixed group's and an explicit gloo group's (stubbed over
    the real gloo group): the backend of CPU tensors, and each case's result."""
    out = {"default": (str(dist.get_backend()), dist.get_backend_config(), collectives.backend_of(None, CPU))}
    bf16, fp16 = torch.bfloat16, torch.float16
    cases = {"default": [Case(overlap="bucket", reduce_dtype=bf16, bucket_cap_mb=0.0001, steps=6),
                         Case(overlap="step", grad_reduce="all_reduce", reduce_dtype=fp16, groups=2, steps=6)],
             "cpu:gloo,cuda:nccl": [Case(overlap="backward", reduce_dtype=bf16, bucket_cap_mb=0.0015, steps=6)],
             "gloo": [Case(overlap="step", reduce_dtype=bf16, bucket_cap_mb=0.0001, shard=1, steps=6)]}
    stubs = {"default": contextlib.nullcontext(), "gloo": backends.reported("gloo", "cpu:gloo,cuda:gloo"),
             "cpu:gloo,cuda:nccl": backends.reported(*backends.GPU_REPORTS["cpu:gloo,cuda:nccl"])}
    for name, todo in cases.items():
        with stubs[name]:
            out[name + " backend"] = collectives.backend_of(None, CPU)
            out[name + " cases"] = [(case.name(), run_case(case, rank, world)["worst"]) for case in todo]
    return out


def test_bf16_reduction_after_init_with_no_backend():
    for rank, out in enumerate(run_ranks(_reduced_in_16_bits, 2, backend=None)):
        assert out["default"][:2] == ("undefined", "cpu:gloo") and out["default"][2] == "gloo", (rank, out)
        for name in ("default", "cpu:gloo,cuda:nccl", "gloo"):
            assert out[name + " backend"] == "gloo", (rank, name, out)
            # run_case asserts torch.equal with DDP + the compression hook at every step (W=2: exact)
            assert all(worst == 0.0 for _, worst in out[name + " cases"]), (rank, name, out[name + " cases"])
