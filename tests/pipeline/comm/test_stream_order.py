"""The CUDA ordering of the pipeline, checked on the CPU: the real engine runs under
``fused_zero.testing.streamcheck.StreamChecker``, which gives it a modeled side stream (so it takes its CUDA
code path) and reports every tensor one stream touches after another stream wrote it (or writes after
another read it) with no ordering edge between them, and every block freed into one stream's pool while
another stream's use of it is not ordered before that stream.

- The matrix: every overlap mode x both reductions x GradScaler on/off (off only in bucket mode, which
  refuses a scaler) x ``param_sync`` step/forward x ``find_unused_parameters``, across DDP's bucket
  rebuild (iteration 2), an injected inf on one rank (scaler runs), a user's ``scaler.unscale_`` and
  ``clip_grad_norm_`` where they are honored (step + all_reduce), and a checkpoint save and load (both
  forms) between steps; and 8-bit moments in every overlap mode x both reductions (with a load before
  the rebuild too, which holds them in fp32 until it). All of it with the
  process groups reporting what ``init_process_group("nccl")`` makes on a GPU machine, and a subset
  (every overlap mode once, bf16 reduction in one) for "cpu:gloo,cuda:nccl" and for no backend at all:
  the code's own backend choices run (testing/streamcheck/backends.py). Zero hazards, and no host
  synchronization on the step path of any iteration (the step counts live on the device,
  step_counts.py); the old wait for them, put back, is named.
- Shard groups of 2 at four ranks and gradients reduced in bf16 (flat and sharded), every overlap mode x
  both reductions (``sharded_configs``): zero hazards too. Removing the side stream's wait for the
  reduce-scatter before the all-reduce across replicas is named, and so is a bf16 staging copy freed
  before ``step()`` joins the side stream.
- The checkpoint server: rank 0 alone calls ``state_dict()`` after step 3 in every run (its peer's
  server thread and stream are modeled); with the other host run ahead (``RunAhead``) zero hazards in
  every overlap mode; serving only the newest version (issue 23's defect 1) and a server read that does
  not wait for the published event (issue 28's defect 6) are named.
- Each ordering fix of the CUDA path, reverted, is named by the checker (the defect and its line):
  the skip counter and the GradScaler's found-inf flag written on the compute stream before it joins
  the side stream, and the found-inf flag zero-filled on the compute stream after the first reduction
  was issued, with no edge to the side stream that maxes into it; and the backend read without the
  device (``dist.get_backend``: "undefined" after ``init_process_group()``), which hands DDP no future
  for the reduce-scatter, so DDP's copy into ``param.grad`` in the backward races it; and the 8-bit
  block index made on the host (issue 23), which CUDA refuses as an index into device state: every
  operation of a device stream on pageable host memory is reported (the model and its batches are
  moved to the device first, as a training script does).
"""

from __future__ import annotations

import contextlib
import itertools
import traceback
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from scenarios import VOCAB, OddNet, batch
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.algorithms import codecs
from fused_zero.checkpoint.serving import peers as serving
from fused_zero.pipeline.comm import collectives
from fused_zero.pipeline.comm import streams as streams_module
from fused_zero.pipeline.reducing import hooks as hooks_module
from fused_zero.pipeline.reducing.reduction import Reduction
from fused_zero.pipeline.step_end.stepping import Stepping
from fused_zero.pipeline.updating.updates import Updates
from fused_zero.testing.streamcheck import StreamChecker
from fused_zero.testing.streamcheck.backends import patched

STEPS = 5
DEVICE = torch.device("cpu")  # a torch.device: the checker's device memory ("cpu" the string: the host)


