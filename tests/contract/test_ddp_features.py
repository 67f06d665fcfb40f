"""DDP's own options of newer torch releases, each with torch.optim's result (the contract suite:
conftest.py): torch 2.15's ``lazy_bucket_allocation=True`` (DDP allocates its buckets as gradients become
ready and frees its own storage after the backward) and ``require_manual_backward_finalization`` (DDP
writes the reduced gradients back into ``.grad`` when the user calls ``ddp.finalize_backward()``, which
fused_zero must not take for an edit of ``.grad``), alone and together, with gradients viewing the
buckets or not, in every overlap mode and reduction, at 2 ranks, bit for bit. Skipped, naming the torch
release, where DDP has no such option."""

from __future__ import annotations

import inspect

import pytest
import torch
from distributed import run_ranks
from harness import optimizer, twin
from torch.nn.parallel import DistributedDataParallel as DDP

MODES = [(o, r) for o in ("bucket", "backward", "step") for r in ("reduce_scatter", "all_reduce")]
HAS_2_15 = "lazy_bucket_allocation" in inspect.signature(DDP).parameters and hasattr(DDP, "finalize_backward")


def _case(rank, world, mode, lazy, manual, as_view):
    overlap, reduce = mode

    def make(model, ddp, fused, run):
        if manual:
            ddp.require_manual_backward_finalization = True
        params = [p for p in model.parameters() if p.requires_grad]
        return [optimizer("AdamW", params, fused, ddp=ddp, overlap=overlap, grad_reduce=reduce) if fused else
                optimizer("AdamW", params, False)]

    def loop(run, step):
        run.loss(step).backward()
        if manual:
            run.ddp.finalize_backward()
        run.opts[0].step()
        run.opts[0].zero_grad(set_to_none=step % 2 == 0)
    twin(rank, world, loop, make, ddp_kw={"lazy_bucket_allocation": lazy, "gradient_as_bucket_view": as_view})
    return "ok"


def _cases(rank, world):
    return [(mode, lazy, manual, as_view, _case(rank, world, mode, lazy, manual, as_view))
            for mode in MODES for lazy, manual in ((True, False), (False, True), (True, True))
            for as_view in (False, True)]


@pytest.mark.skipif(not HAS_2_15, reason=f"torch {torch.__version__}'s DDP has no lazy_bucket_allocation or "
                                         "finalize_backward (torch 2.15 on)")
def test_lazy_buckets_and_manual_backward_finalization():
    for results in run_ranks(_cases, 2):
        assert all(r[-1] == "ok" for r in results), results
