"""``optimizer.state_dict()`` called by rank 0 alone, as nanoGPT's train.py does under ``if master_process:``:
it works (the other ranks join the gathers from their next backward), the all-ranks call keeps working,
and every misuse fails on every rank instead of hanging. The oracle is torch.optim trained side by side
under plain DDP with the same loop."""

import io
import time

import torch
from ckpt_scenarios import assert_same_state
from distributed import run_ranks
from scenarios import Case, OddNet, _compare, _reference_step, build, loss_of, param_groups
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.checkpoint import rank0


def _iteration(case, d, rank, it):
    """case.accumulate micro-steps, synced on the last one as nanoGPT does."""
    for micro in range(case.accumulate):
        d.require_backward_grad_sync = micro == case.accumulate - 1
        (loss_of(d, case, it, micro, rank) / case.accumulate).backward()


def _train_ours(case, built, rank, it):
    _, ddp, opt, *_ = built
    _iteration(case, ddp, rank, it)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _train_ref(case, built, rank, it):
    _, _, _, ref_model, ref_ddp, ref_opt, masters = built
    _iteration(case, ref_ddp, rank, it)
    _reference_step(ref_model, ref_opt, masters, case)


def _assert_matches_torch(sd, ref_opt):
    """The saved dict against torch.optim's own at the same step: every state tensor, step and group."""
    theirs = ref_opt.state_dict()
    assert_same_state(sd["state"], theirs["state"])
    for ours, ref in zip(sd["param_groups"], theirs["param_groups"]):
        assert ours["lr"] == ref["lr"] and ours["params"] == ref["params"]


