"""``capturable=True``: ``step()``'s device work captured once in a CUDA graph and replayed
(pipeline/step_end/step_graph.py), run on the CPU under the stream-order checker, whose graph model
(testing/streamcheck/graphs.py) runs the capture's recorded operations on replay and reports what a real capture
would refuse or lose: a host synchronization, an allocation, work outside the capture, a wait for work
from outside it, a stream not joined back, host work.

- Parity: 2 ranks, the engine replaying its graph against DDP + torch.optim run on the same data, every
  parameter compared bit for bit after every step, with an lr scheduler changing lr every step (it must
  reach the replays through device memory), and the optimizer state at the end. AdamW with clipping,
  Adam (amsgrad) with a GradScaler and param_sync="forward", AdamW with 8-bit moments, Adam under
  OneCycleLR, whose ``cycle_momentum`` changes beta1 every step (the bias tables too).
- The graph is captured once DDP's buckets and the arenas are stable, replayed every step after, and
  its capture has no problem; the replayed steps make no host synchronization on the step path and
  the checker finds no hazard.
- The model itself: what it reports and what a replay does, on small captures.
- An optimizer built without ``capturable=True`` (torch.optim's twin of RMSprop, Muon) beside a captured
  AdamW: its step eager, AdamW's replayed, bit for bit with the eager pair.
- The refusals, at construction, of what a graph cannot hold.

The GPU case (tests/gpu, ``case_capture``) compares a captured step with an eager one bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from scenarios import VOCAB, OddNet, batch
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.testing.streamcheck import StreamChecker
from fused_zero.testing.streamcheck.device import ModeledStreams

STEPS = 8
DEVICE = torch.device("cpu")  # the checker's device memory

CONFIGS = {  # the oracle: torch.optim under DDP, or the engine stepping eagerly (clipping: the global norm
    # is summed in another order than clip_grad_norm_'s, 1e-7 apart: docs/testing.md)
    "adamw-clip": dict(opt="AdamW", kw=dict(weight_decay=0.1), max_grad_norm=0.5, param_sync="step", oracle="eager"),
    "adam-scaler-forward": dict(opt="Adam", kw=dict(amsgrad=True), scaler=True, param_sync="forward",
                                oracle="torch"),
    "adamw-8bit": dict(opt="AdamW", kw=dict(state_format="8bit"), param_sync="step", oracle="eager"),
    # OneCycleLR's cycle_momentum: beta1 changes every step, and reaches the replays through device memory
    "adam-onecycle": dict(opt="Adam", kw=dict(weight_decay=0.05), param_sync="step", oracle="torch",
                          schedule="onecycle"),
}


def _schedule(opt, cfg):
    if cfg.get("schedule") == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=STEPS + 1)
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _models():
    torch.manual_seed(0)
    model = OddNet().to(DEVICE)
    model.never.requires_grad_(False)
    ref = OddNet().to(DEVICE)
    ref.load_state_dict(model.state_dict())
    ref.never.requires_grad_(False)
    return model, ref


def _loss(ddp, step, rank):
    x, y = (t.to(DEVICE) for t in batch(step, 0, rank))
    return F.cross_entropy(ddp(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1))


def _step(ddp, opt, scaler, step, rank, clip=None):
    loss = _loss(ddp, step, rank)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if clip is not None:  # torch.optim's oracle clips as the engine's max_grad_norm does
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad()


def train_captured(rank, world, name):
    """Train the engine (capturable, under the checker) and DDP + torch.optim side by side; returns what
    differed, what the checker saw and how often the graph was captured and replayed."""
    cfg = CONFIGS[name]
    model, ref = _models()
    kw = dict(lr=1e-2, **cfg["kw"])
    with StreamChecker() as checker:
        ddp = DDP(model, bucket_cap_mb=0.0001)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6) if cfg.get("scaler") else None
        options = dict(overlap="step", param_sync=cfg["param_sync"], max_grad_norm=cfg.get("max_grad_norm"))
        opt = getattr(fused_zero, cfg["opt"])(ddp.parameters(), ddp=ddp, grad_scaler=scaler, capturable=True,
                                              **options, **kw)
        with checker.paused():  # the oracle, not modeled
            ref_ddp = DDP(ref, bucket_cap_mb=0.0001)
            ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6) if scaler is not None else None
            ref_opt = getattr(torch.optim, cfg["opt"])(ref_ddp.parameters(), **kw) if cfg["oracle"] == "torch" else \
                getattr(fused_zero, cfg["opt"])(ref_ddp.parameters(), ddp=ref_ddp, grad_scaler=ref_scaler, **options,
                                                **kw)
        schedules = [_schedule(o, cfg) for o in (opt, ref_opt)]
        differences, replays = [], []
        try:
            for step in range(1, STEPS + 1):
                checker.phase = f"step {step}"
                _step(ddp, opt, scaler, step, rank)
                with checker.paused():
                    clip = cfg.get("max_grad_norm") if cfg["oracle"] == "torch" else None
                    _step(ref_ddp, ref_opt, ref_scaler, step, rank, clip)
                    for s in schedules:
                        s.step()
                    for o in (opt, ref_opt):
                        getattr(o, "_engine", None) and o._engine.synchronize()
                    replays.append(opt._engine.graph.replays)
                    differences += [f"step {step} {n}" for (n, p), q in zip(model.named_parameters(), ref.parameters())
                                    if not torch.equal(p, q)]
            checker.phase = "end"
            with checker.paused():
                ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
                differences += [f"state {i} {k}" for i in theirs for k in theirs[i]
                                if not torch.equal(torch.as_tensor(ours[i][k]), torch.as_tensor(theirs[i][k]))]
            graph = opt._engine.graph
            syncs = [s for s in checker.syncs if s[3] and s[2].startswith("step ")]
            return dict(differences=differences, hazards=[str(h) for h in checker.hazards()],
                        problems=[p for c in checker.captures for p in c.problems], captures=graph.captures,
                        operations=[len(c.operations) for c in checker.captures],
                        replays=replays, syncs=[(s[2], s[0]) for s in syncs])
        finally:
            for o in (opt, ref_opt):
                getattr(o, "_engine", None) and o._engine.close()


@pytest.fixture(scope="module", params=list(CONFIGS))
def captured(request):
    return run_ranks(train_captured, 2, request.param)


def test_replayed_steps_train_as_torch_optim(captured):
    for rank, seen in enumerate(captured):
        assert not seen["differences"], f"rank {rank}: {seen['differences'][:5]}"


def test_the_graph_is_captured_when_the_layout_settles_and_replayed_after(captured):
    """Eager at step 1, and at 2 (DDP's rebuilt buckets), captured at 3 (per-bucket launches), eager at 5
    (the arenas packed after step 4: one launch), captured at 6; every step after replays."""
    for seen in captured:
        replays = seen["replays"]
        assert seen["captures"] == 2 and replays[-1] == STEPS - 3, seen
        assert replays[-1] - replays[-3] == 2, replays  # steps 7 and 8 replayed
        assert not seen["problems"], seen["problems"]


def test_replayed_steps_make_no_host_synchronization_and_no_hazard(captured):
    for seen in captured:
        assert not seen["hazards"], seen["hazards"]
        # the captures' own (torch.cuda.graph synchronizes before each), and nothing else
        assert seen["syncs"] == [(f"step {s}", "torch.cuda.graph() synchronizes the device before a capture")
                                 for s in (3, 6)], seen["syncs"]


# ---------------------------------------------------------------------------- the capture model itself

def _model_run(work):
    """``work(streams, side, t, compute)`` captured on a modeled side stream; returns the capture's problems,
    the graph, ``t`` (a device tensor of 4 ones made before the capture) and the checker."""
    with StreamChecker() as checker:
        streams = ModeledStreams(checker, DEVICE)
        side = streams.side_stream()
        t = torch.ones(4, device=DEVICE)
        compute, graph = streams.current(), streams.graph()
        with graph.capture(side):
            work(streams, side, t, compute)
        return [kind for kind, *_ in graph.capture_of.problems], graph, t, checker


def test_a_capture_changes_nothing_and_a_replay_reruns_it_on_the_tensors_as_they_are():
    lr = torch.full((1,), 0.5, device=DEVICE)

    def work(streams, side, t, compute):
        t.mul_(lr)
    problems, graph, t, checker = _model_run(work)
    assert problems == [] and torch.equal(t, torch.ones(4))
    with checker.paused():
        lr.fill_(0.25)  # a scheduler's new value, written into the tensor the graph reads
    graph.replay()
    assert torch.equal(t, torch.full((4,), 0.25))


def test_what_a_graph_cannot_hold_is_reported():
    def allocates(streams, side, t, compute):
        t.add_(torch.zeros(4, device=DEVICE))
    assert _model_run(allocates)[0] == ["allocation"]

    def syncs(streams, side, t, compute):
        float(t.sum())
    assert "host synchronization" in _model_run(syncs)[0]

    def waits_outside(streams, side, t, compute):
        side.wait_stream(compute)  # the compute stream is not part of the capture
    assert _model_run(waits_outside)[0] == ["isolation"]

    def forks_without_join(streams, side, t, compute):
        other = streams.side_stream()
        other.wait_stream(side)
        with streams.use(other):
            t.add_(1)
    assert _model_run(forks_without_join)[0] == ["unjoined"]

    def queues_elsewhere(streams, side, t, compute):
        with streams.use(streams.side_stream()):
            t.add_(1)
    assert _model_run(queues_elsewhere)[0] == ["outside the capture"]


# ---------------------------------------------------------------------------- two optimizers over one module


def train_two_captured(rank, world):
    """AdamW over the embedding, l1 and the norm, Adam over the rest, both capturable, with clipping by
    their global norm: each optimizer's step is a graph of its own (its tables, its checks, its gathers:
    they must stay apart), against the same two optimizers stepping eagerly, bit for bit."""
    model, ref = _models()
    names = ("emb", "l1", "norm")
    with StreamChecker() as checker:
        ddp = DDP(model, bucket_cap_mb=0.0001)
        options = dict(overlap="step", max_grad_norm=0.5)
        pick = [lambda m: [p for n, p in m.named_parameters() if p.requires_grad and n.startswith(names)],
                lambda m: [p for n, p in m.named_parameters() if p.requires_grad and not n.startswith(names)]]
        opts = [fused_zero.AdamW(pick[0](model), lr=1e-2, ddp=ddp, capturable=True, **options),
                fused_zero.Adam(pick[1](model), lr=2e-2, ddp=ddp, capturable=True, **options)]
        with checker.paused():
            ref_ddp = DDP(ref, bucket_cap_mb=0.0001)
            refs = [fused_zero.AdamW(pick[0](ref), lr=1e-2, ddp=ref_ddp, **options),
                    fused_zero.Adam(pick[1](ref), lr=2e-2, ddp=ref_ddp, **options)]
        schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opts + refs]
        differences = []
        try:
            for step in range(1, STEPS + 1):
                checker.phase = f"step {step}"
                _loss(ddp, step, rank).backward()
                for o in opts:
                    o.step()
                for o in opts:
                    o.zero_grad()
                with checker.paused():
                    _loss(ref_ddp, step, rank).backward()
                    for o in refs:
                        o.step()
                        o.zero_grad()
                    for s in schedules:
                        s.step()
                    opts[0]._engine.synchronize()
                    differences += [f"step {step} {n}" for (n, p), q in zip(model.named_parameters(), ref.parameters())
                                    if not torch.equal(p, q)]
            graph = opts[0]._engine.graph
            return dict(differences=differences, captures=graph.captures, replays=graph.replays,
                        problems=[p for c in checker.captures for p in c.problems],
                        hazards=[str(h) for h in checker.hazards()])
        finally:
            for o in opts + refs:
                o._engine.close()


def test_two_optimizers_each_replay_their_own_step():
    """Each optimizer's step captured (once the layout settles) and replayed on its own; every parameter
    bit for bit with the eager pair after every step."""
    for seen in run_ranks(train_two_captured, 2):
        assert not seen["differences"], seen["differences"][:5]
        assert seen["captures"] == 4 and seen["replays"] >= 2 * (STEPS - 4), seen
        assert not seen["problems"] and not seen["hazards"], seen


MATRICES = ("l1.weight", "l2.weight", "branch.weight")
"""The hidden matrices: Muon's share beside the captured AdamW (the tied embedding stays with AdamW)."""


