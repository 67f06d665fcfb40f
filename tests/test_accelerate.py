"""fused_zero.accelerate on 2 gloo ranks launched as `accelerate launch` does: an Accelerate loop with
gradient accumulation and a scheduler matches Accelerate + torch.optim.AdamW after every step, clipping
is routed to the optimizer, save_state/load_state resume bit-identically, refusals carry a message."""

import importlib.util

import pytest
from distributed import run_ranks

from fused_zero.spawn import _free_port

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                reason="the accelerate extra is not installed: pip install 'fused-zero[accelerate]'")


def test_accelerate_attach(tmp_path):
    from accelerate_cases import run

    for r in run_ranks(run, 2, _free_port(), str(tmp_path)):
        assert r["distributed"] == "DistributedType.MULTI_CPU"
        assert r["plain"] == [], r["plain"]
        assert r["clip"] == [] and r["clip_moved"] and r["clip_returned"], r["clip"]
        assert r["resume"] == [], r["resume"]
        assert r["refusals"] == ["ok"] * 5, r["refusals"]
