"""Checkpoints of fused_zero's twins of torch.optim's elementwise optimizers (optimizer/twins.py): each
trained at two ranks and saved whole on rank 0 (``state_dict(to=0)``) and through DCP; the dict is
torch.optim's own, entry for entry, bit for bit, in torch's order. At three ranks and at one, with other
buckets, torch.optim loads fused_zero's dict and fused_zero torch.optim's, and both continue in parity
step by step; then fused_zero continues from the DCP checkpoint, resharded."""

import os

import torch
from ckpt_scenarios import dcp_save, load_and_continue, train_both
from distributed import run_ranks
from scenarios import Case, build

from fused_zero.optimizer import TWINS

ALL = (*TWINS, "Adafactor")

TINY, TWO, ONE = 0.0001, 0.0015, 25.0


def _save_at_two(rank, world, path):
    """Each twin trained 4 steps: ours saved whole on rank 0 and through DCP, torch.optim's saved too."""
    for name in ALL:
        case = Case(opt=name, bucket_cap_mb=TINY, groups=2)
        built = build(case, rank)
        model, ddp, opt, ref_model, ref_ddp, ref_opt, _ = built
        train_both(case, built, rank, 4)
        canonical = opt.state_dict(to=0)
        assert (canonical is None) == (rank != 0)
        if rank == 0:
            torch.save({"model": model.state_dict(), "ours": canonical, "torch": ref_opt.state_dict()},
                       os.path.join(path, f"{name}.pt"))
        dcp_save(opt, os.path.join(path, f"{name}-dcp"))
        opt._engine.close()
    return "ok"


def _load_elsewhere(rank, world, path, bucket_cap_mb):
    """At another world size and bucket size, for each twin: torch.optim loads fused_zero's dict and
    fused_zero torch.optim's, then both continue, compared step by step; then fused_zero from DCP."""
    for name in ALL:
        saved = torch.load(os.path.join(path, f"{name}.pt"))
        swapped = {"model": saved["model"], "ours": saved["torch"], "torch": saved["ours"]}
        load_and_continue(Case(opt=name, bucket_cap_mb=bucket_cap_mb, groups=2), rank, swapped,
                          os.path.join(path, f"{name}-dcp"))
    return "ok"


def test_checkpoints_both_ways_at_other_world_sizes(tmp_path):
    path = str(tmp_path)
    assert run_ranks(_save_at_two, 2, path) == ["ok"] * 2
    for name in ALL:  # the two dicts are one: torch.optim's entries, bit for bit, in torch's order
        saved = torch.load(os.path.join(path, f"{name}.pt"))
        frozen = set(saved["torch"]["state"]) - set(saved["ours"]["state"])  # Adagrad's, of the frozen layer
        assert len(frozen) == (2 if name == "Adagrad" else 0), (name, frozen)
        assert set(saved["ours"]["state"]) <= set(saved["torch"]["state"]), name
        for i, entry in saved["torch"]["state"].items():
            if i in frozen:
                continue
            assert list(saved["ours"]["state"][i]) == list(entry), (name, i)
            for key, value in entry.items():
                assert torch.equal(saved["ours"]["state"][i][key], value), (name, i, key)
        drop = "foreach"  # the reference is built with foreach=False (single-tensor: the CPU's exact oracle)
        assert [{k: v for k, v in g.items() if k != drop} for g in saved["ours"]["param_groups"]] == \
            [{k: v for k, v in g.items() if k != drop} for g in saved["torch"]["param_groups"]], name
    assert run_ranks(_load_elsewhere, 3, path, ONE) == ["ok"] * 3
    assert run_ranks(_load_elsewhere, 1, path, TWO) == ["ok"]