def train_beside_captured(rank, world, other):
    """AdamW (``capturable=True``) over all but the hidden matrices, and ``other`` (RMSprop, Muon: built
    without it, torch ops that make new tensors every step) over them: AdamW's step replayed from its
    graph, ``other``'s eager beside it, against the same pair stepping eagerly, bit for bit; the graph's
    capture holds AdamW's work alone (no allocation, no host synchronization reported)."""
    model, ref = _models()
    with StreamChecker() as checker:
        ddp = DDP(model, bucket_cap_mb=0.0001)

        def build(m, d, capturable):
            mats = [p for n, p in m.named_parameters() if n in MATRICES]
            rest = [p for n, p in m.named_parameters() if p.requires_grad and n not in MATRICES]
            kw = dict(lr=2e-2) if other == "Muon" else dict(lr=1e-3, momentum=0.9)
            return [fused_zero.AdamW(rest, lr=1e-2, ddp=d, overlap="step", capturable=capturable),
                    getattr(fused_zero, other)(mats, ddp=d, overlap="step", **kw)]
        opts = build(model, ddp, True)
        with checker.paused():
            ref_ddp = DDP(ref, bucket_cap_mb=0.0001)
            refs = build(ref, ref_ddp, False)
        differences = []
        try:
            for step in range(1, STEPS + 1):
                checker.phase = f"step {step}"
                _loss(ddp, step, rank).backward()
                for o in opts:
                    o.step()
                    o.zero_grad()
                with checker.paused():
                    _loss(ref_ddp, step, rank).backward()
                    for o in refs:
                        o.step()
                        o.zero_grad()
                    opts[0]._engine.synchronize()
                    differences += [f"step {step} {n}" for (n, p), q in zip(model.named_parameters(), ref.parameters())
                                    if not torch.equal(p, q)]
            graph = opts[0]._engine.graph
            syncs = [(s[2], s[0]) for s in checker.syncs if s[3] and s[2].startswith("step ")]
            return dict(differences=differences, captures=graph.captures, replays=graph.replays, syncs=syncs,
                        problems=[p for c in checker.captures for p in c.problems],
                        hazards=[str(h) for h in checker.hazards()])
        finally:
            for o in opts + refs:
                o._engine.close()