def _saved_and_loaded(sd):
    buf = io.BytesIO()
    torch.save({"optimizer": sd, "iter_num": 0}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["optimizer"]


# iteration -> how state_dict() is called after it: (ranks calling, to)
CALLS = {1: ((0,), None),  # before DDP's bucket rebuild: the others meet it in their next forward
         2: ((0,), None),  # static_graph rebuilds here
         3: ((0, 1), None), 4: ((0, 1), 0),  # today's contract, both forms
         5: ((0,), 0), 6: ((0,), None)}  # rank 0 alone again, twice in a row at 6
LOOP_CASES = [Case(opt="AdamW", bucket_cap_mb=0.0001, groups=2, accumulate=2),
              Case(opt="Adam", overlap="backward", graph="static"),  # DDP's static graph cannot accumulate
              Case(opt="SGD", overlap="step", grad_reduce="all_reduce", accumulate=2)]


def nanogpt_loop(rank, world):
    """nanoGPT's loop: after some iterations rank 0 alone evaluates (no_grad forwards through the DDP
    module), calls optimizer.state_dict() and torch.save()s it; both ranks train on. Parameters stay in
    parity with DDP + torch.optim at every step, and the saved state equals torch.optim's."""
    for case in LOOP_CASES:
        built = build(case, rank)
        model, ddp, opt, ref_model, *_ = built
        ref_opt = built[5]
        for it in range(1, 9):
            _train_ours(case, built, rank, it)  # ours first: rank 0's checkpoint waits for the others' hook
            _train_ref(case, built, rank, it)
            _compare(model, ref_model, case, it, rank)
            ranks, to = CALLS.get(it, ((), None))
            if rank not in ranks:
                continue
            if ranks == (0,):
                with torch.no_grad():  # estimate_loss(): forwards on rank 0 only
                    model.eval()
                    ddp(torch.zeros(2, 3, dtype=torch.long))
                    model.train()
                time.sleep(0.2)  # the other rank is waiting at its hook by now, not about to reach it
            for _ in range(2 if it == 6 else 1):
                sd = opt.state_dict(to=to) if to is not None else opt.state_dict()
                if to is not None and rank != to:
                    assert sd is None
                    continue
                _assert_matches_torch(_saved_and_loaded(sd), ref_opt)
        _assert_keys_deleted(opt._checkpoint_sync)
        opt._engine.close()
    return "ok"


def _assert_keys_deleted(sync):
    """Every key of the handshake's past messages is gone from the store but the last two's."""
    mine = ["msg", "verdict"] if sync.rank == 0 else [f"ans{sync.rank}"]
    assert sync.seq > 8
    left = [f"{m}/{k}" for m in range(sync.seq - 2) for k in mine if sync.store.check([f"{m}/{k}"])]
    assert not left, left


def test_rank0_only_state_dict_in_a_nanogpt_loop():
    assert run_ranks(nanogpt_loop, 2) == ["ok", "ok"]


def without_handshake(rank, world):
    """checkpoint_handshake=False: no store traffic per iteration; state_dict() on every rank works."""
    case = Case(opt="AdamW", bucket_cap_mb=0.0001, accumulate=2)
    torch.manual_seed(1234)
    model, ref_model = OddNet(), OddNet()
    ref_model.load_state_dict(model.state_dict())
    for m in (model, ref_model):
        m.never.requires_grad_(False)
    ddp, ref_ddp = DDP(model, bucket_cap_mb=0.0001), DDP(ref_model, bucket_cap_mb=0.0001)
    opt = fused_zero.AdamW(param_groups(model, case), ddp=ddp, checkpoint_handshake=False)
    ref_opt = torch.optim.AdamW(param_groups(ref_model, case), foreach=False)
    built = (model, ddp, opt, ref_model, ref_ddp, ref_opt, None)
    for it in range(1, 4):
        _train_ours(case, built, rank, it)
        _train_ref(case, built, rank, it)
        _compare(model, ref_model, case, it, rank)
    assert opt._checkpoint_sync.seq == 0
    _assert_matches_torch(opt.state_dict(), ref_opt)
    return "ok"


def _error_of(fn) -> str:
    try:
        fn()
    except RuntimeError as e:  # from the comm hook, DDP's backward may wrap ours
        return str(e)
    raise AssertionError("expected the handshake to fail")


def misuses(rank, world):
    """Every misuse raises on every rank, none hangs; rank 0's wait for the others is short (lowered
    here to 3 s) whatever the process group's timeout."""
    rank0.JOIN_DEADLINE_S = 3.0
    case = Case(opt="AdamW", bucket_cap_mb=0.0001, accumulate=2)
    out = {}

    # rank 1 calls state_dict() alone while rank 0 trains on: both raise at once
    built = build(case, rank)
    for it in range(1, 3):
        _train_ours(case, built, rank, it)
    opt = built[2]
    if rank == 1:
        out["alone_on_1"] = _error_of(opt.state_dict)
    else:
        out["alone_on_1"] = _error_of(lambda: _train_ours(case, built, rank, 3))
    out["after"] = _error_of(opt.state_dict)  # the optimizer refuses to go on
    torch.distributed.barrier()

    # rank 0 calls it alone and rank 1 does not train again in time: rank 0 gives up after the deadline;
    # rank 1, arriving late at its next backward, is told so and raises too
    built = build(case, rank)
    for it in range(1, 3):
        _train_ours(case, built, rank, it)
    if rank == 0:
        out["others_gone"] = _error_of(built[2].state_dict)
    torch.distributed.barrier()
    if rank == 1:
        out["others_gone"] = _error_of(lambda: _train_ours(case, built, rank, 3))

    # state_dict(to=1) on rank 0 alone: rank 1 cannot receive it from its backward
    built = build(case, rank)
    _train_ours(case, built, rank, 1)
    if rank == 0:
        out["to_1_alone"] = _error_of(lambda: built[2].state_dict(to=1))
    else:
        out["to_1_alone"] = _error_of(lambda: _train_ours(case, built, rank, 2))

    # different `to` on the ranks
    built = build(case, rank)
    _train_ours(case, built, rank, 1)
    out["to_differs"] = _error_of(lambda: built[2].state_dict(to=rank))
    # between a training forward (which posts for the iteration) and its backward: refused on every rank
    built = build(case, rank)
    _train_ours(case, built, rank, 1)
    loss = loss_of(built[1], case, 2, 0, rank)
    out["mid_iteration"] = _error_of(built[2].state_dict)
    del loss

    out["without_handshake"] = without_handshake(rank, world)
    return out


def test_misuses_fail_on_every_rank_and_the_handshake_can_be_off():
    outs = run_ranks(misuses, 2)
    for out in outs:
        assert "every rank, or on rank 0 only" in out["alone_on_1"], out
        assert "earlier optimizer.state_dict() handshake failed" in out["after"], out
        assert "state_dict(to=1) was called on rank 0 only" in out["to_1_alone"], out
        assert "same `to`" in out["to_differs"], out
    assert "did not join within 3 s" in outs[0]["others_gone"], outs[0]
    assert "abandoned" in outs[1]["others_gone"], outs[1]
    assert "trains on" in outs[0]["alone_on_1"] and "called on rank 1" in outs[1]["alone_on_1"]
    assert all("between a training forward and its backward" in out["mid_iteration"] for out in outs), outs
    assert [out["without_handshake"] for out in outs] == ["ok", "ok"]
