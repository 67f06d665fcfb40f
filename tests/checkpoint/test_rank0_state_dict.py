"""``optimizer.state_dict()`` called by rank 0 alone (nanoGPT under ``if master_process:``, the Trainer's
``should_save``) while the other ranks do whatever their loop does between steps: their next forward and
backward, DDP's bucket rebuild, a loss all-reduce for logging, a second DDP model with an optimizer of
its own, an evaluation gather. The dict served must be torch.optim's at the same step (the oracle: DDP +
torch.optim trained side by side with the same loop). Also: the all-ranks forms, three ranks asking at
once, no store request per iteration, and misuse failing on the calling ranks within the deadline,
with the module's message, leaving training and later checkpoints working."""

import io
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ckpt_scenarios import assert_same_state
from distributed import run_ranks
from scenarios import Case, _compare, _reference_step, build, loss_of
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.checkpoint.serving import channel, peers
from fused_zero.checkpoint.serving.server import server_for


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


def _train_both(case, built, rank, it):
    _train_ours(case, built, rank, it)
    _train_ref(case, built, rank, it)
    _compare(built[0], built[3], case, it, rank)


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
         3: ((0, 1), None), 4: ((0, 1), 0),  # every rank, both forms
         5: ((0,), 0), 6: ((0,), None),  # rank 0 alone again, twice in a row at 6
         7: ((1,), None)}  # another rank alone
LOOP_CASES = [Case(opt="AdamW", bucket_cap_mb=0.0001, groups=2, accumulate=2),
              Case(opt="Adam", overlap="backward", graph="static"),  # DDP's static graph cannot accumulate
              Case(opt="SGD", overlap="step", grad_reduce="all_reduce", accumulate=2)]


def nanogpt_loop(rank, world):
    """nanoGPT's loop: after some iterations rank 0 alone evaluates (no_grad forwards through the DDP
    module), calls optimizer.state_dict() and torch.save()s it; the other rank trains on into its next
    iteration. Parameters stay in parity with DDP + torch.optim at every step, and the saved state
    equals torch.optim's."""
    for case in LOOP_CASES:
        built = build(case, rank)
        model, ddp, opt, ref_model, *_ = built
        ref_opt = built[5]
        for it in range(1, 9):
            _train_both(case, built, rank, it)
            ranks, to = CALLS.get(it, ((), None))
            if rank not in ranks:
                continue
            if len(ranks) == 1:
                with torch.no_grad():  # estimate_loss(): forwards on this rank only
                    model.eval()
                    ddp(torch.zeros(2, 3, dtype=torch.long))
                    model.train()
                time.sleep(0.2)  # the other rank is in its next iteration by now
            for _ in range(2 if it == 6 else 1):
                sd = opt.state_dict(to=to) if to is not None else opt.state_dict()
                if to is not None and rank != to:
                    assert sd is None
                    continue
                _assert_matches_torch(_saved_and_loaded(sd), ref_opt)
        opt._engine.close()
    return "ok"


class _Counted:
    """A store handle that counts the calls made through it (every one is a request to the store)."""

    def __init__(self, inner):
        self.inner, self.requests, self.in_flight, self.names = inner, 0, [], []

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def counted(*args, **kwargs):
            self.requests += 1
            self.names.append(name)
            self.in_flight.append(name)
            try:
                return method(*args, **kwargs)
            finally:
                self.in_flight.remove(name)

        return counted