def configs():
    out = []
    for overlap, reduce, scaler, sync, unused in itertools.product(
            ("bucket", "backward", "step"), ("reduce_scatter", "all_reduce"), (False, True), ("step", "forward"),
            (False, True)):
        if scaler and overlap == "bucket":
            continue
        out.append(dict(overlap=overlap, grad_reduce=reduce, scaler=scaler, param_sync=sync, find_unused=unused))
    # 8-bit moments: codes and per-row scales written by the update, decoded and encoded again by the
    # reshard, the checkpoints and the single launch's arenas
    out += [dict(overlap=overlap, grad_reduce=reduce, scaler=False, param_sync="forward", find_unused=False,
                 state_format="8bit") for overlap, reduce in itertools.product(
                     ("bucket", "backward", "step"), ("reduce_scatter", "all_reduce"))]
    # per param group formats: buckets of several parameters, each holding int8, bf16 and fp32 parts
    out += [dict(overlap=overlap, grad_reduce="reduce_scatter", scaler=False, param_sync="forward", find_unused=False,
                 mixed=True) for overlap in ("bucket", "backward", "step")]
    # Muon beside AdamW: the owners' exchange and Newton-Schulz on the side stream, every overlap mode and
    # reduction, its skip and active flags never read on the host (no wait inside a comm hook)
    out += [dict(overlap=overlap, grad_reduce=reduce, scaler=overlap != "bucket", param_sync="forward",
                 find_unused=overlap == "bucket" or reduce == "all_reduce", muon=True)
            for overlap, reduce in itertools.product(("bucket", "backward", "step"), ("reduce_scatter", "all_reduce"))]
    # the code's own backend choices after init_process_group("cpu:gloo,cuda:nccl") and with no backend
    # (every configuration above: "nccl"), every overlap mode once
    for pg in PG_BACKENDS[1:]:
        out += [dict(overlap="bucket", grad_reduce="reduce_scatter", scaler=False, param_sync="forward",
                     find_unused=True, pg_backend=pg),
                dict(overlap="backward", grad_reduce="all_reduce", scaler=True, param_sync="step", find_unused=False,
                     pg_backend=pg),
                dict(overlap="step", grad_reduce="reduce_scatter", scaler=False, param_sync="step", find_unused=False,
                     reduce_dtype=torch.bfloat16, pg_backend=pg)]
    return out


PG_BACKENDS = ("nccl", "cpu:gloo,cuda:nccl", None)
"""The ``init_process_group`` backend strings the checker models (``StreamChecker(backend=...)``)."""


def train(rank, cfg, checker, steps=STEPS, after_step=None):
    """Build and train under ``checker``; returns what the checker saw and the skipped-step count. After
    step 3 rank 0 alone calls ``state_dict()`` (nanoGPT's pattern) while the other rank goes on into step
    4: its checkpoint server's thread and stream serve it. ``after_step(opt, step)``: called on every
    rank after each step."""
    torch.manual_seed(0)
    model = OddNet().to(DEVICE)
    if not cfg["find_unused"]:
        model.never.requires_grad_(False)
    ddp = DDP(model, bucket_cap_mb=0.002 if cfg.get("mixed") else 0.0001, find_unused_parameters=cfg["find_unused"])
    params = ddp.parameters()
    if cfg.get("mixed"):
        trained = [p for p in model.parameters() if p.requires_grad]
        params = [{"params": trained[k::3], "state_format": f} for k, f in enumerate(("8bit", "bf16", "fp32"))]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if cfg["scaler"] else None
    edits = cfg["overlap"] == "step" and cfg["grad_reduce"] == "all_reduce"  # where param.grad edits count
    options = dict(ddp=ddp, overlap=cfg["overlap"], grad_reduce=cfg["grad_reduce"], param_sync=cfg["param_sync"],
                   grad_scaler=scaler, _backend=cfg.get("backend", "auto"), shard_group=cfg.get("shard"),
                   grad_reduce_dtype=cfg.get("reduce_dtype"))
    if cfg.get("muon"):  # Muon's matrices beside AdamW: two optimizers stepped as one (scenarios.Optimizers)
        from scenarios import Case, Optimizers, muon_split

        opt = Optimizers([getattr(fused_zero, kind)(groups, **options) for kind, groups in
                          muon_split(model, Case(opt="Muon"))])
    else:
        opt = fused_zero.AdamW(params, lr=1e-2, state_format=cfg.get("state_format", "fp32"), **options)
    try:
        for step in range(1, steps + 1):
            checker.phase = f"step {step}"
            x, y = (t.to(DEVICE) for t in batch(step, 0, rank))  # made on the host, as a data loader does
            use_branch = not cfg["find_unused"] or (step + rank) % 2 == 0
            loss = F.cross_entropy(ddp(x, use_branch=use_branch).reshape(-1, VOCAB), y.reshape(-1))
            if scaler is not None:
                loss = scaler.scale(loss * (float("inf") if step == 3 and rank == 1 else 1.0))
            loss.backward()
            if edits:
                if scaler is not None:
                    for o in getattr(opt, "opts", [opt]):
                        scaler.unscale_(o)
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            if scaler is not None:
                for o in getattr(opt, "opts", [opt]):
                    scaler.step(o)
                scaler.update()
            else:
                opt.step()
            if after_step is not None:
                after_step(opt, step)
            opt.zero_grad()
            if step == 3 and rank == 0:
                checker.phase = "rank-0 checkpoint"
                try:
                    opt.state_dict()
                except serving.CheckpointSyncError as e:  # noted; training goes on, with the other rank
                    REFUSALS.append(str(e))
            if step == 1 and (cfg.get("state_format") == "8bit" or cfg.get("mixed")):
                checker.phase = "checkpoint"  # before DDP's rebuild: 8-bit moments held in fp32 until it
                opt.load_state_dict(opt.state_dict())
            if step == 2:  # a checkpoint between steps, both forms, after DDP's bucket rebuild
                checker.phase = "checkpoint"
                opt.load_state_dict(opt.state_dict())
                opt.load_sharded_state_dict(opt.sharded_state_dict())
        checker.phase = "end"
        return opt.skipped_steps
    finally:
        opt._engine.close()


