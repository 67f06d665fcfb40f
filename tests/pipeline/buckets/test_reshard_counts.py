"""How many 8-bit codes a reshard changes: DDP's bucket rebuild, and a load at another world size.

An 8-bit block is a kernel row, and rows are cut at a grid in each parameter's own element space
(kernels/segments.py), so two layouts share every block that no shard edge (or bucket, vector phase)
cuts differently. A reshard decodes and re-encodes the moments; a block the new layout shares with the
old comes out with the very codes and scale it had (the scale is the block's largest magnitude, whose
code is exactly 1), and only the others are encoded anew. Measured here, on every rank together: the
elements in blocks the new layout does not share (re-encoded) and those whose decoded value moved
(changed), with the shared blocks checked bit for bit. docs/compact-state.md gives the numbers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from distributed import run_ranks
from scenarios import VOCAB, OddNet, batch
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.algorithms.codecs import SIGNED, decode8
from fused_zero.kernels import BLOCK


class Round(nn.Module):
    """A small LM whose every size is a multiple of 4, as in real models: the vector phase of every
    parameter is 0 in any bucket order, so only shard and bucket edges cut blocks differently."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.l1 = nn.Linear(64, 256)
        self.norm = nn.LayerNorm(256)
        self.l2 = nn.Linear(256, 64)
        self.head = nn.Linear(64, 256, bias=False)

    def forward(self, x, use_branch: bool = False):
        h = self.emb(x)
        return self.head(h + self.l2(torch.tanh(self.norm(self.l1(h)))))


MODELS = {"OddNet": (OddNet, VOCAB), "Round": (Round, 256)}


def blocks(opt) -> dict[tuple, tuple[torch.Tensor, float]]:
    """Every rank's 8-bit blocks, ``(moment, pid, first element, length) -> (codes, scale)``."""
    mine = {}
    for shard in opt._engine.shards():
        for part in shard.parts:
            for name, scales in part.scales.items():
                codes = part.state[name]
                for so, n, _, _, pid, elem, _, block in part.table.tolist():
                    mine[(name, pid, elem, n)] = (codes[so:so + n].clone(), float(scales[block]))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for d in every for k, v in d.items()}


def decoded(every: dict) -> dict[tuple, torch.Tensor]:
    """Each moment of each parameter decoded from ``blocks``: ``(moment, pid) -> fp32 elements``."""
    out: dict[tuple, dict[int, torch.Tensor]] = {}
    for (name, pid, elem, _), (codes, scale) in every.items():
        out.setdefault((name, pid), {})[elem] = decode8(codes, SIGNED[name]) * scale
    return {k: torch.cat([runs[e] for e in sorted(runs)]) for k, runs in out.items()}


def counts(before, after) -> dict:
    """Elements re-encoded (in blocks ``after`` does not share with ``before``), elements whose value
    changed, all elements, and whether every shared block kept its codes and scale."""
    values_before, values_after = decoded(before), decoded(after)
    shared = [k for k in after if k in before]
    verbatim = all(torch.equal(before[k][0], after[k][0]) and before[k][1] == after[k][1] for k in shared)
    reencoded = sum(k[3] for k in after if k not in before)
    changed = sum(int((values_before[k] != values_after[k]).sum()) for k in values_after)
    total = sum(t.numel() for t in values_after.values())
    return {"reencoded": reencoded, "changed": changed, "total": total, "verbatim": verbatim,
            "blocks": len(after), "shared": len(shared)}


def _train(model_name, rank, cap, steps, **kw):
    net, vocab = MODELS[model_name]
    torch.manual_seed(1234)
    model = net()
    if hasattr(model, "never"):
        model.never.requires_grad_(False)  # no step uses it
    ddp = DDP(model, bucket_cap_mb=cap)
    opt = fused_zero.AdamW(ddp.parameters(), ddp=ddp, lr=1e-2, state_format="8bit", overlap="step",
                           _backend="torch", **kw)

    def backward(step):
        x, y = batch(step, 0, rank)
        x, y = x % vocab, y % vocab
        F.cross_entropy(ddp(x, use_branch=True).float().reshape(-1, vocab), y.reshape(-1)).backward()

    for step in range(1, steps + 1):
        backward(step)
        opt.step()
        opt.zero_grad()
    return ddp, opt, backward


def _rebuild(rank, world, model_name, cap):
    """One step in DDP's first buckets, then the next backward: DDP rebuilds its buckets and the state
    moves to them (overlap "step": nothing updates it before ``step()``)."""
    _, opt, backward = _train(model_name, rank, cap, steps=1)
    before = blocks(opt)
    changes = opt._engine.registry.layout_changes
    backward(2)
    assert opt._engine.registry.layout_changes > changes  # the rebuild moved the state
    out = counts(before, blocks(opt))
    opt._engine.close()
    return out


@pytest.mark.parametrize("cap", [0.0001, 0.002, 25.0])
@pytest.mark.parametrize("model_name", ["OddNet", "Round"])
def test_ddp_rebuild_reencodes_only_the_blocks_it_cuts_anew(model_name, cap):
    out = run_ranks(_rebuild, 2, model_name, cap)[0]
    print(f"\n{model_name} cap {cap}: {out}")
    assert out["verbatim"], "a block both layouts share came out with other codes or another scale"
    assert out["changed"] <= out["reencoded"] < out["total"]
    if model_name == "Round":  # every parameter's phase is 0: only the edges' blocks are new
        assert out["reencoded"] <= 4 * BLOCK


def _save(rank, world, model_name, path):
    import torch.distributed.checkpoint as dcp
    ddp, opt, backward = _train(model_name, rank, 25.0, steps=3)
    dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
    out = (ddp.module.state_dict(), blocks(opt))
    opt._engine.close()
    return out


def _load(rank, world, model_name, path, weights, saved_blocks):
    """A load at another world size into a DDP module that has rebuilt its buckets (a load before the
    rebuild holds the moments in fp32 until it: the same codes, one step later)."""
    import torch.distributed.checkpoint as dcp
    ddp, opt, backward = _train(model_name, rank, 25.0, steps=1)
    backward(2)
    opt.zero_grad()
    ddp.module.load_state_dict(weights)
    target = opt.sharded_state_dict()
    dcp.load(target, checkpoint_id=path)
    opt.load_sharded_state_dict(target)
    out = counts(saved_blocks, blocks(opt))
    opt._engine.close()
    return out


@pytest.mark.parametrize("model_name", ["OddNet", "Round"])
def test_a_load_at_another_world_size_reencodes_only_the_blocks_it_cuts_anew(tmp_path, model_name):
    path = str(tmp_path / "ckpt")
    weights, saved_blocks = run_ranks(_save, 2, model_name, path)[0]
    for world in (1, 4):
        out = run_ranks(_load, world, model_name, path, weights, saved_blocks)[0]
        print(f"\n{model_name} 2 -> {world} ranks: {out}")
        assert out["verbatim"], "a block both layouts share came out with other codes or another scale"
        assert out["changed"] <= out["reencoded"] < out["total"]
        if model_name == "Round":
            assert out["reencoded"] <= 2 * (world + 2) * BLOCK
