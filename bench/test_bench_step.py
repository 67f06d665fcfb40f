"""Where a training iteration's time goes, fused_zero against DDP + torch.optim and DDP + ZeRO.

Every scenario spawns its ranks (gloo on CPU, ``torch.set_num_threads(1)`` per rank; NCCL with one rank
per GPU on a CUDA machine), builds every system on the same model (same seed) and the same batches, and
runs each one for ``WARMUP`` warm-up and ``ITERS`` measured iterations *inside the ranks*. The systems
run one after the other in blocks, over ``ROUNDS`` rounds (the second round in reverse order, after one
more warm-up iteration each, so that slow drift of a shared machine hits every system alike), never
interleaved iteration by iteration: fused_zero's all-gathers run on after ``step()`` and are waited for
by the next forward, and another system's iteration in between would hide them for free. At the end
of a block fused_zero's ``synchronize()`` runs, untimed, for the same reason.

Systems (all: DDP with ``gradient_as_bucket_view=True``, the same ``bucket_cap_mb``, one param group,
lr 1e-3, weight decay 0.1, fp32):

    ddp+torch-adamw       torch.optim.AdamW(fused=True) (foreach, then the default, where fused is
                          refused); the baseline.
    ddp+zero              torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=AdamW, same
                          implementation flag). With NCCL it overlaps with DDP through
                          ``ddp_zero_hook.hook_with_zero_step(allreduce_hook, ...)`` and
                          ``overlap_with_ddp=True`` (its first 2-3 iterations do not update: the warm-up
                          covers them; ``step()`` is not called, the hook steps). With gloo that hook
                          refuses to run (it may hang), so it is plain ``ZeroRedundancyOptimizer.step()``
                          (local step, then a broadcast of every rank's parameters).
    fused_zero-bucket     fused_zero.AdamW(overlap="bucket"), and -backward, -step the other overlap
                          modes; grad_reduce default (reduce_scatter).

One iteration is timed in phases: forward (loss included; for fused_zero it also waits for the previous
step's all-gathers), backward (for fused_zero in bucket/backward mode this includes the bucket updates
run by the comm hook), ``opt.step()`` and ``zero_grad(set_to_none=True)``; iteration = their sum. On CPU
with ``time.perf_counter``; on CUDA with events recorded on the current stream, read once the block is
done (nothing synchronizes the host inside a block), so the phases are GPU-timeline times.

What pytest-benchmark reports: its statistics are the in-rank, rank-0 per-iteration times, not the spawn.
``ReplayClock`` is the benchmark timer and the benchmarked function only advances it by the next measured
duration, so each "round" is one measured iteration (as ``CudaEventClock`` in test_bench_kernels.py
feeds CUDA-event times). ``extra_info`` holds the rest (system, world, params, per-phase means, state
bytes, the hidden share, per-rank means).

Benchmarks (groups):

    step-<model>          world 2 (CUDA: min(GPUs, 2), so 1 on a one-GPU machine), the demo GPT at a few
                          sizes (CPU: n_embd 64/128, 2/4 layers, 0.1M-0.8M parameters; CUDA: up to
                          n_embd 1024, 8 layers, ~100M), batch 4 x 64 tokens per rank so that the
                          optimizer is a larger part of the iteration: every system's
                          iteration time (``measure=iteration``) and the time of ``opt.step()`` alone
                          (``measure=opt.step``). fused_zero's ``opt.step()`` in bucket and backward mode
                          is near zero because the updates already ran inside the backward: that is
                          reported as it is, the work is in ``bwd_ms``.
    e2e                   the ``fused-zero demo`` configuration (GPT n_embd 64, 2 layers, batch 16,
                          block 64, bucket_cap_mb 0.1), all five systems at world 2: iteration time,
                          optimizer state per rank and the hidden share.
    host-w<W>             the orchestrator's own host cost: ``Engine.on_bucket`` (the DDP comm hook) is
                          wrapped in the ranks to add up ``time.perf_counter`` deltas and count calls;
                          the statistic is, per iteration, time inside on_bucket / buckets (nothing
                          subtracted). ``algo.apply`` is counted as well ("launches": update calls per
                          step) and timed (``update_us_per_launch``). The demo GPT with 10 layers (124
                          parameters) and bucket_cap_mb 0.0001: one bucket per parameter, 124 buckets;
                          world 1 and 2; overlap bucket, backward and step. On CPU with backend
                          "torch", bucket mode runs the update itself (and the wait for the previous
                          bucket's reduction) inside on_bucket, so its µs/bucket is update + wait +
                          orchestration, and backward mode runs every update in the last on_bucket; in
                          step mode on_bucket only starts the reduction (the updates run in
                          ``step()``), so its µs/bucket is the orchestration alone (bucket lookup,
                          hyperparameters, collectives issued). On CUDA all are host time to enqueue
                          work, the number that must stay below the GPU's time per bucket.
    scaling-<model>       world 1, 2, 4 (CUDA: only those that fit the GPUs), two or three model sizes,
                          fused_zero-bucket against ddp+torch-adamw: per-rank iteration and step time and
                          optimizer state per rank. Weak scaling: batch 4 x 64 tokens per rank whatever
                          the world. On a 2-core CPU machine 4 ranks are oversubscribed (``oversubscribed``
                          in extra_info): their times measure contention as much as anything.

Optimizer-state bytes per rank (``state_bytes``): fused_zero ``opt.memory()["state"]`` (the moments of
1/W of the model plus small replicated tails: gradients are reduced in place in DDP's buckets); torch AdamW 8 bytes per
parameter (exp_avg and exp_avg_sq in fp32; nothing else counted); ZeroRedundancyOptimizer the bytes of
every tensor in its local optimizer's state on that rank (step counters included; it assigns whole
parameters, or whole buckets with NCCL, to ranks, so ranks differ: ``state_bytes_ranks``).

Hidden share, for every fused_zero system in a scenario that also ran ddp+torch-adamw::

    hidden = clamp(1 - (t_iter_fused - t_fwd_bwd_plain) / t_step_plain, 0, 1)

with ``t_iter_fused`` fused_zero's iteration time, ``t_fwd_bwd_plain`` plain DDP's forward + backward and
``t_step_plain`` torch AdamW's ``opt.step()`` time, medians of the same run. 1: the iteration costs no
more than plain DDP's forward + backward (the whole step is hidden); 0: it costs at least plain DDP's
forward + backward + step. ``iter_minus_plain_ms`` (fused_zero iteration minus plain DDP's iteration) is
the same comparison without the division. Where torch's step is tiny next to the iteration's noise
(small models on CPU, where fused AdamW steps 100K parameters in about a millisecond) the ratio swings
between its clamps: read it on the GPU.

Run (bench/ is not part of the default ``pytest`` run, whose testpaths are tests/)::

    pytest bench/test_bench_step.py --benchmark-json out.json
    pytest bench/ --benchmark-json out.json -q && python bench/report.py out.json --out report/

``FUSED_ZERO_BENCH_ITERS`` / ``FUSED_ZERO_BENCH_WARMUP`` override the iteration counts,
``FUSED_ZERO_BENCH_TIMEOUT`` the seconds one spawn of ranks may take. Nothing is asserted about time.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from fused_zero.demo import spawn

CUDA = torch.cuda.is_available()
N_GPUS = torch.cuda.device_count() if CUDA else 0
BACKEND = "nccl" if CUDA else "gloo"
CPU_COUNT = os.cpu_count() or 1

WARMUP = int(os.environ.get("FUSED_ZERO_BENCH_WARMUP", 5 if CUDA else 3))  # ZeRO's hook: >= 3 on NCCL
ITERS = int(os.environ.get("FUSED_ZERO_BENCH_ITERS", 20 if CUDA else 10))
ROUNDS = 2
REWARM = 1  # warm-up iterations of every block after the first round's
SPAWN_TIMEOUT = float(os.environ.get("FUSED_ZERO_BENCH_TIMEOUT", 300))
COLLECTIVE_TIMEOUT = 120.0

LR, WEIGHT_DECAY = 1e-3, 0.1

SYSTEMS = ["ddp+torch-adamw", "ddp+zero", "fused_zero-bucket", "fused_zero-backward", "fused_zero-step"]
BASELINE = "ddp+torch-adamw"

# model label: (n_embd, n_layer, n_head). CPU: small enough for the whole file to run in minutes on 2
# cores; CUDA: from launch-bound to large enough for the update to matter.
STEP_MODELS = ({"n64-l2": (64, 2, 4), "n512-l6": (512, 6, 8), "n1024-l8": (1024, 8, 16)} if CUDA
               else {"n64-l2": (64, 2, 4), "n128-l2": (128, 2, 4), "n128-l4": (128, 4, 4)})
SCALING_MODELS = ({"n64-l2": (64, 2, 4), "n1024-l8": (1024, 8, 16)} if CUDA
                  else {"n64-l2": (64, 2, 4), "n128-l2": (128, 2, 4), "n128-l4": (128, 4, 4)})
SMALL_BATCH = 4      # per rank, step and scaling benchmarks
DEMO = dict(model=(64, 2, 4), batch=16, block=64, bucket_cap_mb=0.1)  # fused_zero/demo/run.py's defaults
BLOCK = 64
BUCKET_CAP_MB = 0.1
HOST_MODEL = (64, 10, 4)  # 124 parameters: with HOST_BUCKET_CAP_MB, 124 buckets (one per parameter)
HOST_BUCKET_CAP_MB = 0.0001
HOST_OVERLAPS = ["bucket", "backward", "step"]
SCALING_WORLDS = [1, 2, 4]
SCALING_SYSTEMS = [BASELINE, "fused_zero-bucket"]


@functools.cache
def device_name() -> str:
    """Asked for in the parent only: on CUDA it creates a context on GPU 0, which ranks must not."""
    if CUDA:
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {CPU_COUNT} cores)"


def _fit_world(requested: int) -> int | None:
    """The world a scenario asking for ``requested`` ranks gets: any on CPU (gloo ranks share the
    cores), one rank per GPU on CUDA; None when it does not fit."""
    if not CUDA:
        return requested
    return requested if requested <= N_GPUS else None


PAIR_WORLD = 2 if not CUDA else max(1, min(N_GPUS, 2))


# ------------------------------------------------------------------ scenarios

def _scenario(kind: str, world: int, label: str) -> dict:
    """Everything the ranks need to run one scenario (plain data: it is pickled to them)."""
    if kind == "step":
        return dict(kind=kind, label=label, world=world, model=STEP_MODELS[label], batch=SMALL_BATCH,
                    block=BLOCK, bucket_cap_mb=BUCKET_CAP_MB, systems=SYSTEMS, host=False)
    if kind == "e2e":
        return dict(kind=kind, label=label, world=world, model=DEMO["model"], batch=DEMO["batch"],
                    block=DEMO["block"], bucket_cap_mb=DEMO["bucket_cap_mb"], systems=SYSTEMS, host=False)
    if kind == "host":
        return dict(kind=kind, label=label, world=world, model=HOST_MODEL, batch=SMALL_BATCH,
                    block=BLOCK, bucket_cap_mb=HOST_BUCKET_CAP_MB,
                    systems=[f"fused_zero-{o}" for o in HOST_OVERLAPS], host=True)
    if kind == "scaling":
        return dict(kind=kind, label=label, world=world, model=SCALING_MODELS[label], batch=SMALL_BATCH,
                    block=BLOCK, bucket_cap_mb=BUCKET_CAP_MB, systems=SCALING_SYSTEMS, host=False)
    raise ValueError(kind)


# ------------------------------------------------------------------ inside the ranks

class _Marks:
    """Phase boundaries: perf_counter on CPU, CUDA events on the current stream on CUDA (resolved
    after the block's final synchronize)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) * 1e-3 if self.cuda else b - a


class _HostProbe:
    """Wraps ``Engine.on_bucket`` (class-wide) and one engine's ``algo.apply`` to add up host time."""

    def __init__(self):
        from fused_zero.pipeline import engine as fz_engine

        self.cls = fz_engine.Engine
        self.original = self.cls.on_bucket
        self.bucket_s = 0.0
        self.buckets = 0
        self.update_s = 0.0
        self.updates = 0
        probe = self

        def on_bucket(engine, bucket):
            t0 = time.perf_counter()
            try:
                return probe.original(engine, bucket)
            finally:
                probe.bucket_s += time.perf_counter() - t0
                probe.buckets += 1

        self.cls.on_bucket = on_bucket

    def watch_updates(self, opt) -> None:
        algo = opt._engine.members[0].algo
        update = algo.apply
        probe = self

        def timed_update(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return update(*args, **kwargs)
            finally:
                probe.update_s += time.perf_counter() - t0
                probe.updates += 1

        algo.apply = timed_update

    def snapshot(self) -> tuple[float, int, float, int]:
        return self.bucket_s, self.buckets, self.update_s, self.updates

    def close(self) -> None:
        self.cls.on_bucket = self.original


def _torch_adamw_kwargs(device: torch.device) -> tuple[dict, str]:
    """fused=True where torch supports it on this device, else foreach, else the default."""
    probe = [torch.zeros(1, device=device, requires_grad=True)]
    for kind in ({"fused": True}, {"foreach": True}, {}):
        try:
            torch.optim.AdamW(probe, lr=LR, **kind)
        except (RuntimeError, ValueError):
            continue
        return kind, next(iter(kind), "default")
    return {}, "default"


class _System:
    """One system: its model, DDP and optimizer, and the callables an iteration needs."""

    def __init__(self, name: str, sc: dict, vocab: int, device: torch.device, impl: dict, impl_name: str):
        from torch.nn.parallel import DistributedDataParallel as DDP

        import fused_zero
        from fused_zero.demo.model import GPT, GPTConfig, param_count

        self.name = name
        n_embd, n_layer, n_head = sc["model"]
        torch.manual_seed(0)
        with torch.device(device):
            self.model = GPT(GPTConfig(vocab_size=vocab, block_size=sc["block"], n_layer=n_layer,
                                       n_head=n_head, n_embd=n_embd))
        self.params = param_count(self.model)
        self.ddp = DDP(self.model, bucket_cap_mb=sc["bucket_cap_mb"], gradient_as_bucket_view=True,
                       device_ids=[device.index] if device.type == "cuda" else None)
        hp = dict(lr=LR, weight_decay=WEIGHT_DECAY)
        self.sync = lambda: None
        self.impl = impl_name
        if name == "ddp+torch-adamw":
            self.opt = torch.optim.AdamW(self.ddp.parameters(), **hp, **impl)
            self.step = self.opt.step
        elif name == "ddp+zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            overlap = dist.get_backend() == "nccl"
            self.opt = ZeroRedundancyOptimizer(self.ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                               overlap_with_ddp=overlap, **hp, **impl)
            if overlap:
                from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                self.ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, self.ddp, self.opt))
                self.step = lambda: None  # the hook steps; ZeRO warns when step() is called
                self.impl = f"{impl_name}, overlap_with_ddp hook"
            else:
                self.step = self.opt.step
                self.impl = f"{impl_name}, plain step (gloo refuses the overlap hook)"
        else:
            overlap = name.split("-", 1)[1]
            self.opt = fused_zero.AdamW(self.ddp.parameters(), ddp=self.ddp, overlap=overlap, **hp)
            self.step = self.opt.step
            self.sync = self.opt.synchronize
            self.impl = f"backend {self.opt._engine.backend}"

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        if self.name.startswith("fused_zero"):
            return int(self.opt.memory()["state"])
        if self.name == "ddp+zero":
            local = getattr(self.opt, "optim", None)
            if local is None:
                return 0
            return sum(t.numel() * t.element_size() for st in local.state.values() for t in st.values()
                       if torch.is_tensor(t))
        return 8 * self.params