REFUSALS: list[str] = []
"""What rank 0's checkpoint in ``train`` was refused with, if it was (none as built)."""
def step_path_syncs(checker) -> list:
    """fused_zero's host synchronizations on the step path (DDP has its own): in every iteration, from
    the forward to ``step()`` and ``zero_grad()``, the first ones and DDP's bucket rebuild included,
    Muon's phases too; not in the checkpoints, whose reads the user asked for."""
    return [s for s in checker.syncs if s[2].startswith("step ") and s[3]]


def check_config(rank, cfg) -> str | None:
    with StreamChecker(cfg.get("pg_backend", "nccl")) as checker:
        skipped = train(rank, cfg, checker)
    problems = [str(h) for h in checker.hazards()] + [REFUSALS.pop() for _ in list(REFUSALS)]
    syncs = step_path_syncs(checker)
    if syncs:
        problems.append(f"host synchronizations on the step path: {syncs}")
    if cfg["scaler"] and skipped != 1:
        problems.append(f"skipped_steps is {skipped}, the inf on rank 1 at step 3 skipped 1")
    return "\n".join(problems) or None


def check_configs(rank, world, cfgs):
    """Every configuration's problems on this rank (a traceback where one raised), by configuration."""
    failures = {}
    for cfg in cfgs:
        try:
            found = check_config(rank, cfg)
        except Exception:
            found = traceback.format_exc()
        if found:
            failures[str(cfg)] = found
    return failures


@pytest.fixture(scope="module")
def matrix():
    return run_ranks(check_configs, 2, configs())


def test_no_stream_order_hazard_in_any_configuration(matrix):
    assert len(configs()) == 61
    for rank, failures in enumerate(matrix):
        assert not failures, f"rank {rank}, {len(failures)} of 61 configurations:\n" + "\n\n".join(
            f"{cfg}:\n{what}" for cfg, what in list(failures.items())[:3])


def sharded_configs():
    """Shard groups of 2 at four ranks (NCCL's plan: the reduce-scatter in the group, the slice
    all-reduced across replicas from the side stream) and gradients reduced in bf16 (a staging copy made
    on the compute stream, read by the reductions and the update, copied back in the all-reduce's
    future with ``all_reduce``), flat and in shard groups, in every overlap mode x both reductions;
    the GradScaler and ``find_unused_parameters`` on in some."""
    out = []
    for (overlap, reduce), (shard, dtype) in itertools.product(
            itertools.product(("bucket", "backward", "step"), ("reduce_scatter", "all_reduce")),
            ((2, None), (2, torch.bfloat16), (None, torch.bfloat16))):
        scaler = overlap != "bucket" and dtype is None
        out.append(dict(overlap=overlap, grad_reduce=reduce, scaler=scaler, param_sync="forward" if scaler else "step",
                        find_unused=overlap == "bucket" and shard is None, shard=shard, reduce_dtype=dtype))
    return out


def test_no_stream_order_hazard_with_shard_groups_and_bf16_reduction():
    assert len(sharded_configs()) == 18
    for rank, failures in enumerate(run_ranks(check_configs, 4, sharded_configs())):
        assert not failures, f"rank {rank}, {len(failures)} of 18 configurations:\n" + "\n\n".join(
            f"{cfg}:\n{what}" for cfg, what in list(failures.items())[:3])


