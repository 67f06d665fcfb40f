"""A rank-0-only ``state_dict()`` while the other ranks' hosts run ahead, as they do under NCCL
(checkpoint/serving/published.py): nothing blocks their host in the next iteration, so each of them finishes
``step()`` N+1 on the host and publishes version N+1 while its device still holds version N (its N+1
updates queued behind a reduction rank 0 has not joined), and its shards may hold new state tensors on
the host by then (a reshard after DDP's bucket rebuild, the arenas' packing) that the device has not
written yet.

On gloo the hosts block, so the run-ahead is played: after step N every non-zero rank publishes more
versions as a host that ran ahead does, each time giving its shards new state tensors holding NaN (what
an unwritten region holds) and events that have not passed (the device is still behind the reduction
rank 0 has not joined); then rank 0 alone asks for version N, which must be torch.optim's at step N.
The step path has no host wait, so nothing bounds how far a host runs ahead: 1 and 4 versions. In every
overlap mode, at 2 ranks, and at 4 ranks flat and in shard groups of 2, before and after DDP's bucket
rebuild and the arenas' packing."""

import torch
import torch.distributed as dist
from distributed import run_ranks
from scenarios import Case, build
from test_rank0_state_dict import _assert_matches_torch, _train_both

DEPTHS = (1, 4)
MODES = ("bucket", "backward", "step")


class _NotRun:
    """An event the device has not reached: queued behind a reduction another rank has not joined."""

    def query(self) -> bool:
        return False


def _unwritten(tensors: dict) -> dict:
    return {n: torch.full_like(t, float("nan")) if t.is_floating_point() else torch.zeros_like(t)
            for n, t in tensors.items()}


def _run_ahead(opt, ahead: int):
    """Publish ``ahead`` more versions as a host that ran ahead does, each after its shards got new,
    unwritten state tensors on the host. Returns what undoes it (the host back where the device is)."""
    parts = [part for shard in opt._engine.shards() for part in shard.parts]
    saved = [(part.state, part.scales) for part in parts]
    for _ in range(ahead):
        for part in parts:
            part.state, part.scales = _unwritten(part.state), _unwritten(part.scales)
        opt._peers.versions.publish(opt._view, (_NotRun(),))

    def undo():
        for part, (state, scales) in zip(parts, saved):
            part.state, part.scales = state, scales
        versions = opt._peers.versions
        versions.newest -= ahead
        for _ in range(ahead):
            versions.kept.pop()
    return undo


def run_ahead_cases(rank, world, cases):
    """Each case: 4 steps, rank 0 alone asking for each step's version while every other rank's host
    is ahead by each depth. Returns the checkpoints served."""
    served = []
    for case in cases:
        built = build(case, rank)
        opt, ref_opt = built[2], built[5]
        for it in range(1, 5):
            _train_both(case, built, rank, it)
            for ahead in DEPTHS:
                undo = _run_ahead(opt, ahead) if rank != 0 else None
                dist.barrier()  # the others' hosts are ahead before rank 0 asks
                if rank == 0:
                    _assert_matches_torch(opt.state_dict(), ref_opt)
                    served.append((case.name(), it, ahead))
                dist.barrier()
                if undo is not None:
                    undo()
        opt._engine.close()
    return served


def _cases(shards):
    return [Case(opt="AdamW", overlap=mode, bucket_cap_mb=0.0001, shard=shard, steps=4)
            for mode in MODES for shard in shards]


def test_rank0_state_dict_while_the_other_hosts_run_ahead_at_2_ranks():
    served = run_ranks(run_ahead_cases, 2, _cases([None]))[0]
    assert len(served) == 3 * 4 * len(DEPTHS), served


def test_rank0_state_dict_while_the_other_hosts_run_ahead_at_4_ranks_flat_and_in_shard_groups():
    served = run_ranks(run_ahead_cases, 4, _cases([None, 2]))[0]
    assert len(served) == 3 * 2 * 4 * len(DEPTHS), served