@pytest.mark.parametrize("other", ["RMSprop", "Muon"])
def test_an_optimizer_without_capturable_steps_eagerly_beside_a_captured_one(other):
    """torch.optim's twin of RMSprop and Muon beside a capturable AdamW (before: the twin's host reads inside
    AdamW's capture, refused by CUDA at the first capture; Muon refused at construction)."""
    for seen in run_ranks(train_beside_captured, 2, other):
        assert not seen["differences"], seen["differences"][:5]
        assert seen["captures"] == 2 and seen["replays"] >= STEPS - 4, seen
        assert not seen["problems"] and not seen["hazards"], seen
        assert all(what.startswith("torch.cuda.graph()") for _, what in seen["syncs"]), seen["syncs"]


# ---------------------------------------------------------------------------- refusals

def _refusal(rank, world, options, ddp_options):
    torch.manual_seed(0)
    model = OddNet()
    model.never.requires_grad_(False)
    if options.get("master_weights") == "stochastic":
        model.bfloat16()
    with StreamChecker():  # a modeled device: only what a graph cannot hold is refused
        ddp = DDP(model, **ddp_options)
        try:
            fused_zero.AdamW(ddp.parameters(), ddp=ddp, capturable=True, **options)
        except ValueError as e:
            return str(e)
    return None