def _run_block(system: _System, data, start: int, warmup: int, iters: int, marks: _Marks, device,
               probe: _HostProbe | None, out: dict) -> int:
    """``warmup`` untimed then ``iters`` timed iterations on batches data[start:]; returns the next
    batch index."""
    ddp = system.ddp
    for i in range(warmup):
        x, y = data[start + i]
        _, loss = ddp(x, y)
        loss.backward()
        system.step()
        system.zero_grad()
    start += warmup
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    rows = []
    for i in range(iters):
        x, y = data[start + i]
        before = probe.snapshot() if probe is not None else None
        m0 = marks.mark()
        _, loss = ddp(x, y)
        m1 = marks.mark()
        loss.backward()
        m2 = marks.mark()
        system.step()
        m3 = marks.mark()
        system.zero_grad()
        m4 = marks.mark()
        after = probe.snapshot() if probe is not None else None
        rows.append(((m0, m1, m2, m3, m4), before, after))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    system.sync()  # untimed: the next block must not hide this block's last all-gathers
    for (m0, m1, m2, m3, m4), before, after in rows:
        fwd, bwd = marks.seconds(m0, m1), marks.seconds(m1, m2)
        step, zero = marks.seconds(m2, m3), marks.seconds(m3, m4)
        out["fwd"].append(fwd)
        out["bwd"].append(bwd)
        out["step"].append(step)
        out["zero_grad"].append(zero)
        out["iter"].append(fwd + bwd + step + zero)
        if probe is not None:
            out["on_bucket"].append(after[0] - before[0])
            out["buckets"].append(after[1] - before[1])
            out["update"].append(after[2] - before[2])
            out["updates"].append(after[3] - before[3])
    return start + iters


