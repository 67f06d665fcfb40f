"""Defects of the CUDA path that a CPU can show: what the comm hook hands back to DDP, the device guard
and priority of the side stream, collectives that block the host, the dtype of the resharding buffers,
and amsgrad on a NaN gradient. The GPU side (stream ordering on a device) is in tests/gpu/.

The multi-rank checks share one 2-rank spawn; each returns None or what went wrong.
"""

from __future__ import annotations

import contextlib
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from scenarios import VOCAB, Case, batch, run_case, twin_models
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
import fused_zero.pipeline.engine
import fused_zero.pipeline.updating.norm_check
import fused_zero.pipeline.updating.warmup
from fused_zero.kernels import Segments, adam_coefficients, adam_step
from fused_zero.pipeline.comm.streams import SideStream
from fused_zero.pipeline.engine import Engine
from fused_zero.pipeline.updating.warmup import compile_kernels

OVERLAPS = ("bucket", "backward", "step")


def _models(as_view: bool, find_unused: bool = False):
    model, ref = twin_models(freeze_never=not find_unused)
    kw = dict(bucket_cap_mb=0.0001, gradient_as_bucket_view=as_view, find_unused_parameters=find_unused)
    return model, DDP(model, **kw), ref, DDP(ref, **kw)


def _loss(ddp, step, rank, use_branch=True):
    x, y = batch(step, 0, rank)
    return F.cross_entropy(ddp(x, use_branch=use_branch).reshape(-1, VOCAB), y.reshape(-1))


def check_all_reduce_grad_is_ddps(rank, world):
    """a: with grad_reduce="all_reduce", param.grad as backward returns is DDP's averaged gradient.
    Rank 1 starts its backward late, so rank 0's all-reduces cannot have completed when its backward
    returns unless DDP waited for them; a completed future would let rank 0 read half its own gradient.
    """
    for overlap in OVERLAPS:
        for as_view in (True, False):
            model, ddp, ref, ref_ddp = _models(as_view)
            opt = fused_zero.SGD(ddp.parameters(), lr=0.05, momentum=0.9, ddp=ddp, overlap=overlap,
                                 grad_reduce="all_reduce")
            ref_opt = torch.optim.SGD(ref_ddp.parameters(), lr=0.05, momentum=0.9, foreach=False)
            for step in range(1, 4):  # the second crosses DDP's bucket rebuild
                _loss(ref_ddp, step, rank).backward()
                expected = [p.grad.clone() for p in ref.parameters() if p.grad is not None]
                if rank == 1:
                    time.sleep(0.15)
                _loss(ddp, step, rank).backward()
                got = [p.grad.clone() for p in model.parameters() if p.grad is not None]
                where = f"overlap={overlap} as_view={as_view} step {step}"
                for i, (a, b) in enumerate(zip(got, expected)):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9,
                                               msg=lambda m, i=i, where=where: f"{where} grad {i}: {m}")
                ref_opt.step()
                ref_opt.zero_grad()
                opt.step()
                opt.zero_grad()
            opt._engine.close()


def check_find_unused_issues_no_blocking_collective(rank, world):
    """d: with find_unused_parameters, the hook all-reduces the used flags asynchronously (a blocking
    all-reduce is a host sync on CUDA, per bucket), and the step counts still follow torch.optim's."""
    calls, in_hook = [], []
    real, real_hook = dist.all_reduce, Engine.on_bucket

    def recording(*args, **kw):
        if in_hook:  # construction's own collectives (attach's agreement) are not the hook's
            calls.append(bool(kw.get("async_op", False)))
        return real(*args, **kw)

    def hook(self, bucket):
        in_hook.append(True)
        try:
            return real_hook(self, bucket)
        finally:
            in_hook.pop()

    dist.all_reduce, Engine.on_bucket = recording, hook
    try:
        out = run_case(Case(graph="find_unused", bucket_cap_mb=0.0001, steps=6), rank, world)
    finally:
        dist.all_reduce, Engine.on_bucket = real, real_hook
    assert calls, "no all-reduce of the used flags was issued"
    assert all(calls), f"{calls.count(False)} of {len(calls)} all-reduces from the hook block the host"
    assert out["worst"] < 1e-4, out