# ---------------------------------------------------------------------- the fixes, reverted


def _count_skip_before_the_join(self, it, member):
    """Defect 1 as it was: the skip counter summed on the compute stream, before it joins the side one."""
    m = member.index
    self.skipped[m:m + 1] += it.found_inf[m:m + 1].to(torch.int64)
    if member.scaler is not None and member.scaler.enabled:
        with self.side.run(follow_current=True):
            member.scaler.publish(it.found_inf[m:m + 1])


def _publish_before_the_join(self, it, member):
    """Defect 2 as it was: the found-inf flag copied into the GradScaler on the compute stream."""
    m = member.index
    if member.scaler is not None and member.scaler.enabled:
        member.scaler.publish(it.found_inf[m:m + 1])
    with self.side.run(follow_current=True):
        self.skipped[m:m + 1] += it.found_inf[m:m + 1].to(torch.int64)


def _start_without_the_flag(self, it):
    """Defect 3 as it was (with ``_zero_filled_after_the_reduction``): no flag and no edge at the start."""
    self.side.join()
    it.hparams = [m.hparams() for m in self.members]
    it.hparams_key = [self.policy.hparams_key(m.opt.param_groups) for m in self.members]


def _zero_filled_after_the_reduction(real):
    def zero_fill_then_update(self, it, count, *args, **kwargs):
        if it.found_inf is None:  # zero-filled on the compute stream once the reduction was issued
            it.found_inf = torch.zeros(1, dtype=torch.float32, device=self.side.device)
        return real(self, it, count, *args, **kwargs)
    return zero_fill_then_update


def _step_without_the_join(real):
    def step_without_the_join(self, *args, **kwargs):
        join, self.side.join = self.side.join, lambda: None
        try:
            return real(self, *args, **kwargs)
        finally:
            self.side.join = join
    return step_without_the_join


def _forward_wait_skipped(self, module, args):
    """The forward pre-hooks waiting for nothing."""


def _finish_without_waiting(real):
    def finish_without_waiting(self, it, count, *args, **kwargs):
        for item in it.ready[:count]:
            item.works = []
        return real(self, it, count, *args, **kwargs)
    return finish_without_waiting


def _ring_reusing_a_busy_buffer(self, table):
    """A pinned buffer refilled without asking whether its last copy has run."""
    ring = self.rings.setdefault((tuple(table.shape), table.dtype), [])
    if not ring:
        ring.append((self.api.pinned_empty(table.shape, table.dtype), self.api.event()))
    ring[0][0].copy_(table)
    return ring[0]


def _end_dropping_the_copies(real):
    def end_dropping_the_copies(self, it):
        """The iteration's end as it would be if it let go of the bf16 staging copies before the join."""
        for item in it.reduced():
            item.shard.reduced_buffer = None
        it.waited, it.ready = [], []
        return real(self, it)
    return end_dropping_the_copies


def _across_without_waiting(self, works, piece):
    """The slice all-reduced across replicas without the side stream waiting for the reduce-scatter."""
    with self.side.run(follow_current=False):
        return collectives.all_reduce(piece, self.topology.replica_group)


def _backend_of_without_the_device(group, device=None) -> str:
    """The backend as it was read: ``dist.get_backend``'s one name, a mixed string's "cpu" entry where no
    device was passed."""
    name = dist.get_backend(group)
    if ":" in name:
        parts = dict(p.split(":", 1) for p in name.split(","))
        return parts.get(device.type if device is not None else "cpu", name)
    return name


def _has_future_without_the_device(group, device) -> bool:
    return _backend_of_without_the_device(group) == "nccl"


def _blocks_on_the_host(self):
    """Issue 23's defect 2 as it was: the 8-bit block index made on the host, whatever the region's
    device (CUDA refused it at the first bucket rebuild, at loads and at DCP loads)."""
    out = torch.full((self.size,), -1, dtype=torch.int64)
    for so, n, *_, block in self.rows:
        out[so:so + n] = block
    return out