def _run_scenario(rank: int, world: int, sc: dict, corpus, vocab: int, device: torch.device) -> dict:
    from fused_zero.demo.model import batches

    impl, impl_name = _torch_adamw_kwargs(device)
    per_round = [ITERS // ROUNDS + (r < ITERS % ROUNDS) for r in range(ROUNDS)]
    need = WARMUP + REWARM * (ROUNDS - 1) + ITERS
    stream = batches(corpus, batch_size=sc["batch"], block_size=sc["block"], rank=rank, world_size=world,
                     seed=0)
    data = [tuple(t.to(device) for t in next(stream)) for _ in range(need)]
    marks = _Marks(device.type == "cuda")
    probe = _HostProbe() if sc["host"] else None
    systems, errors, out = {}, {}, {}
    try:
        for name in sc["systems"]:
            try:
                systems[name] = _System(name, sc, vocab, device, impl, impl_name)
                if probe is not None:
                    probe.watch_updates(systems[name].opt)
            except Exception:  # reported by that system's tests; the other systems go on
                errors[name] = traceback.format_exc()
            out[name] = {k: [] for k in ("fwd", "bwd", "step", "zero_grad", "iter", "on_bucket", "buckets",
                                         "update", "updates")}
        names = [n for n in sc["systems"] if n in systems]
        pos = {n: 0 for n in names}
        for r, iters in enumerate(per_round):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                if name in errors:
                    continue
                try:
                    pos[name] = _run_block(systems[name], data, pos[name], WARMUP if r == 0 else REWARM,
                                           iters, marks, device, probe, out[name])
                except Exception:  # reported by that system's tests
                    errors[name] = traceback.format_exc()
                    dist.barrier()  # a failure every rank shares: resynchronise and go on
        for name, s in systems.items():
            out[name]["state_bytes"] = s.state_bytes()
            out[name]["params"] = s.params
            out[name]["impl"] = s.impl
    finally:
        if probe is not None:
            probe.close()
    return {"systems": out, "errors": errors}


def _rank_main(rank: int, world: int, scenarios: list[dict]) -> list[dict]:
    from fused_zero.demo.model import CharTokenizer, load_corpus

    device = torch.device("cuda", rank) if CUDA else torch.device("cpu")
    text = load_corpus()
    tok = CharTokenizer(text)
    corpus = tok.encode(text)
    return [_run_scenario(rank, world, sc, corpus, tok.vocab_size, device) for sc in scenarios]


def run_ranks(fn, world: int, *args):
    return spawn.run_ranks(fn, world, *args, timeout=SPAWN_TIMEOUT, backend=BACKEND,
                           collective_timeout=COLLECTIVE_TIMEOUT)


# ------------------------------------------------------------------ parent: cache, pytest-benchmark

_CACHE: dict[tuple, dict | str] = {}

# test function -> its scenario key (kind, world, label) from the test's parameters
_KEYS = {
    "test_step": lambda p: ("step", PAIR_WORLD, p["model"]),
    "test_e2e": lambda p: ("e2e", PAIR_WORLD, "demo"),
    "test_host_overhead": lambda p: ("host", p["world"], "gpt-l10-cap0.0001"),
    "test_scaling": lambda p: ("scaling", p["world"], p["model"]),
}


def _selected_keys(session) -> list[tuple]:
    keys = []
    for item in session.items:
        fn = getattr(item, "originalname", None)
        if getattr(item, "module", None) is not sys.modules[__name__] or fn not in _KEYS:
            continue
        params = item.callspec.params
        if "world" in params and _fit_world(params["world"]) is None:
            continue
        key = _KEYS[fn](params)
        if key not in keys:
            keys.append(key)
    return keys


def _results(request, key: tuple) -> dict:
    """The scenario's results; the first request for a world runs every selected scenario of that world
    in one spawn of ranks (spawning and importing torch costs seconds)."""
    if key not in _CACHE:
        world = key[1]
        todo = [k for k in _selected_keys(request.session) if k[1] == world and k not in _CACHE]
        if key not in todo:
            todo.append(key)
        try:
            outs = run_ranks(_rank_main, world, [_scenario(*k) for k in todo])
        except (spawn.RanksFailed, ValueError) as e:  # cached: the other tests of this world fail at once
            for k in todo:
                _CACHE[k] = f"{type(e).__name__}: {e}"
        else:
            for i, k in enumerate(todo):
                _CACHE[k] = {"ranks": [o[i] for o in outs], "scenario": _scenario(*k)}
    res = _CACHE[key]
    if isinstance(res, str):
        pytest.fail(f"the ranks failed:\n{res}", pytrace=False)
    return res


def _median(v) -> float:
    return statistics.median(v) if v else float("nan")


def _mean(v) -> float:
    return statistics.fmean(v) if v else float("nan")


class ReplayClock:
    """pytest-benchmark timer that only advances when told: ``replay(durations)`` returns a function
    whose every call moves the clock on by the next in-rank measured duration, so each pedantic round is
    one measured iteration and pytest-benchmark's statistics are the ranks' own times."""

    def __init__(self):
        self.__name__ = "in_rank_replay_clock"  # how pytest-benchmark names the timer in its output
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def replay(self, durations):
        queue = list(durations)

        def advance():
            self.now += queue.pop(0)

        return advance


CLOCK = ReplayClock()
pytestmark = pytest.mark.benchmark(timer=CLOCK)


def _system_info(res: dict, system: str) -> dict:
    """extra_info common to every benchmark of ``system`` in a scenario (rank 0's times)."""
    sc = res["scenario"]
    ranks = res["ranks"]
    failed = {r: out["errors"][system] for r, out in enumerate(ranks) if system in out["errors"]}
    if failed:  # every rank's traceback: a failure on one rank often shows up as a hang or a mismatch on others
        pytest.fail(f"{system} failed in the ranks:\n" + "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in
                                                                   failed.items()), pytrace=False)
    errors = set().union(*(out["errors"] for out in ranks))  # systems that failed on some rank
    r0 = ranks[0]["systems"][system]
    n_embd, n_layer, n_head = sc["model"]
    info = dict(
        bench=sc["kind"], system=system, world=sc["world"], backend=BACKEND, device=device_name(),
        torch=torch.__version__, model=f"GPT n_embd={n_embd} n_layer={n_layer} n_head={n_head}",
        model_label=sc["label"], params=r0["params"], batch_per_rank=sc["batch"], block=sc["block"],
        bucket_cap_mb=sc["bucket_cap_mb"], optimizer_impl=r0["impl"], warmup=WARMUP, iters=len(r0["iter"]),
        rounds=ROUNDS, threads_per_rank=1 if not CUDA else None, timer="in-rank, rank 0",
        oversubscribed=(not CUDA) and sc["world"] > CPU_COUNT,
        iter_ms=_mean(r0["iter"]) * 1e3, iter_ms_median=_median(r0["iter"]) * 1e3,
        fwd_ms=_mean(r0["fwd"]) * 1e3, bwd_ms=_mean(r0["bwd"]) * 1e3,
        fwd_bwd_ms=_mean([a + b for a, b in zip(r0["fwd"], r0["bwd"])]) * 1e3,
        step_ms=_mean(r0["step"]) * 1e3, step_ms_median=_median(r0["step"]) * 1e3,
        zero_grad_ms=_mean(r0["zero_grad"]) * 1e3,
        state_bytes=r0["state_bytes"],
        state_bytes_ranks=[r["systems"][system]["state_bytes"] for r in ranks],
        iter_ms_ranks=[_mean(r["systems"][system]["iter"]) * 1e3 for r in ranks],
    )
    if system.startswith("fused_zero") and info["step_ms"] is not None:
        info["step_note"] = ("opt.step() runs the updates" if system.endswith("-step") else
                             "updates ran inside backward (in bwd_ms); opt.step() only ends the iteration")
    if system == "ddp+zero" and BACKEND == "nccl":
        info["step_note"] = "the overlap hook steps inside backward; opt.step() is not called"
    plain = ranks[0]["systems"].get(BASELINE)
    if system.startswith("fused_zero") and plain and plain["iter"] and BASELINE not in errors:
        t_fb_plain = _median([a + b for a, b in zip(plain["fwd"], plain["bwd"])])
        t_step_plain = _median(plain["step"])
        t_iter = _median(r0["iter"])
        raw = 1.0 - (t_iter - t_fb_plain) / t_step_plain if t_step_plain > 0 else float("nan")
        info.update(hidden_share=min(max(raw, 0.0), 1.0), hidden_share_unclamped=raw,
                    iter_minus_plain_ms=(t_iter - _median(plain["iter"])) * 1e3,
                    plain_fwd_bwd_ms_median=t_fb_plain * 1e3, plain_step_ms_median=t_step_plain * 1e3)
    return info