def _listener_idle(inbox, deadline_s: float = 30.0) -> None:
    """Wait until this rank's listener has taken every message posted to it and sits in its next
    ``wait``: what it does after the last checkpoint must not be counted against the steps after it."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        posted = inbox.store.inner.add(f"{inbox.rank}/n", 0)  # uncounted: not the protocol's request
        # in its next wait, or in one it started before the handles were counted and never left
        waiting = inbox.listening.in_flight == ["wait"] or inbox.listening.requests == 0
        if inbox._next - 1 == posted and waiting:
            return
        time.sleep(0.01)
    raise AssertionError("the checkpoint listener did not go idle within 30 s")


def between_steps(rank, world):
    """Rank 0 checkpoints alone after each step while the other rank is already inside something that
    waits for rank 0: a logging all-reduce, a second DDP model's backward (with a fused_zero optimizer of
    its own, sharing the server), an evaluation's gather. Then steps without a checkpoint: not one store
    request (the protocol's store handles are counted)."""
    case = Case(opt="AdamW", bucket_cap_mb=0.0001, accumulate=2)
    built = build(case, rank)
    opt, ref_opt = built[2], built[5]
    torch.manual_seed(5)
    second, second_ref = nn.Linear(6, 9), nn.Linear(6, 9)
    second_ref.load_state_dict(second.state_dict())
    second_ddp, second_ref_ddp = DDP(second), DDP(second_ref)
    second_opt = fused_zero.AdamW(second_ddp.parameters(), lr=0.01)  # built first, attached later
    second_opt.attach(second_ddp)
    second_ref_opt = torch.optim.AdamW(second_ref.parameters(), lr=0.01, foreach=False)
    out = {"served": [], "second": []}
    inbox = server_for(built[1].process_group).inbox
    inbox.store, inbox.listening = _Counted(inbox.store), _Counted(inbox.listening)
    for it in range(1, 10):
        _train_both(case, built, rank, it)
        if rank == 0:
            time.sleep(0.2)  # the other rank waits in the activity below by now
            sd = opt.state_dict()
            _assert_matches_torch(_saved_and_loaded(sd), ref_opt)
            out["served"].append(it)
        kind = it % 3
        if kind == 0:  # a loss, all-reduced for logging
            with torch.no_grad():
                loss = loss_of(built[1], case, it, 0, rank)
            dist.all_reduce(loss)
        elif kind == 1:  # a second model, trained in lock step
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(it * 10 + rank))
            for d, o in ((second_ddp, second_opt), (second_ref_ddp, second_ref_opt)):
                F.mse_loss(d(x), x.sum(1, keepdim=True).expand(4, 9)).backward()
                o.step()
                o.zero_grad()
            out["second"].append(all(torch.equal(p, q) for p, q in zip(second.parameters(), second_ref.parameters())))
        else:  # an evaluation: forwards without grad, then the metrics gathered
            with torch.no_grad():
                built[0].eval()
                metric = loss_of(built[1], case, it, 1, rank).reshape(1)
                built[0].train()
            gathered = [torch.empty(1) for _ in range(world)]
            dist.all_gather(gathered, metric)
    _listener_idle(inbox)
    out["store_requests_per_checkpoint"] = (inbox.store.requests + inbox.listening.requests) / 9
    before = inbox.store.requests, len(inbox.listening.names)
    posted = [inbox.store.inner.add(f"{r}/n", 0) for r in range(world)]  # uncounted reads
    for it in range(10, 15):  # no checkpoint: nothing goes to the store
        _train_both(case, built, rank, it)
    # every request the steps make, and the listener's besides its idle wait (re-armed now and then
    # whatever the steps do, and taking nothing: a message for it would have to be posted first)
    listener = [n for n in inbox.listening.names[before[1]:] if n != "wait"]
    out["store_requests_steps_10_to_14"] = inbox.store.requests - before[0] + len(listener)
    dist.barrier()  # both ranks are past their steps: then count, before rank 0 asks again below
    out["messages_posted_steps_10_to_14"] = sum(inbox.store.inner.add(f"{r}/n", 0) for r in range(world)) - sum(posted)
    dist.barrier()
    if rank == 0:
        _assert_matches_torch(second_opt.state_dict(), second_ref_opt)
    return out


def _error_of(fn, exc=peers.CheckpointSyncError) -> tuple[str, float]:
    t = time.monotonic()
    try:
        fn()
    except exc as e:
        return str(e), time.monotonic() - t
    raise AssertionError(f"expected {exc.__name__}")