BASE = dict(overlap="bucket", grad_reduce="reduce_scatter", scaler=False, param_sync="forward", find_unused=False)
REVERTED = {
    # init_process_group() with no backend: "undefined" takes NCCL's plan but hands DDP no future, so
    # DDP's copy into param.grad in the backward is not ordered after the in-place reduce-scatter
    "backend read without the device": (
        [(collectives, "backend_of", _backend_of_without_the_device),
         (collectives, "reduce_scatter_has_future", _has_future_without_the_device)],
        {**BASE, "pg_backend": None}, "(train) after communication stream 0 ran collectives.reduce_scatter"),
    "skip counter before the join": (
        [(Stepping, "_count_skip", _count_skip_before_the_join)],
        dict(overlap="step", grad_reduce="reduce_scatter", scaler=False, param_sync="step", find_unused=False),
        "_count_skip_before_the_join"),
    "GradScaler flag before the join": (
        [(Stepping, "_count_skip", _publish_before_the_join)],
        dict(overlap="step", grad_reduce="all_reduce", scaler=True, param_sync="step", find_unused=False),
        "amp.py"),
    "found-inf zero-fill unordered": (
        [(Stepping, "start_iteration", _start_without_the_flag),
         (Updates, "finish", _zero_filled_after_the_reduction(Updates.finish))],
        dict(overlap="bucket", grad_reduce="reduce_scatter", scaler=False, param_sync="step", find_unused=False),
        "zero_fill_then_update"),
    # not defects found in the code, but edges it must keep: each one removed is named too
    "step() not joining the side stream": (
        [(Stepping, "step", _step_without_the_join(Stepping.step))], BASE,
        "freed while in use"),
    "forward not waiting for the gathers": (
        [(hooks_module.ForwardWait, "__call__", _forward_wait_skipped)], BASE, "collectives.all_gather"),
    "update not waiting for the reduction": (
        [(Updates, "finish", _finish_without_waiting(Updates.finish))], BASE, "collectives.reduce_scatter"),
    "bf16 staging copy freed before the join": (
        [(Stepping, "_end_iteration", _end_dropping_the_copies(Stepping._end_iteration))],
        {**BASE, "reduce_dtype": torch.bfloat16},
        "freed while in use"),
    "8-bit block index on the host": (
        [(codecs.BlockTable, "slots", _blocks_on_the_host)], {**BASE, "state_format": "8bit"},
        ("host memory read on a device stream: compute stream ran aten.", "at fused_zero/algorithms/codecs.py",
         "_blocks_on_the_host")),
    "pinned buffer refilled while in use": (
        [(streams_module._PinnedRing, "take", _ring_reusing_a_busy_buffer)], {**BASE, "find_unused": True},
        "_ring_reusing_a_busy_buffer"),
}


def check_reverted(rank, world):
    out = {}
    for name, (patches, cfg, culprit) in REVERTED.items():
        try:
            with patched(patches), StreamChecker(cfg.get("pg_backend", "nccl")) as checker:
                train(rank, cfg, checker, steps=3)
            out[name] = (checker.report(), culprit)
        except Exception:
            out[name] = (traceback.format_exc(), culprit)
    return out


def check_across_reverted(rank, world):
    with patched([(Reduction, "_across_replicas", _across_without_waiting)]), StreamChecker() as checker:
        train(rank, {**BASE, "shard": 2}, checker, steps=3)
    return checker.report()


# ---------------------------------------------------------------------- the checkpoint server, host run-ahead


class RunAhead:
    """The host run-ahead of NCCL played under the checker (checkpoint/serving/published.py): on every rank but 0,
    once step 3 (the one rank 0 checkpoints after) has published, the host publishes once more, as its
    step 4 would on NCCL while its device still holds step 3: with step 4's event, which cannot complete
    before rank 0 is served (it follows updates that wait for a reduction rank 0 has not joined). Either
    right after the step (``where="step"``), or once its server has checked rank 0's request
    (``where="check"``, the publish landing between the check and the reads). Undone at the next real
    publish."""

    def __init__(self, checker, rank: int, where: str):
        self.checker, self.rank, self.where = checker, rank, where
        self.opt = self.undo = None

    def after_step(self, opt, step: int) -> None:
        if self.rank != 0 and step == 3:
            self.opt = opt
            if self.where == "step":
                self.publish_ahead()

    def publish_ahead(self) -> None:
        peers, api = self.opt._peers, self.opt._engine.side.api
        versions = peers.versions
        pending = self.checker.pending_event(f"rank {self.rank}'s step-4 event (its updates wait for a "
                                             "reduction the requester, rank 0, has not joined)")
        api.current = lambda: types.SimpleNamespace(record_event=lambda: pending)
        try:
            peers.published()
        finally:
            del api.current

        def undo():
            versions.newest -= 1
            versions.kept.pop()
        self.undo, self.opt = undo, None

    @contextlib.contextmanager
    def installed(self):
        real_published, real_ready = serving.CheckpointPeers.published, serving.CheckpointPeers.ready_for
        ahead = self

        def published(peers, by_step=True):
            if ahead.undo is not None:
                ahead.undo()
                ahead.undo = None
            real_published(peers, by_step)

        def ready_for(peers, version, fingerprint):
            out = real_ready(peers, version, fingerprint)
            if ahead.where == "check" and ahead.opt is not None and peers is ahead.opt._peers:
                ahead.publish_ahead()
            return out

        serving.CheckpointPeers.published, serving.CheckpointPeers.ready_for = published, ready_for
        try:
            yield self
        finally:
            serving.CheckpointPeers.published, serving.CheckpointPeers.ready_for = real_published, real_ready