def _report(benchmark, durations, group: str, info: dict) -> None:
    benchmark.group = group
    benchmark.extra_info.update(info)
    benchmark.pedantic(CLOCK.replay(durations), rounds=len(durations), iterations=1, warmup_rounds=0)


def _skip_unless_fits(world: int) -> int:
    fitted = _fit_world(world)
    if fitted is None:
        pytest.skip(f"world {world} needs {world} GPUs, this machine has {N_GPUS}")
    return fitted


@pytest.mark.parametrize("measure", ["iteration", "opt.step"])
@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("model", list(STEP_MODELS))
def test_step(benchmark, request, model, system, measure):
    res = _results(request, _KEYS["test_step"]({"model": model}))
    info = _system_info(res, system)
    info["measure"] = measure
    r0 = res["ranks"][0]["systems"][system]
    _report(benchmark, r0["iter"] if measure == "iteration" else r0["step"],
            f"step-{model}-{measure}", info)


@pytest.mark.parametrize("system", SYSTEMS)
def test_e2e(benchmark, request, system):
    res = _results(request, _KEYS["test_e2e"]({}))
    info = _system_info(res, system)
    _report(benchmark, res["ranks"][0]["systems"][system]["iter"], "e2e", info)


@pytest.mark.parametrize("overlap", HOST_OVERLAPS)
@pytest.mark.parametrize("world", [1, 2])
def test_host_overhead(benchmark, request, world, overlap):
    _skip_unless_fits(world)
    res = _results(request, _KEYS["test_host_overhead"]({"world": world}))
    system = f"fused_zero-{overlap}"
    info = _system_info(res, system)
    r0 = res["ranks"][0]["systems"][system]
    per_bucket = [t / n for t, n in zip(r0["on_bucket"], r0["buckets"]) if n]
    info.update(
        overlap=overlap,
        us_per_bucket=_mean(per_bucket) * 1e6, us_per_bucket_median=_median(per_bucket) * 1e6,
        buckets_per_step=_mean(r0["buckets"]),
        # the median is the steady state: the first measured step may still launch per bucket (arena.py)
        launches_per_step=_median(r0["updates"]), launches_per_step_mean=_mean(r0["updates"]),
        update_us_per_launch=(sum(r0["update"]) / sum(r0["updates"]) * 1e6) if sum(r0["updates"]) else 0.0,
        on_bucket_ms_per_step=_mean(r0["on_bucket"]) * 1e3,
        on_bucket_note=("bucket mode on CPU: on_bucket waits for the previous bucket's reduction and runs "
                        "its update (torch ops), so this is update + wait + orchestration"
                        if overlap == "bucket" and not CUDA else
                        "step mode: on_bucket only starts the reduction; the updates run in step()"
                        if overlap == "step" else
                        "backward mode on CPU: the last bucket's on_bucket runs every update"
                        if overlap == "backward" and not CUDA else
                        "host time to enqueue the reduction, the update kernel and the all-gather"),
    )
    _report(benchmark, per_bucket, f"host-w{world}", info)


@pytest.mark.parametrize("system", SCALING_SYSTEMS)
@pytest.mark.parametrize("world", SCALING_WORLDS)
@pytest.mark.parametrize("model", list(SCALING_MODELS))
def test_scaling(benchmark, request, model, world, system):
    _skip_unless_fits(world)
    res = _results(request, _KEYS["test_scaling"]({"model": model, "world": world}))
    info = _system_info(res, system)
    if info["oversubscribed"]:
        info["note"] = f"{world} ranks on {CPU_COUNT} cores: oversubscribed, times include contention"
    _report(benchmark, res["ranks"][0]["systems"][system]["iter"], f"scaling-{model}", info)
