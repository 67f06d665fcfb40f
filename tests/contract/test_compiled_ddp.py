"""``torch.compile(ddp)`` under each value of ``torch._dynamo.config.optimize_ddp``, against DDP + torch.optim
under the same setting (the contract suite: conftest.py), OddNet at 2 ranks, bit for bit after every step
(4 steps: across DDP's bucket rebuild where it has buckets), backend "aot_eager":

- ``"ddp_optimizer"`` (the default): dynamo splits the forward at DDP's bucket boundaries;
- ``False``: one graph; DDP's C++ reducer hands its buckets to fused_zero's comm hook after it;
- ``"python_reducer"`` with compiled autograd (torch's way: ``compiled_autograd._enable`` around the
  backward): DDP reduces each ``param.grad`` from a per-parameter hook traced into the compiled backward,
  with no buckets; fused_zero then updates at ``step()`` from DDP's averaged gradients
  (pipeline/local.py). Before, fused_zero's comm hook raised ``TypeError: index expected at least 1
  argument, got 0`` from inside the backward, given DDP's ``(grad, param)`` for a bucket.

Each runs in processes of its own (``fresh=True``): dynamo's caches and its config are process-wide.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from harness import optimizer, twin
from scenarios import VOCAB, batch

SETTINGS = {"ddp_optimizer": True, "False": False, "python_reducer": "python_reducer"}


def _compiled(rank, world, setting):
    value = SETTINGS[setting]
    saved = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = value  # before the DDP modules are built: DDP reads it then

    def make(model, ddp, fused, run):
        run.keep["forward"] = torch.compile(ddp, backend="aot_eager")
        params = [p for p in model.parameters() if p.requires_grad]
        return [optimizer("AdamW", params, fused, ddp=ddp) if fused else optimizer("AdamW", params, False)]

    def loop(run, step):
        x, y = batch(step, 0, run.rank)
        loss = F.cross_entropy(run.keep["forward"](x, use_branch=True).float().reshape(-1, VOCAB), y.reshape(-1))
        if value == "python_reducer":
            with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
                loss.backward()
        else:
            loss.backward()
        run.opts[0].step()
        run.opts[0].zero_grad()

    try:
        torch._dynamo.reset()
        twin(rank, world, loop, make, steps=4)
    finally:
        torch._dynamo.config.optimize_ddp = saved
    return "ok"


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_compiled_ddp(setting):
    assert run_ranks(_compiled, 2, setting, fresh=True) == ["ok", "ok"]