def misuses(rank, world):
    """Each misuse raises on the calling ranks within the deadline (lowered to 2 s), and leaves training
    and later checkpoints working."""
    channel.JOIN_DEADLINE_S = 2.0
    case = Case(opt="AdamW", bucket_cap_mb=0.0001, accumulate=2)
    built = build(case, rank)
    ddp, opt = built[1], built[2]
    out = {}
    _train_both(case, built, rank, 1)

    # between a backward and step(): refused at once, on the caller; the step then goes on as usual
    _iteration(case, ddp, rank, 2)
    out["mid_iteration"] = _error_of(opt.state_dict)
    opt.step()
    opt.zero_grad(set_to_none=True)
    _train_ref(case, built, rank, 2)
    _compare(built[0], built[3], case, 2, rank)

    # state_dict(to=1) on rank 0 alone: rank 1 never asks, rank 0 gives up after the deadline
    if rank == 0:
        out["to_1_alone"] = _error_of(lambda: opt.state_dict(to=1))
    dist.barrier()
    # crossed: each rank names the other; neither asks for itself
    out["crossed"] = _error_of(lambda: opt.state_dict(to=1 - rank))
    dist.barrier()

    # a rank that has not published the step rank 0 asks for (its count held back by one, as if its
    # training thread were still finishing the step): rank 0 is refused once the deadline has passed
    versions = opt._peers.versions
    if rank == 1:
        versions.newest -= 1
        held_back = versions.kept.pop()
    if rank == 0:
        out["not_there"] = _error_of(opt.state_dict)
    dist.barrier()
    if rank == 1:
        versions.newest += 1
        versions.kept.append(held_back)

    # none of it broke anything: training and rank 0's checkpoints go on
    _train_both(case, built, rank, 3)
    if rank == 0:
        _assert_matches_torch(opt.state_dict(), built[5])
    out["to_out_of_range"] = _error_of(lambda: opt.state_dict(to=2), ValueError)[0]

    # a requester ahead at attach: rank 0 asks for a new optimizer's state as soon as it is built, while
    # rank 1 registers it 0.5 s later (its attach is slower); rank 1 serves it once it has
    second = DDP(nn.Linear(8, 4))
    peers_for = peers.peers_for
    if rank == 1:
        peers.peers_for = lambda engine: (time.sleep(0.5), peers_for(engine))[1]
    try:
        opt2 = fused_zero.AdamW(second.parameters(), lr=1e-3, ddp=second)
    finally:
        peers.peers_for = peers_for
    if rank == 0:
        out["ahead_at_attach"] = opt2.state_dict()["param_groups"][0]["params"]
    dist.barrier()
    return out


def test_rank0_only_state_dict_in_a_nanogpt_loop():
    assert run_ranks(nanogpt_loop, 2) == ["ok", "ok"]


def test_rank0_serves_while_the_others_run_collectives_of_their_own():
    outs = run_ranks(between_steps, 2)
    for out in outs:
        assert out["second"] == [True] * 3, out
        assert out["store_requests_steps_10_to_14"] == 0, out
        assert out["messages_posted_steps_10_to_14"] == 0, out
        assert 0 < out["store_requests_per_checkpoint"] <= 12, out  # O(1) per pair of ranks
    assert outs[0]["served"] == list(range(1, 10))


def test_misuses_fail_on_the_calling_ranks_within_the_deadline():
    outs = run_ranks(misuses, 2)
    for rank, out in enumerate(outs):
        why, took = out["mid_iteration"]
        assert "between a backward and optimizer.step()" in why and took < 1.0, out
        why, took = out["crossed"]
        assert f"optimizer.state_dict(to={1 - rank}) on rank {rank}: rank {1 - rank} did not call" in why, out
        assert 1.9 < took < 10, out
        assert "not a rank of the optimizer's process group" in out["to_out_of_range"]
    assert outs[0]["ahead_at_attach"] == [0, 1], outs[0]
    why, took = outs[0]["to_1_alone"]
    assert "rank 1 did not call optimizer.state_dict() within 2 s" in why and 1.9 < took < 10, outs[0]
    why, took = outs[0]["not_there"]
    assert "rank 1 refused to serve" in why and "did not get there within 2 s" in why and took < 10, outs[0]