def check_reshard_under_float64_default(rank, world):
    """f: resharding under torch.set_default_dtype(torch.float64) moves float32 state."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = run_case(Case(bucket_cap_mb=0.0001, steps=4), rank, world)
    finally:
        torch.set_default_dtype(old)
    assert out["layout_changes"] > 0, "no resharding happened: the check proves nothing"
    assert out["worst"] < 1e-4, out


class GuardRecorder:
    """Records whether code runs inside a CPU SideStream's ``run()``, the device guard: installed on the
    engine's side stream itself, the one object every stage was built with."""

    def __init__(self, side: SideStream):
        self.depth, self._run = 0, side.run
        side.run = self.run

    @contextlib.contextmanager
    def run(self, *args, **kwargs):
        self.depth += 1
        try:
            with self._run(*args, **kwargs):
                yield
        finally:
            self.depth -= 1


def check_every_launch_under_the_guard(rank, world):
    """c (engine side): every update and norm launch, kernel warm-up included, runs inside
    ``SideStream.run``, which enters the parameters' device guard (test_side_stream_guard_and_priority)."""
    outside = []
    for overlap in OVERLAPS:
        model, ddp, ref, ref_ddp = _models(as_view=True)
        opt = fused_zero.AdamW(ddp.parameters(), lr=1e-2, ddp=ddp, overlap=overlap, _backend="torch",
                               max_grad_norm=1.0 if overlap == "step" else None)
        engine = opt._engine
        side = GuardRecorder(engine.side)
        # the update is the algorithm's; the norm pass a function the check and the warm-up call
        owners = ((engine.members[0].algo, "apply"), (fused_zero.pipeline.updating.norm_check, "grad_sumsq"),
                  (fused_zero.pipeline.updating.warmup, "grad_sumsq"))
        reals = [getattr(owner, name) for owner, name in owners]
        for (owner, name), real in zip(owners, reals):

            def wrapped(*args, _real=real, _name=name, _side=side, _overlap=overlap, **kw):
                if _side.depth == 0:
                    outside.append((_overlap, _name, args[0]))
                return _real(*args, **kw)

            setattr(owner, name, wrapped)
        try:
            # the warm-up launches (Triton, through the interpreter here)
            compile_kernels(engine.parameters, engine.options, engine.side)
            for step in range(1, 3):
                _loss(ddp, step, rank).backward()
                opt.step()
                opt.zero_grad()
        finally:
            for (owner, name), real in zip(owners, reals):
                setattr(owner, name, real)
        engine.close()
    assert not outside, f"launches outside the device guard: {outside}"


def check_refusals_agree_on_the_parameters_device(rank, world):
    """8.1: a refused load is agreed on through the optimizer's own collectives on the parameters'
    device, not ``all_gather_object`` (which would put every rank's tensor on cuda:0 under NCCL in a
    script that never calls ``set_device``)."""
    import torch.distributed as dist

    from fused_zero.checkpoint.checks import StateDictError

    model, ddp, ref, ref_ddp = _models(as_view=True)
    opt = fused_zero.AdamW(ddp.parameters(), lr=1e-2, ddp=ddp)
    _loss(ddp, 1, rank).backward()
    opt.step()
    sd = opt.state_dict()
    if rank == 1:
        sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"][:1]  # a corrupt copy on one rank only
    real = dist.all_gather_object
    dist.all_gather_object = None  # any call fails
    try:
        opt.load_state_dict(sd)
    except StateDictError as e:
        expected = "state 'exp_avg' has shape" if rank == 1 else "rank 1 refused the state dict"
        assert expected in str(e), str(e)
    else:
        raise AssertionError("the corrupt dict loaded")
    finally:
        dist.all_gather_object = real
        opt._engine.close()


