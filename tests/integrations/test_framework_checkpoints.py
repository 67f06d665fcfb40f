"""Lightning's ModelCheckpoint and Accelerate's save_state at 4 gloo ranks (one spawn for both): each
framework builds the checkpoint on every rank and writes it from rank 0 alone, so only rank 0 may gather
the optimizer's whole state. Measured on every rank during a save after one step (tests/memory.py, no
timing; Accelerate also with ``save_on_each_node``): the tensor bytes of the optimizer state the
framework got, and the peak of torch's allocations; the other ranks hold no optimizer tensors and
allocate less than their own shards. That every rank resumes bit for bit from the file rank 0 wrote is
test_lightning's and test_accelerate's, at 2 ranks."""

import importlib.util

import pytest
from distributed import run_ranks

from fused_zero.demo.spawn import _free_port

WORLD = 4
FRAMEWORKS = [name for name in ("lightning", "accelerate") if importlib.util.find_spec(name) is not None]
SAVES = {"lightning": 1, "accelerate": 2}  # Accelerate: by default, then with save_on_each_node

pytestmark = pytest.mark.skipif(not FRAMEWORKS, reason="neither the lightning nor the accelerate extra is "
                                "installed: pip install 'fused-zero[lightning,accelerate]'")


def checkpoint_in_both(rank: int, world: int, port: int, tmp: str) -> dict:
    out = {}
    if "lightning" in FRAMEWORKS:  # first: it runs in the spawner's process group, which Accelerate replaces
        from lightning_cases import checkpoint

        out["lightning"] = checkpoint(rank, world, tmp)
    if "accelerate" in FRAMEWORKS:
        from accelerate_cases import checkpoint

        out["accelerate"] = checkpoint(rank, world, port, tmp)
    return out


def test_only_the_writing_rank_holds_the_whole_state(tmp_path):
    results = run_ranks(checkpoint_in_both, WORLD, _free_port(), str(tmp_path), fresh=True)
    wrong = []
    for name in FRAMEWORKS:
        for rank, result in enumerate(results):
            saves = result[name]
            assert len(saves) == SAVES[name], (name, rank, saves)
            for i, save in enumerate(saves):
                if rank == 0:  # the writer holds the whole dict, and the measurement sees it
                    ok = save["held"] >= save["full"] and save["peak"] >= save["held"]
                else:
                    ok = save["held"] == 0 and save["peak"] < save["own"]
                if not ok:
                    wrong.append(f"{name} save {i} rank {rank}: {save}")
    assert wrong == [], wrong