def _ready_for_the_newest(real):
    def ready_for_the_newest(self, version, fingerprint):
        """Defect 1 as it was: only the newest version is served (its events, its shards)."""
        why, record = real(self, version, fingerprint)
        newest = self.versions.newest
        if not why and newest != version:
            why = (f"rank {self.view.ranks.rank} is at version {newest} (completed steps and loads), the "
                   f"requester at {version}: " + serving.USAGE)
        return why, record
    return ready_for_the_newest


def _send_the_newest(real):
    def send_the_newest(self, ch, dst, k, record):
        return real(self, ch, dst, k, self.versions.kept[-1])
    return send_the_newest


def _host_without_waiting(self, shard, name, events):
    """Issue 28's defect 6: the server reads the region without waiting for the published events."""
    return _real_host(self, shard, name, ())


_real_host = serving.CheckpointPeers._host


def check_run_ahead(rank, world):
    """Each of SERVING_RUNS: the checker's report on this rank with the host run-ahead played
    (``where``: None for none) and the patches applied; a traceback where the run raised."""
    out = {}
    for name, (patches, cfg, where) in SERVING_RUNS.items():
        try:
            with patched(patches), StreamChecker() as checker:
                ahead = RunAhead(checker, rank, where or "none")
                with ahead.installed():
                    train(rank, cfg, checker, steps=4, after_step=ahead.after_step)
            out[name] = "\n".join([checker.report()] + [REFUSALS.pop() for _ in list(REFUSALS)])
        except Exception:
            out[name] = traceback.format_exc()
    return out


NEWEST_ONLY = [(serving.CheckpointPeers, "ready_for", _ready_for_the_newest(serving.CheckpointPeers.ready_for)),
               (serving.CheckpointPeers, "send_slices", _send_the_newest(serving.CheckpointPeers.send_slices))]
RUN_AHEAD = {f"ahead after the {where}, {overlap}": ([], {**BASE, "overlap": overlap}, where)
             for where in ("step", "check") for overlap in ("bucket", "backward", "step")}
SERVING_RUNS = {
    **RUN_AHEAD,
    "defect 1, run-ahead after the step": (NEWEST_ONLY, BASE, "step"),
    "defect 1, run-ahead after the check": (NEWEST_ONLY, BASE, "check"),
    "defect 6: no wait for the published event": ([(serving.CheckpointPeers, "_host", _host_without_waiting)],
                                                  BASE, None),
}


@pytest.fixture(scope="module")
def serving_runs():
    return run_ranks(check_run_ahead, 2)


def test_no_hazard_while_the_other_host_runs_ahead(serving_runs):
    for rank, reports in enumerate(serving_runs):
        for name in RUN_AHEAD:
            assert reports[name] == "no stream-order hazard", f"rank {rank}, {name}: {reports[name]}"


def test_serving_only_the_newest_version_is_named_with_the_host_ahead(serving_runs):
    """Defect 1 reverted: refused (the publish landed before the check) or a wait for the event of a
    step that waits for the requester (after it), which the checker names."""
    refused = serving_runs[0]["defect 1, run-ahead after the step"]
    assert "rank 1 is at version 6 (completed steps and loads), the requester at 5" in refused, refused
    waited = serving_runs[1]["defect 1, run-ahead after the check"]
    assert "deadlock" in waited and "checkpoint server stream" in waited and "step-4 event" in waited, waited