def _float64_default_dicts(rank, world):
    """5: under ``set_default_dtype(torch.float64)`` an fp32 model's state comes out float32 from every
    checkpoint path (it was float64 at world 1, and refused by gloo at world 2), and a float64 model is
    refused at construction, naming the parameter (it crashed in the backward)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model, ddp, ref, ref_ddp = _models(as_view=True)
        for m in (model, ref):
            m.float()
        ddp, ref_ddp = (DDP(m, bucket_cap_mb=0.0001) for m in (model, ref))
        for overlap in OVERLAPS:
            opt = fused_zero.AdamW(ddp.parameters(), lr=1e-2, ddp=ddp, overlap=overlap)
            for step in range(1, 3):
                _loss(ddp, step, rank).backward()
                opt.step()
                opt.zero_grad()
            for sd in (opt.state_dict(), opt.state_dict(to=0)):
                if sd is not None:
                    dtypes = {v.dtype for entry in sd["state"].values() for v in entry.values()}
                    assert dtypes == {torch.float32}, f"{overlap}: {dtypes}"
            opt.load_state_dict(opt.state_dict())
            opt.load_sharded_state_dict(opt.sharded_state_dict())
            opt._engine.close()
            ddp = DDP(model, bucket_cap_mb=0.0001)
        wide = DDP(torch.nn.Linear(3, 2))
        try:
            fused_zero.AdamW(wide.parameters(), ddp=wide)
        except ValueError as e:
            assert "torch.float64" in str(e) and "parameter 0" in str(e), str(e)
        else:
            raise AssertionError("a float64 model was accepted")
    finally:
        torch.set_default_dtype(old)


def check_float64_default(rank, world):
    _float64_default_dicts(rank, world)


CHECKS = [check_all_reduce_grad_is_ddps, check_float64_default, check_refusals_agree_on_the_parameters_device,
          check_find_unused_issues_no_blocking_collective, check_reshard_under_float64_default,
          check_every_launch_under_the_guard]


def run_checks(rank, world):
    out = {}
    for check in CHECKS:
        try:
            check(rank, world)
            out[check.__name__] = None
        except Exception:
            out[check.__name__] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(run_checks, 2)


@pytest.mark.parametrize("name", [c.__name__ for c in CHECKS])
def test_two_ranks(two_ranks, name):
    for rank, results in enumerate(two_ranks):
        assert results[name] is None, f"rank {rank}:\n{results[name]}"


class _FakeCuda:
    """Just enough of torch.cuda to build a SideStream for cuda:1 on a machine without CUDA."""

    def __init__(self):
        self.streams, self.guards, self.entered = [], [], []

    def install(self, monkeypatch):
        fake = self

        class Stream:
            @staticmethod
            def priority_range():
                return (0, -5)

            def __init__(self, device=None, priority=0):
                fake.streams.append((device, priority))

            def wait_stream(self, other):
                pass

        @contextlib.contextmanager
        def device(d):
            fake.guards.append(torch.device(d))
            yield

        @contextlib.contextmanager
        def stream(s):
            fake.entered.append(s)
            yield

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))


def test_side_stream_guard_and_priority(monkeypatch):
    """c and g: the side stream of cuda:1 is created there with the highest priority the device offers,
    and everything queued on it runs under cuda:1's device guard, whatever the current device is. With
    check_every_launch_under_the_guard this proves every launch is guarded; the GPU tests run it."""
    fake = _FakeCuda()
    fake.install(monkeypatch)
    side = SideStream(torch.device("cuda", 1))
    assert fake.streams[0] == (torch.device("cuda", 1), -5), fake.streams
    with side.run(follow_current=True):
        assert fake.guards == [torch.device("cuda", 1)], fake.guards
        assert fake.entered == [side.stream]


def test_float64_default_at_world_1():
    import torch.distributed as dist

    from fused_zero.demo.spawn import _free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        _float64_default_dicts(0, 1)
    finally:
        dist.destroy_process_group()


def test_torch_backend_is_refused_on_cuda():
    """7: the torch backend is the CPU path (host reads of its flags, CPU scalars): refused on CUDA at
    construction instead of crashing at the first step."""
    from fused_zero.options import ShardingOptions

    with pytest.raises(ValueError, match="_backend='torch' is the CPU path"):
        ShardingOptions(_backend="torch").resolved_backend(torch.device("cuda", 0))
    assert ShardingOptions(_backend="torch").resolved_backend(torch.device("cpu")) == "torch"
    assert ShardingOptions().resolved_backend(torch.device("cuda", 0)) == "triton"


class _NeverDone:
    """A CUDA event whose copy never completes; synchronizing it is what must not happen."""

    def __init__(self):
        self.synchronized = 0

    def query(self):
        return False

    def synchronize(self):
        self.synchronized += 1

    def record(self, stream=None):
        pass


def test_pinned_uploads_never_wait_on_the_host():
    """8.2: with every earlier copy still in flight (a backward of many same-shaped buckets), the
    pinned ring adds a buffer instead of waiting for the oldest; once copies complete, it reuses them
    and shrinks back to its bound."""
    from fused_zero.pipeline.comm.streams import _PinnedRing

    events = []

    class Api:
        def pinned_empty(self, shape, dtype):
            return torch.empty(shape, dtype=dtype)

        def event(self):
            events.append(_NeverDone())
            return events[-1]

    ring = _PinnedRing(Api(), keep=4)
    table = torch.ones(2, 3)
    taken = [ring.take(table)[0] for _ in range(40)]
    assert len({id(t) for t in taken}) == 40 and not any(e.synchronized for e in events)
    for e in events:
        e.query = lambda: True
    ring.take(table)
    assert len(ring.rings[((2, 3), torch.float32)]) == 4, "idle buffers beyond the bound were kept"


def test_amsgrad_keeps_a_nan_like_torch():
    """e: torch.maximum propagates NaN into max_exp_avg_sq; the kernel must keep it too."""
    n = 37
    torch.manual_seed(0)
    p0 = torch.randn(n)
    ref = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-2, amsgrad=True, foreach=False)
    param, m, v, vmax = p0.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    seg = Segments.build([(0, n, 0, 0, 0)])
    for step in range(1, 4):
        g = torch.randn(n)
        if step == 2:
            g[5] = float("nan")
        ref.grad = g.clone()
        opt.step()
        coefs = adam_coefficients(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, step=step,
                                  decoupled=True)
        adam_step(seg, coefs, grad=g, param=param, exp_avg=m, exp_avg_sq=v, max_exp_avg_sq=vmax)
    state = opt.state[ref]
    assert state["max_exp_avg_sq"][5].isnan()
    for name, ours in (("exp_avg", m), ("exp_avg_sq", v), ("max_exp_avg_sq", vmax), ("param", param)):
        theirs = ref.detach() if name == "param" else state[name]
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7, equal_nan=True,
                                   msg=lambda e, name=name: f"{name}: {e}")


def test_8bit_regions_are_decoded_and_encoded_on_their_device():
    """8-bit moments decoded (``codecs.values``) and encoded (``store_values``, the reshard's and the
    loads' path) read no host tensor on the device: the block index is made on the region's device
    (issue 23, defect 2: built on the host, CUDA refused it as an index at the first bucket rebuild).
    Under the checker, whose device memory is what a factory makes with a ``device=`` torch.device; two
    pieces with a gap no row covers. The codes and scales are the ones a masked encoding gives."""
    from fused_zero.algorithms import codecs
    from fused_zero.kernels import row_table
    from fused_zero.testing.streamcheck import StreamChecker

    device = torch.device("cpu")
    x = torch.randn(3200, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    with StreamChecker() as checker:
        rows = row_table([(0, 3000, 0, 0, 0, 0), (3104, 70, 3000, 3000, 1, 0)])  # host memory, as a shard's
        region = torch.zeros(3200, dtype=torch.uint8, device=device)
        scale = torch.zeros(rows.shape[0], dtype=torch.float32, device=device)
        blocks = codecs.BlockTable(rows, 3200, device)  # as a shard's part builds it
        codecs.store_values(region, scale, blocks, "exp_avg", x.to(device))
        decoded = codecs.values(region, scale, blocks, "exp_avg")
    assert checker.hazards() == [], checker.report()
    block = torch.full((3200,), -1, dtype=torch.int64, device="cpu")
    for so, n, b in rows[:, [0, 1, 7]].tolist():
        block[so:so + n] = b
    covered = block >= 0
    codes, s = codecs.encode_blocks(x[covered], block[covered], rows.shape[0], True)
    assert torch.equal(region[covered], codes) and not region[~covered].any() and torch.equal(scale, s)
    expected = torch.zeros(3200, dtype=torch.float32, device="cpu")
    expected[covered] = codecs.decode8(codes, True) * s[block[covered]]
    assert torch.equal(decoded, expected)