@pytest.mark.parametrize("options, ddp_options, named", [
    (dict(overlap="backward"), {}, 'overlap="step"'),
    (dict(), {}, 'overlap="step"'),
    (dict(overlap="step", grad_reduce_dtype=torch.bfloat16), {}, "grad_reduce_dtype"),
    (dict(overlap="step", master_weights="stochastic"), {}, "stochastic"),
    (dict(overlap="step"), dict(find_unused_parameters=True), "find_unused_parameters"),
])
def test_what_a_graph_cannot_hold_is_refused_at_construction(options, ddp_options, named):
    why = run_ranks(_refusal, 1, options, ddp_options)[0]
    assert why is not None and named in why and "capturable=True" in why, why


def _on_cpu(rank, world):
    model = OddNet()
    model.never.requires_grad_(False)
    ddp = DDP(model)
    try:
        fused_zero.AdamW(ddp.parameters(), ddp=ddp, overlap="step", capturable=True)
    except ValueError as e:
        return str(e)
    return None


def test_capturable_on_cpu_parameters_is_refused():
    why = run_ranks(_on_cpu, 1)[0]
    assert why is not None and "CUDA" in why and "cpu" in why, why


def _step_in_a_users_capture(rank, world):
    model, _ = _models()
    with StreamChecker() as checker:
        ddp = DDP(model, bucket_cap_mb=0.0001)
        opt = fused_zero.AdamW(ddp.parameters(), ddp=ddp, overlap="step", capturable=True)
        try:
            _loss(ddp, 1, rank).backward()
            streams = ModeledStreams(checker, DEVICE)
            with streams.graph().capture(streams.side_stream()):
                opt.step()
        except RuntimeError as e:
            return str(e)
        finally:
            opt._engine.close()
    return None


def test_step_inside_the_users_own_capture_is_refused():
    """torch's recipe (``with torch.cuda.graph(g): opt.step()``) cannot hold fused_zero's step, whose waits
    are for work the backward queued outside the capture: named, with the option that does it."""
    why = run_ranks(_step_in_a_users_capture, 1)[0]
    assert why is not None and "inside a CUDA graph capture" in why and "capturable=True" in why, why