def test_server_reading_before_the_published_event_is_named(serving_runs):
    for report in (runs["defect 6: no wait for the published event"] for runs in serving_runs):
        assert "checkpoint server stream ran copy device->host" in report and "update kernel" in report, report


def test_cross_replica_all_reduce_without_its_wait_is_named():
    """The edge the replicas add (the side stream waits for the shard group's reduce-scatter before it
    issues the all-reduce across replicas), removed, at four ranks in shard groups of 2."""
    report = run_ranks(check_across_reverted, 4)[0]
    assert "collectives.reduce_scatter" in report and "collectives.all_reduce" in report, report


@pytest.fixture(scope="module")
def reverted():
    return run_ranks(check_reverted, 2)


@pytest.mark.parametrize("name", list(REVERTED))
def test_each_fix_reverted_is_named(reverted, name):
    report, culprit = reverted[0][name]
    culprits = (culprit,) if isinstance(culprit, str) else culprit
    assert report != "no stream-order hazard" and all(c in report for c in culprits), report


# ---------------------------------------------------------------------- host synchronizations


def _segments_built_blocking(real):
    def build_blocking(pieces, device="cpu", *, grad_across_allocations=False, upload=None):
        """Segments.build as it was: the table copied to the device with a blocking ``.to(device)``."""
        segments = real(pieces, device, grad_across_allocations=grad_across_allocations)
        return type(segments)(segments.rows.to(torch.device("cpu")), *(
            getattr(segments, f) for f in ("shard_extent", "param_extent", "grad_extent", "n_params")))
    return build_blocking


def _begin_with_a_host_wait(real):
    def begin_with_a_host_wait(self):
        """The step counts as they were kept (on the host, design-streams.md's old edge 6): the iteration's first
        coefficient table waited for the last updates' flags, copied to the host, with an event wait."""
        side = self.side
        if side.stream is not None:
            with side.run(follow_current=False):
                side.api.to_host(self.counts, side.api.pinned_empty(self.counts.shape, self.counts.dtype))
                side.stream.record_event().synchronize()
        return real(self)
    return begin_with_a_host_wait


def check_host_syncs(rank, world):
    """The Triton backend (interpreted) in bucket mode, across the rebuild (new shards build their row
    tables inside the hook): every table reaches the device through the side stream's pinned uploads.
    Then the same with the row tables copied the way they were (a blocking ``.to(device)``), and with
    the step counts waited for as they were. Returns each run's host synchronizations."""
    from fused_zero.kernels import Segments
    from fused_zero.pipeline.updating.step_counts import StepCounts

    cfg = {**BASE, "param_sync": "step", "backend": "triton"}
    out = {}
    for name in ("as built", "reverted", "step counts waited for"):
        real, begin = Segments.build, StepCounts.begin_iteration
        if name == "reverted":
            Segments.build = staticmethod(_segments_built_blocking(real))
        if name == "step counts waited for":
            StepCounts.begin_iteration = _begin_with_a_host_wait(begin)
        try:
            with StreamChecker() as checker:
                train(rank, cfg, checker, steps=3)
            # a load copies the user's host dict into the regions: blocking by nature, and off the step path
            out[name] = [s for s in checker.syncs if s[3] and "blocking" in s[0] and "checkpoint" not in s[2]]
            out[name, "step path"] = step_path_syncs(checker)
        finally:
            Segments.build = staticmethod(real) if name == "reverted" else real
            StepCounts.begin_iteration = begin
    return out


@pytest.fixture(scope="module")
def host_syncs():
    return run_ranks(check_host_syncs, 2)[0]


def test_no_blocking_copy_on_the_step_path(host_syncs):
    runs = host_syncs
    as_built, reverted = runs["as built"], runs["reverted"]
    assert as_built == [], as_built
    assert any(s[2].startswith("step") for s in reverted), reverted  # the hook's resharding builds tables


def test_no_host_wait_on_the_step_path_and_the_old_step_count_wait_is_named(host_syncs):
    """The step counts live on the device (step_counts.py): the step path of every iteration, the bucket
    rebuild included, has no host synchronization; put back, the old wait for the counts is named."""
    runs = host_syncs
    assert runs["as built", "step path"] == [], runs["as built", "step path"]
    waited = runs["step counts waited for", "step path"]
    assert [s[0] for s in waited] == ["event.synchronize()"] * 3, waited