def three_ranks(rank, world):
    """W=3: rank 0 alone while the others train on; then every rank at once (each is served by the two
    others, in rank order: no deadlock); then every rank with to=2."""
    case = Case(opt="AdamW", bucket_cap_mb=0.0001, groups=2, grad_reduce="all_reduce")  # DDP's sums at W=3
    built = build(case, rank)
    opt, ref_opt = built[2], built[5]
    for it in range(1, 5):
        _train_both(case, built, rank, it)
        if it == 2 and rank == 0:
            _assert_matches_torch(opt.state_dict(), ref_opt)
        if it == 3:
            _assert_matches_torch(opt.state_dict(), ref_opt)
        if it == 4:
            sd = opt.state_dict(to=2)
            assert (sd is None) == (rank != 2)
            if sd is not None:
                _assert_matches_torch(sd, ref_opt)
    return "ok"


def test_three_ranks_bystanders_and_every_rank_at_once():
    assert run_ranks(three_ranks, 3) == ["ok"] * 3


def requester_destinations(rank, world, shards):
    """For each shard group size: rank 0 alone checkpoints after step 2 while the others wait in a
    barrier. Rank 0's mailbox posts are recorded (destination, kind), and every rank counts its store
    requests over the checkpoint (the protocol's handles, listener included, each rank idle before and
    after)."""
    out = []
    for shard in shards:
        case = Case(opt="AdamW", bucket_cap_mb=0.0001, shard=shard)
        built = build(case, rank)
        opt, ref_opt = built[2], built[5]
        for it in (1, 2):
            _train_both(case, built, rank, it)
        inbox = server_for(built[1].process_group).inbox
        inbox.store, inbox.listening = _Counted(inbox.store), _Counted(inbox.listening)
        posted = []
        if rank == 0:
            post = inbox.post
            inbox.post = lambda r, message, post=post, posted=posted: (posted.append((r, message["kind"])),
                                                                      post(r, message))[1]
        before = inbox.store.requests + inbox.listening.requests  # before the barrier: no rank has posted
        dist.barrier()  # (read after it, a slow rank's listener could take rank 0's first post uncounted)
        if rank == 0:
            _assert_matches_torch(opt.state_dict(), ref_opt)
        dist.barrier()
        _listener_idle(inbox)
        out.append({"shard": shard, "posted": posted, "store_requests": inbox.store.requests +
                    inbox.listening.requests - before, "group": list(opt._engine.topology.shards[0])})
        dist.barrier()  # nobody's listener is counted any more before the next case's
        inbox.store, inbox.listening = inbox.store.inner, inbox.listening.inner
        vars(inbox).pop("post", None)
        opt._engine.close()
    return out


def test_rank0_asks_its_shard_group_peers_only_at_the_scale_models_store_cost():
    """At 4 ranks in shard groups of 2 (2x2) and flat (4x1): rank 0 announces itself to, and asks for
    slices, exactly the other ranks of its shard group, each once; the checkpoint costs the store
    15 requests per rank asked, all ranks together (bench/scale_model.py's STORE_PER_PEER)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from scale_model import STORE_PER_PEER

    outs = run_ranks(requester_destinations, 4, [2, None])
    for k, (shard, ranks) in enumerate(((2, [1]), (None, [1, 2, 3]))):
        mine = outs[0][k]
        assert mine["shard"] == shard and mine["group"] == [0] + ranks, mine
        assert sorted(mine["posted"]) == sorted((r, kind) for r in ranks for kind in ("announce", "serve")), mine
        total = sum(out[k]["store_requests"] for out in outs)
        assert total == STORE_PER_PEER * len(ranks), (shard, [out[k]["store_requests"] for out in outs])