# ---------------------------------------------------------------------- a refusal one rank alone sees


def _late_lr_on_rank_zero(rank, world, modeled: bool, overlap: str):
    """A scheduler stepped under ``if rank == 0`` between the backward and ``step()`` at step 3: the update
    ran in the backward with the old lr, which rank 0 alone learns. Returns where each rank raised and
    with what, the checker's hazards and its host synchronizations on the step path (modeled: the
    stream-order checker's CUDA; else gloo's host-blocking collectives)."""
    torch.manual_seed(0)
    model = OddNet().to(DEVICE)
    model.never.requires_grad_(False)
    checker = StreamChecker() if modeled else contextlib.nullcontext()
    raised = None
    with checker:
        ddp = DDP(model, bucket_cap_mb=0.0001)
        opt = fused_zero.AdamW(ddp.parameters(), lr=1e-2, ddp=ddp, overlap=overlap)
        try:
            for step in range(1, 6):
                if modeled:
                    checker.phase = f"step {step}"
                x, y = (t.to(DEVICE) for t in batch(step, 0, rank))
                where = "forward"
                loss = F.cross_entropy(ddp(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1))
                where = "backward"
                loss.backward()
                if step == 3 and rank == 0:
                    opt.param_groups[0]["lr"] = 5e-3
                where = "step"
                opt.step()
                opt.zero_grad()
        except RuntimeError as e:
            raised = (step, where, type(e).__name__, str(e).split(":")[0] + ": " + str(e).split(":")[1][:80])
        finally:
            opt._engine.close()
    if not modeled:
        return dict(raised=raised)
    syncs = [s for s in checker.syncs if s[2].startswith("step ") and s[3]]
    return dict(raised=raised, hazards=[str(h) for h in checker.hazards()], syncs=syncs)


@pytest.mark.parametrize("overlap", ["bucket", "backward"])
def test_a_refusal_one_rank_alone_sees_raises_on_every_rank(overlap):
    """On CUDA (the checker's model) rank 0 raises in its step 3; rank 1, which cannot learn it without
    reading the device, raises at its next forward, from the flags all-reduced at step 3, before any
    collective of step 4, which rank 0 will never join: nobody hangs. No host synchronization on the step
    path for it. On gloo (host-blocking) both raise in step 3."""
    modeled = run_ranks(_late_lr_on_rank_zero, 2, True, overlap)
    assert modeled[0]["raised"][:3] == (3, "step", "RuntimeError"), modeled[0]
    assert "param_groups changed" in modeled[0]["raised"][3], modeled[0]
    assert modeled[1]["raised"][:3] == (4, "forward", "RefusedOnAnotherRank"), modeled[1]
    for seen in modeled:
        assert not seen["hazards"] and not seen["syncs"], seen
    plain = run_ranks(_late_lr_on_rank_zero, 2, False, overlap)
    assert [r["raised"][:3] for r in plain] == [(3, "step", "RuntimeError")] * 2, plain


# ---------------------------------------------------------------------- reading the parameters outside a forward


def _ema_after_step(rank, world, synchronized: bool):
    """An EMA of the parameters updated after every ``step()`` (AveragedModel's loop), with
    param_sync="forward", whose all-gathers are still in flight when ``step()`` returns: with
    ``opt.synchronize()`` first (docs/usage.md) and without. Returns the checker's hazards."""
    ema = []

    def after_step(opt, step):
        if synchronized:
            opt.synchronize()
        params = [p for g in opt.param_groups for p in g["params"]]
        with torch.no_grad():
            if not ema:
                ema.extend(p.detach().clone() for p in params)
            for e, p in zip(ema, params):
                e.mul_(0.9).add_(p, alpha=0.1)

    with StreamChecker() as checker:
        train(rank, {**BASE, "param_sync": "forward"}, checker, steps=3, after_step=after_step)
    return [str(h) for h in checker.hazards()]


def test_an_ema_read_after_step_with_param_sync_forward_waits_for_synchronize():
    """The stale read ``opt.synchronize()`` prevents: without it the EMA reads parameters an all-gather is
    still writing (named by the checker); with it, no hazard."""
    assert run_ranks(_ema_after_step, 2, True) == [[], []]
    for hazards in run_ranks(_ema_after_step, 2, False):
        assert any("collectives.all_gather" in h for h in hazards), hazards
