"""The measurement program for a GPU machine: every figure fused_zero exists for, in one process, within
six minutes, one JSON line per measurement written (flushed, fsync'd) as it is taken.

    python3 bench/gpu_run.py --out OUT                  # on a GPU machine: the first thing to run there
    python3 bench/gpu_run.py --summarize OUT/run.jsonl  # the summary of what a run (even a killed one) measured
    python3 bench/gpu_run.py --plan                     # the sections and their seconds
    TRITON_INTERPRET=1 python3 bench/gpu_run.py --out OUT --dry-run   # CPU: tiny sizes, gloo, the interpreter

Sections, in this order, each with a time limit (``PLAN``, seconds; they add up to ``BUDGET``, and a
watchdog stops the process ``GRACE`` seconds after it, at 355 s). A section's limit is its plan plus
what the sections before it left unused, never past the budget; the limit is checked between
measurements, and what no longer fits is skipped with a ``skip`` line, never overrun:

    env        the first line: GPU, SM and memory clocks (nvidia-smi), torch, Triton, CUDA, NCCL, the
               Triton cache (a fixed folder outside OUT, kept: a rerun on the same machine is warm)
    compile    each kernel variant's first launch, compile included (seconds per variant)
    kernels    a device copy moving the same bytes, then every fused variant (AdamW and SGD with
               momentum, fp32 and bf16 + fp32 masters, 8-bit moments) at 1M-256M elements: GB/s and share
               of the copy; the step level (the update plus the grad_sumsq pre-pass that the skip and
               the clip need, as step() runs them: actual and useful bytes); torch's fused and foreach
               AdamW (fp32; bf16 with the casts a user needs) at the same sizes. CUDA events around each
               round after an L2 flush (test_bench_kernels.CudaEventClock), median of ROUNDS
    e2e        world 1 in this process (NCCL; gloo on the dry run): a GPT-2-small-like model (12 x 768,
               vocabulary 50304, sequence 1024, bf16 autocast over fp32 parameters) and the demo's
               optimizer-bound GPT, each under DDP with torch's fused AdamW, ZeroRedundancyOptimizer
               with its overlap-with-DDP hook, fused_zero.AdamW in overlap bucket, backward and step:
               median iteration, forward + backward alone (no optimizer), the optimizer's exposed time
    profile    torch.profiler over three bucket-mode iterations of the GPT-2-small-like model, read
               into numbers: the streams of the update kernels, the share of their time overlapping the
               backward's compute kernels, host synchronizations per iteration; fused_zero AdamW, Muon
               beside AdamW, NAdam, RMSprop; AdamW's trace kept, gzip'd, where it fits
    ncu        where Nsight Compute exists: one kernel's achieved DRAM throughput
    multi_gpu  with 2+ GPUs, one rank per GPU: the all-gather overlapping the next forward, the
               reduce-scatter overlapping the backward, the iteration against DDP; else a line saying why not
    summary    summary.md from run.jsonl alone (what ``--summarize`` prints), printed

Files under OUT (a borrowed machine returns at most 8): ``run.jsonl``, ``summary.md``,
``trace-adamw-bucket.json.gz`` (when under 15 MiB), ``run.log`` (what was printed; ``--no-log`` leaves it
out). Every line of run.jsonl has ``kind`` (env, compile, kernel, step_level, torch_kernel, e2e, trace,
ncu, multi_gpu, skip, error, section, abort, end), ``section`` and ``t`` (seconds since the start).

The dry run (``--dry-run``, tests/test_gpu_run.py) runs every section on the CPU with tiny sizes: the
kernels through Triton's interpreter, the process group on gloo, two gloo ranks standing in for two
GPUs. Its numbers mean nothing; it proves that every section runs and writes its lines.
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # the budget counts from here, the imports of torch and Triton included

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Fixed, outside OUT, never deleted: main() sets it before Triton is imported (it reads the variable then).
TRITON_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "fused_zero-gpu-run", "triton")

PLAN = {"env": 15, "compile": 35, "kernels": 70, "e2e": 100, "profile": 60, "ncu": 20, "multi_gpu": 40,
        "summary": 5}
BUDGET = sum(PLAN.values())  # 345 s
GRACE = 10  # the watchdog's margin past the budget: the process ends by 355 s, under 6 minutes
assert BUDGET + GRACE <= 360, "the plan must fit six minutes"

SIZES = [1 << 20, 16 << 20, 64 << 20, 256 << 20]
DRY_SIZES = [4 << 10, 8 << 10]
ROUNDS, WARMUP_ROUNDS = 10, 2  # fixed, not calibrated: time is scarce
DRY_ROUNDS = 3
COMPILE_N = 1 << 13
TRACE_LIMIT = 15 << 20  # a kept trace's compressed bytes (the machine returns files of at most 16 MiB)
LR, WEIGHT_DECAY = 3e-4, 0.1

MODELS = {  # name: n_layer, n_head, n_embd, vocab, block, batch, bucket_cap_mb, bf16 autocast
    "gpt2-small": dict(n_layer=12, n_head=12, n_embd=768, vocab=50304, block=1024, batch=16, bucket_cap_mb=25.0,
                       amp=True, warmup=3, iters=10),
    "demo": dict(n_layer=2, n_head=4, n_embd=64, vocab=75, block=64, batch=16, bucket_cap_mb=0.1, amp=False,
                 warmup=5, iters=20),
}
DRY_MODELS = {
    "gpt2-small": dict(n_layer=2, n_head=2, n_embd=32, vocab=256, block=32, batch=2, bucket_cap_mb=0.01, amp=True,
                       warmup=2, iters=3),
    "demo": dict(n_layer=2, n_head=4, n_embd=64, vocab=75, block=64, batch=4, bucket_cap_mb=0.1, amp=False,
                 warmup=2, iters=3),
}
E2E_SYSTEMS = ["fwd+bwd", "ddp+torch-adamw", "ddp+zero", "fused_zero-bucket", "fused_zero-backward",
               "fused_zero-step"]
PROFILED = ["adamw", "muon+adamw", "nadam", "rmsprop"]
PROFILE_WARMUP, PROFILE_ITERS = 2, 3

# the kernel level: name -> (optimizer, parameter config, state format)
FUSED = {
    "adamw-fp32": ("adamw", "fp32", "fp32"),
    "adamw-bf16master": ("adamw", "bf16master", "fp32"),
    "sgd-fp32": ("sgd", "fp32", "fp32"),
    "sgd-bf16master": ("sgd", "bf16master", "fp32"),
    "adamw-8bit-fp32": ("adamw", "fp32", "8bit"),
    "adamw-8bit-bf16master": ("adamw", "bf16master", "8bit"),
    "sgd-8bit-fp32": ("sgd", "fp32", "8bit"),
}
STEP_LEVEL = ["adamw-fp32", "adamw-bf16master", "sgd-fp32", "sgd-bf16master", "adamw-8bit-fp32"]
TORCH = {  # torch provider (test_bench_kernels.PROVIDERS) -> the fused_zero variant it is compared with
    "torch-fused-adamw-fp32": "adamw-fp32",
    "torch-foreach-adamw-fp32": "adamw-fp32",
    "torch-fused-adamw-bf16master": "adamw-bf16master",
    "torch-foreach-adamw-bf16master": "adamw-bf16master",
}
UPDATE_KERNELS = ("_adam_kernel", "_sgd_kernel", "_grad_sumsq_kernel")  # fused_zero's Triton kernels
UPDATE_RANGES = ("fused_zero.update", "fused_zero.muon", "fused_zero.whole_params")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def bytes_per_element(optimizer: str, config: str, fmt: str) -> int:
    """The bytes one ideal pass of the update moves per element: the gradient read (4, or 2 for bf16),
    the weight read and written (fp32 8; bf16 + master: the master read and written and the bf16
    parameter written, 10) and each state read and written (fp32 8, 8-bit 2; the 8-bit blocks' scales,
    4 bytes per 2048 elements, left out)."""
    grad = 2 if config == "bf16master" else 4
    weight = 10 if config == "bf16master" else 8
    states = 2 if optimizer in ("adamw", "adam") else 1
    return grad + weight + states * (2 if fmt == "8bit" else 8)


def size_label(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


# ---------------------------------------------------------------------------------------- the record


def _clean(value):
    """JSON has no NaN or infinity: such a float is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class Recorder:
    """run.jsonl: one line per measurement, flushed and fsync'd before the next is taken, so that a kill
    loses only the measurement under way; and run.log, a copy of what is printed."""

    def __init__(self, out: str, log: bool):
        self.path = os.path.join(out, "run.jsonl")
        self.file = open(self.path, "a")
        self.log = open(os.path.join(out, "run.log"), "a") if log else None
        self.lock = threading.RLock()
        self.section = "env"

    def emit(self, kind: str, **fields) -> dict:
        rec = _clean({"kind": kind, "section": self.section, "t": round(time.monotonic() - T0, 2), **fields})
        with self.lock:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
            os.fsync(self.file.fileno())
        self.say(_brief(rec))
        return rec

    def say(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)
            if self.log is not None:
                self.log.write(text + "\n")
                self.log.flush()


def _brief(rec: dict) -> str:
    skip = ("kind", "section", "t", "traceback", "plan", "streams", "update_by_name", "iter_ms_all", "ranks")
    body = " ".join(f"{k}={v}" for k, v in rec.items() if k not in skip and not isinstance(v, (dict, list)))
    return f"[{rec['t']:7.1f}s {rec['section']}] {rec['kind']}: {body}"[:400]


class Section:
    def __init__(self, run: Run, name: str, limit: float):
        self.run, self.name, self.limit, self.start = run, name, limit, time.monotonic()
        self.skipped = self.errors = 0

    def used(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return min(self.limit - self.used(), self.run.left())

    def fits(self, seconds: float, what: str) -> bool:
        """Whether ``what`` (about ``seconds``) fits what is left of the section; if not, a skip line."""
        left = self.left()
        if seconds <= left:
            return True
        self.skip(what, f"section limit: {left:.1f} s left of {self.limit:.0f} s, needs about {seconds:.1f} s")
        return False

    def skip(self, what: str, reason: str) -> None:
        self.skipped += 1
        self.run.rec.emit("skip", what=what, reason=reason)

    @contextlib.contextmanager
    def measuring(self, what: str):
        """A measurement that fails writes an error line; the section goes on with the next one."""
        try:
            yield
        except Exception as e:  # every failure is a line, not the end of the run
            self.errors += 1
            self.run.rec.emit("error", what=what, error=f"{type(e).__name__}: {str(e)[:500]}",
                              traceback=traceback.format_exc()[-2000:])


class Run:
    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.out = args.out
        self.rec = Recorder(args.out, log=not args.no_log)
        self.budget = args.budget
        self.slack = 0.0
        self.sections: list[dict] = []
        self.only = set(args.only.split(",")) if args.only else None
        self.sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else (DRY_SIZES if self.dry else SIZES)
        self.rounds = DRY_ROUNDS if self.dry else ROUNDS
        self.models = DRY_MODELS if self.dry else MODELS
        self.device = None
        self.cuda = False
        self.backend = None
        self.group_file = None

    def left(self) -> float:
        return self.budget - (time.monotonic() - T0)

    @contextlib.contextmanager
    def section(self, name: str):
        self.rec.section = name
        limit = min(PLAN[name] + self.slack, max(self.left(), 0.0))
        sec = Section(self, name, limit)
        status = "done"
        try:
            if name == "summary":  # always: the summary's line; summary.md is written after the end line
                yield sec
            elif self.only is not None and name not in self.only and name != "env":
                sec.skip(name, "not selected (--only)")
                status = "not selected"
                yield None
            elif limit < 1.0:
                sec.skip(name, f"budget: {self.left():.1f} s of {self.budget:.0f} s left")
                status = "skipped"
                yield None
            else:
                yield sec
        except Exception as e:  # a section that fails is a line too
            status = "failed"
            sec.errors += 1
            self.rec.emit("error", what=f"section {name}", error=f"{type(e).__name__}: {str(e)[:500]}",
                          traceback=traceback.format_exc()[-2000:])
        used = sec.used()
        self.slack = max(limit - used, 0.0)
        self.rec.emit("section", name=name, plan=PLAN[name], limit=round(limit, 1), used=round(used, 1),
                      status=status, skipped=sec.skipped, errors=sec.errors)


# ---------------------------------------------------------------------------------------- env


def _nvidia_smi() -> dict:
    if shutil.which("nvidia-smi") is None:
        return {"nvidia_smi": "absent"}
    fields = ["name", "driver_version", "pstate", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
              "power.limit", "temperature.gpu", "memory.total"]
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return {"nvidia_smi": f"failed: {e}"}
    gpus = [dict(zip(fields, (v.strip() for v in line.split(",")))) for line in out.strip().splitlines()]
    return {"nvidia_smi": gpus}


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def section_env(run: Run, sec: Section) -> None:
    cache = os.environ["TRITON_CACHE_DIR"]
    entries = len(os.listdir(cache)) if os.path.isdir(cache) else 0
    if run.dry:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU's, whatever the machine has
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before fused_zero.kernels is imported
    import torch

    cuda = torch.cuda.is_available() and not run.dry
    if not cuda and not run.dry:
        run.rec.emit("error", what="env", error="CUDA is not available; --dry-run runs the program on the CPU")
        raise SystemExit("gpu_run: CUDA is not available; --dry-run runs the program on the CPU")
    interpret = os.environ.pop("TRITON_INTERPRET", None) if cuda else None  # the GPU runs the compiled kernels
    import triton

    info = dict(dry_run=run.dry, device="cuda" if cuda else "cpu", torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda, python=sys.version.split()[0],
                triton_cache=cache, triton_cache_entries_at_start=entries,
                triton_interpret=os.environ.get("TRITON_INTERPRET") == "1", plan=PLAN, budget=run.budget,
                triton_interpret_unset=interpret,
                commit=_git_commit(), argv=sys.argv[1:], started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                cpu_count=os.cpu_count())
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                    capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2 ** 30, 1))
        with contextlib.suppress(Exception):
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        with contextlib.suppress(Exception):  # needs pynvml
            info["sm_clock_mhz_torch"] = torch.cuda.clock_rate(0)
        info.update(_nvidia_smi())
    else:
        info.update(gpu=None, gpus=0, nccl=None)
    if run.dry:
        torch.set_num_threads(1)  # tiny tensors: threads only contend (the spawned ranks do the same)
    run.rec.emit("env", **info)
    run.cuda = cuda
    run.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    run.backend = "nccl" if cuda else "gloo"


# ---------------------------------------------------------------------------------------- kernels


def _kernels_module():
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import test_bench_kernels as tbk  # its case builders and its CUDA-event clock, shared with pytest-benchmark

    return tbk


def _fused_step(name: str, n: int, *, step_level: bool = False):
    """One fused_zero update of ``n`` elements in tbk.N_PARAMS parameters (test_bench_kernels' cases;
    8-bit moments with one scale per row of the table), or with ``step_level`` the pre-pass and the
    update as step() runs them: grad_sumsq over the update's table, the skip flag from its non-finite
    count, the update reading the flag."""
    import torch

    from fused_zero.kernels import Segments, adam_coefficients, adam_step, grad_sumsq, sgd_coefficients, sgd_step

    tbk = _kernels_module()
    optimizer, config, fmt = FUSED[name]
    if fmt == "fp32" and not step_level:
        return tbk.make_step("fused_zero", optimizer, config, n)
    dev = tbk.DEVICE
    segments = Segments.build([(a, b - a, a, a, pid) for pid, (a, b) in enumerate(tbk.param_spans(n))], dev)
    names = ("exp_avg", "exp_avg_sq") if optimizer == "adamw" else ("momentum_buffer",)
    bufs = tbk.make_buffers(n, config, () if fmt == "8bit" else names)
    scales = None
    if fmt == "8bit":
        for s in names:
            bufs[s] = torch.zeros(n, dtype=torch.uint8, device=dev)
        scales = {s: torch.zeros(segments.n_rows, device=dev) for s in names}
    if optimizer == "sgd":
        coefs = sgd_coefficients(lr=[tbk.LR] * tbk.N_PARAMS, momentum=tbk.MOMENTUM, dampening=0.0, weight_decay=0.0,
                                 first=False).to(dev)
        update = lambda **kw: sgd_step(segments, coefs, scales=scales, **bufs, **kw)  # noqa: E731
    else:
        coefs = adam_coefficients(lr=[tbk.LR] * tbk.N_PARAMS, beta1=tbk.BETAS[0], beta2=tbk.BETAS[1], eps=tbk.EPS,
                                  step=tbk.STEP, weight_decay=tbk.WEIGHT_DECAY, decoupled=True).to(dev)
        update = lambda **kw: adam_step(segments, coefs, scales=scales, **bufs, **kw)  # noqa: E731
    if not step_level:
        return update
    norm = torch.zeros(2, device=dev)
    partials = torch.zeros(max(segments.n_rows, 1), 2, device=dev)
    found = torch.zeros(1, device=dev)

    def step():
        grad_sumsq(segments, coefs, grad=bufs["grad"], out=norm, partials=partials)
        torch.clamp(norm[1:], max=1.0, out=found)  # the skip flag: any non-finite gradient
        update(found_inf=found)

    return step


def _copy_step(n: int, nbytes: int):
    """A device copy moving ``nbytes`` per element (half read, half written): test_bench_kernels' copy
    for 28 and 20 bytes, the same copy for the 8-bit variants' 16 and 14."""
    import torch

    tbk = _kernels_module()
    if nbytes in (28, 20):
        return tbk.make_step("copy", "adamw" if nbytes == 28 else "sgd", "bytes", n)
    src = torch.empty(n * nbytes // 2, dtype=torch.uint8, device=tbk.DEVICE)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _timer(run: Run):
    """Seconds of one call of a step: CUDA events after an L2 flush (CudaEventClock), or perf_counter."""
    tbk = _kernels_module()
    if run.cuda:
        clock = tbk.CudaEventClock()

        def timed(step):
            tick = clock.timed(step)

            def once():
                before = clock.now
                tick()
                return clock.now - before

            return once

        return timed
    return lambda step: (lambda: _wall(step))


def _wall(step) -> float:
    t = time.perf_counter()
    step()
    return time.perf_counter() - t


def _sync(run: Run) -> None:
    if run.cuda:
        import torch

        torch.cuda.synchronize()


def _free(run: Run) -> None:
    gc.collect()
    if run.cuda:
        import torch

        torch.cuda.empty_cache()


def section_compile(run: Run, sec: Section) -> None:
    """Each variant's first launch on COMPILE_N elements, compile (or the cache's load) included."""
    variants = [(name, lambda name=name: _fused_step(name, COMPILE_N)) for name in FUSED]
    variants += [(f"step-{name}", lambda name=name: _fused_step(name, COMPILE_N, step_level=True))
                 for name in STEP_LEVEL]
    for name, build in variants:
        if not sec.fits(2.0 if run.cuda else 0.5, f"compile {name}"):
            continue
        with sec.measuring(f"compile {name}"):
            step = build()
            _sync(run)
            t = time.perf_counter()
            step()
            _sync(run)
            run.rec.emit("compile", variant=name, seconds=round(time.perf_counter() - t, 4),
                         interpreted=os.environ.get("TRITON_INTERPRET") == "1")
        _free(run)


def _measure(run: Run, step) -> tuple[float, list[float]]:
    timed = _timer(run)(step)
    for _ in range(WARMUP_ROUNDS if run.cuda else 0):
        timed()
    times = [timed() for _ in range(run.rounds)]
    return statistics.median(times), times


def section_kernels(run: Run, sec: Section) -> None:
    copies = sorted({bytes_per_element(*v) for v in FUSED.values()}, reverse=True)
    last: dict[str, tuple[int, float]] = {}  # case -> (size, median seconds) at the size before
    calls = run.rounds + 1 + (WARMUP_ROUNDS if run.cuda else 0)
    for n in run.sizes:
        copy_ms: dict[int, float] = {}
        fused_ms: dict[str, float] = {}
        cases = [("copy", f"copy-{b}B", b) for b in copies] + [("fused", name, None) for name in FUSED] \
            + [("step", name, None) for name in STEP_LEVEL] + [("torch", name, None) for name in TORCH]
        for kind, name, nbytes in cases:
            key = f"{kind}:{name}"
            prev = last.get(key)
            # buffers made, then every call: its time scaled from the size before, plus a flush each
            est = (0.3 if run.cuda else 0.05) + (calls * (prev[1] * n / prev[0] + 2e-4) if prev else 0.5)
            what = f"{name} {size_label(n)}"
            if not sec.fits(est, what):
                continue
            with sec.measuring(what):
                if kind == "copy":
                    step = _copy_step(n, nbytes)
                elif kind == "fused":
                    step = _fused_step(name, n)
                elif kind == "step":
                    step = _fused_step(name, n, step_level=True)
                else:
                    tbk = _kernels_module()
                    step = tbk.make_step(*tbk.PROVIDERS[name], n)
                step()  # creates torch's state; the kernels are compiled already
                _sync(run)
                median, times = _measure(run, step)
                last[key] = (n, median)
                ms = median * 1e3
                common = dict(size=n, size_label=size_label(n), ms=ms, rounds=len(times),
                              spread_ms=[min(times) * 1e3, max(times) * 1e3])
                if kind == "copy":
                    copy_ms[nbytes] = ms
                    run.rec.emit("kernel", provider=name, bytes_per_element=nbytes, gbs=nbytes * n / median / 1e9,
                                 **common)
                elif kind == "fused":
                    useful = bytes_per_element(*FUSED[name])
                    fused_ms[name] = ms
                    copy = copy_ms.get(useful)
                    run.rec.emit("kernel", provider=name, bytes_per_element=useful, gbs=useful * n / median / 1e9,
                                 copy=f"copy-{useful}B", vs_copy=copy / ms if copy else None, **common)
                elif kind == "step":
                    useful = bytes_per_element(*FUSED[name])
                    actual = useful + (2 if FUSED[name][1] == "bf16master" else 4)  # the pre-pass reads the gradient
                    copy = copy_ms.get(useful)
                    run.rec.emit("step_level", provider=f"step-{name}", update=name, useful_bytes_per_element=useful,
                                 actual_bytes_per_element=actual, gbs_actual=actual * n / median / 1e9,
                                 gbs_useful=useful * n / median / 1e9, copy=f"copy-{useful}B",
                                 vs_copy=copy / ms if copy else None,
                                 vs_update=fused_ms[name] / ms if name in fused_ms else None, **common)
                else:
                    ours = fused_ms.get(TORCH[name])
                    useful = bytes_per_element(*FUSED[TORCH[name]])
                    run.rec.emit("torch_kernel", provider=name, versus=TORCH[name], useful_bytes_per_element=useful,
                                 gbs_useful=useful * n / median / 1e9,
                                 torch_over_fused_zero=ms / ours if ours else None, **common)
                del step
            if run.cuda:
                import torch

                torch.cuda.empty_cache()
        _free(run)


# ---------------------------------------------------------------------------------------- systems


def _init_group(run: Run) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    fd, run.group_file = tempfile.mkstemp(prefix="gpu_run_pg_")
    os.close(fd)
    os.unlink(run.group_file)  # the FileStore creates it
    dist.init_process_group(run.backend, init_method=f"file://{run.group_file}", rank=0, world_size=1)


def _torch_adamw_kwargs(device) -> dict:
    import torch

    probe = [torch.zeros(1, device=device, requires_grad=True)]
    for kind in ({"fused": True}, {"foreach": True}, {}):
        try:
            torch.optim.AdamW(probe, lr=LR, **kind)
            return kind
        except (RuntimeError, ValueError):
            continue
    return {}


class System:
    """A model under DDP and what steps it: ``name`` one of E2E_SYSTEMS, or ``fused_zero-<optimizer>`` of
    the profile (PROFILED, bucket mode); ``param_sync`` for fused_zero's."""

    def __init__(self, name: str, cfg: dict, device, param_sync: str = "step"):
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        import fused_zero
        from fused_zero.demo.model import GPT, GPTConfig

        self.name, self.cfg, self.device = name, cfg, device
        torch.manual_seed(0)
        with torch.device(device):
            self.model = GPT(GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["block"], n_layer=cfg["n_layer"],
                                       n_head=cfg["n_head"], n_embd=cfg["n_embd"]))
        self.params = sum(p.numel() for p in self.model.parameters())
        self.ddp = DDP(self.model, bucket_cap_mb=cfg["bucket_cap_mb"], gradient_as_bucket_view=True,
                       device_ids=[device.index] if device.type == "cuda" else None)
        self.opts, self.stepped, self.note = [], [], ""
        hp = dict(lr=LR, weight_decay=WEIGHT_DECAY)
        if name == "fwd+bwd":
            self.note = "DDP, no optimizer"
        elif name == "ddp+torch-adamw":
            kind = _torch_adamw_kwargs(device)
            self.opts = self.stepped = [torch.optim.AdamW(self.ddp.parameters(), **hp, **kind)]
            self.note = f"torch.optim.AdamW({next(iter(kind), 'default')})"
        elif name == "ddp+zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            kind = _torch_adamw_kwargs(device)
            overlap = dist.get_backend() == "nccl"
            zero = ZeroRedundancyOptimizer(self.ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                           overlap_with_ddp=overlap, **hp, **kind)
            self.opts = [zero]
            if overlap:
                from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                self.ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, self.ddp, zero))
                self.note = "overlap_with_ddp hook (hook_with_zero_step); it steps in the backward"
            else:
                self.stepped = [zero]
                self.note = "plain ZeroRedundancyOptimizer.step(): gloo refuses the overlap hook"
        elif name.startswith("fused_zero-"):
            what = name.split("-", 1)[1]
            if what in ("bucket", "backward", "step"):
                self.opts = [fused_zero.AdamW(self.ddp.parameters(), ddp=self.ddp, overlap=what,
                                              param_sync=param_sync, **hp)]
            elif what == "adamw":
                self.opts = [fused_zero.AdamW(self.ddp.parameters(), ddp=self.ddp, overlap="bucket",
                                              param_sync=param_sync, **hp)]
            elif what == "muon+adamw":
                named = list(self.model.named_parameters())
                matrices = [p for n, p in named if p.ndim == 2 and n.startswith("blocks.")]
                ids = {id(p) for p in matrices}
                rest = [p for _, p in named if id(p) not in ids]
                self.opts = [fused_zero.Muon(matrices, ddp=self.ddp, lr=0.02, overlap="bucket"),
                             fused_zero.AdamW(rest, ddp=self.ddp, overlap="bucket", **hp)]
            elif what == "nadam":
                self.opts = [fused_zero.NAdam(self.ddp.parameters(), ddp=self.ddp, overlap="bucket", **hp)]
            elif what == "rmsprop":
                self.opts = [fused_zero.RMSprop(self.ddp.parameters(), ddp=self.ddp, overlap="bucket", lr=1e-3,
                                                momentum=0.9)]
            else:
                raise ValueError(name)
            self.stepped = self.opts
            self.note = f"backend {getattr(getattr(self.opts[0], '_engine', None), 'backend', '?')}"
        else:
            raise ValueError(name)

    def forward_backward(self, x, y) -> None:
        import torch

        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg["amp"]):
            _, loss = self.ddp(x, y)
        loss.backward()

    def step(self) -> None:
        for o in self.stepped:
            o.step()

    def zero_grad(self) -> None:
        if not self.opts:
            self.model.zero_grad(set_to_none=True)
        for o in self.opts:
            o.zero_grad(set_to_none=True)

    def synchronize(self) -> None:
        for o in self.opts:
            if hasattr(o, "synchronize") and hasattr(o, "_engine"):
                o.synchronize()

    def close(self) -> None:
        for o in self.opts:
            engine = getattr(o, "_engine", None)
            if engine is not None and hasattr(engine, "close"):
                engine.close()


def _batches(cfg: dict, count: int, device, seed: int = 0) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        t = torch.randint(cfg["vocab"], (cfg["batch"], cfg["block"] + 1), generator=g)
        out.append((t[:, :-1].to(device), t[:, 1:].to(device)))
    return out


class Marks:
    """Iteration boundaries: CUDA events on the current stream (read after the block's synchronize), or
    perf_counter on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        import torch

        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) * 1e-3 if self.cuda else b - a


def _iterate(system: System, data: list, warmup: int, iters: int, cuda: bool) -> list[tuple[float, float]]:
    """``warmup`` untimed, then ``iters`` timed iterations: (forward + backward, whole iteration) each,
    nothing synchronizing the host inside the timed block."""
    import torch

    marks = Marks(cuda)
    for i in range(warmup):
        system.forward_backward(*data[i % len(data)])
        system.step()
        system.zero_grad()
    if cuda:
        torch.cuda.synchronize()
    rows = []
    for i in range(iters):
        x, y = data[(warmup + i) % len(data)]
        a = marks.mark()
        system.forward_backward(x, y)
        b = marks.mark()
        system.step()
        system.zero_grad()
        c = marks.mark()
        rows.append((a, b, c))
    if cuda:
        torch.cuda.synchronize()
    system.synchronize()  # untimed: the next block must not hide this one's last all-gathers
    return [(marks.seconds(a, b), marks.seconds(a, c)) for a, b, c in rows]


def section_e2e(run: Run, sec: Section) -> None:
    _init_group(run)
    for model, cfg in run.models.items():
        data = _batches(cfg, cfg["warmup"] + cfg["iters"], run.device)
        per_iter = None  # seconds, from the first system measured
        alone_ms = base_ms = None
        for name in E2E_SYSTEMS:
            est = (4.0 if run.cuda and model == "gpt2-small" else 1.0) + \
                (cfg["warmup"] + cfg["iters"]) * (per_iter * 1.5 if per_iter else (0.3 if run.cuda else 0.1))
            what = f"{model} {name}"
            if not sec.fits(est, what):
                continue
            system = None
            with sec.measuring(what):
                system = System(name, cfg, run.device)
                rows = _iterate(system, data, cfg["warmup"], cfg["iters"], run.cuda)
                fb = statistics.median(r[0] for r in rows) * 1e3
                it = statistics.median(r[1] for r in rows) * 1e3
                per_iter = per_iter or it / 1e3
                if name == "fwd+bwd":
                    alone_ms = it
                if name == "ddp+torch-adamw":
                    base_ms = it
                run.rec.emit("e2e", model=model, system=name, params=system.params, world=1, backend=run.backend,
                             batch=cfg["batch"], block=cfg["block"], bf16_autocast=cfg["amp"], warmup=cfg["warmup"],
                             iters=len(rows), iter_ms=it, fwd_bwd_ms=fb, step_ms=it - fb,
                             exposed_ms=it - alone_ms if alone_ms is not None and name != "fwd+bwd" else None,
                             vs_ddp=it / base_ms if base_ms else None, note=system.note,
                             iter_ms_all=[r[1] * 1e3 for r in rows])
            if system is not None:
                system.close()
            del system
            _free(run)


# ---------------------------------------------------------------------------------------- traces


def _union(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs, ys) -> float:
    """Total length of the intersection of two unions of intervals (each sorted and disjoint)."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            total += b - a
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_share(these, those) -> float | None:
    """The share of the time covered by ``these`` intervals that ``those`` also cover (None: no time)."""
    a, b = _union(these), _union(those)
    length = _length(a)
    return _intersection(a, b) / length if length > 0 else None


def _inside(t: float, ranges) -> bool:
    return any(a <= t <= b for a, b in ranges)


def analyze_trace(trace: dict, iterations: int) -> dict:
    """Numbers from a torch.profiler chrome trace of ``iterations`` iterations, each inside a
    ``gpu_run.iteration`` range with ``gpu_run.forward``/``.backward``/``.step`` inside it.

    Update kernels: fused_zero's Triton kernels by name, and every kernel launched (by its launch's
    correlation id) inside a ``fused_zero.update``/``.muon``/``.whole_params`` range on the launching
    thread. Backward compute kernels: the other kernels, not NCCL's, launched while the main thread is
    in ``gpu_run.backward``. Host synchronizations: cudaStream/Event/DeviceSynchronize calls and
    device-to-host copies inside the iterations. A trace without GPU kernels (the CPU) has its CPU ops
    read the same way, which checks this code, not the overlap."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]

    def spans(name):  # a range on the host (its projection on the GPU timeline is another category)
        return [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                if e.get("name") == name and e.get("cat") == "user_annotation"]

    iters = spans("gpu_run.iteration")
    if not iters:
        return {"error": "no gpu_run.iteration range in the trace"}
    window = (min(a for a, _ in iters), max(b for _, b in iters))
    phases = {p: spans(f"gpu_run.{p}") for p in ("forward", "backward", "step")}
    ranges: dict[tuple, list] = {}
    counts: dict[str, int] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "user_annotation" and name.startswith("fused_zero."):
            counts[name] = counts.get(name, 0) + 1
            ranges.setdefault((name, e.get("pid"), e.get("tid")), []).append((e["ts"], e["ts"] + e.get("dur", 0)))
    launches = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {}):
            launches[e["args"]["correlation"]] = e
    kernels = [e for e in events if e.get("cat") == "kernel"]
    gpu = bool(kernels)
    if not gpu:  # the CPU: its ops stand in for kernels, launched where they run
        kernels = [e for e in events if e.get("cat") == "cpu_op"]

    def launch_of(k):
        if not gpu:
            return k
        return launches.get((k.get("args") or {}).get("correlation"))

    def in_ranges(launch, names) -> bool:
        if launch is None:
            return False
        t = launch["ts"]
        return any(_inside(t, ranges.get((n, launch.get("pid"), launch.get("tid")), [])) for n in names)

    update, compute_bwd, compute_fwd, gathers, reduces = [], [], [], [], []
    bwd_streams: set[str] = set()
    by_name: dict[str, dict] = {}
    for k in kernels:
        launch = launch_of(k)
        t = launch["ts"] if launch is not None else k["ts"]
        if not window[0] <= t <= window[1]:
            continue
        name = k.get("name", "")
        span = (k["ts"], k["ts"] + k.get("dur", 0))
        stream = (k.get("args") or {}).get("stream", k.get("tid"))
        nccl = "nccl" in name.lower()
        if any(u in name for u in UPDATE_KERNELS) or in_ranges(launch, UPDATE_RANGES):
            update.append(span)
            row = by_name.setdefault(name[:80], {"count": 0, "us": 0.0, "streams": {}})
            row["count"] += 1
            row["us"] += k.get("dur", 0)
            row["streams"][str(stream)] = row["streams"].get(str(stream), 0) + 1
        elif nccl or in_ranges(launch, ("fused_zero.all_gather", "fused_zero.reduce")):
            low = name.lower()
            if "allgather" in low or in_ranges(launch, ("fused_zero.all_gather",)):
                gathers.append(span)
            elif "reducescatter" in low or "reduce" in low or in_ranges(launch, ("fused_zero.reduce",)):
                reduces.append(span)
        elif _inside(t, phases["backward"]):
            compute_bwd.append(span)
            bwd_streams.add(str(stream))
        elif _inside(t, phases["forward"]):
            compute_fwd.append(span)
    update_streams = sorted({s for row in by_name.values() for s in row["streams"]})
    syncs = {c: 0 for c in SYNC_CALLS}
    for e in events:
        if e.get("name") in syncs and window[0] <= e["ts"] <= window[1]:
            syncs[e["name"]] += 1
    d2h = 0
    for e in events:
        if e.get("cat") == "gpu_memcpy" and ("DtoH" in e.get("name", "") or "Device -> P" in e.get("name", "")):
            launch = launches.get((e.get("args") or {}).get("correlation"))
            if window[0] <= (launch or e)["ts"] <= window[1]:
                d2h += 1
    per = max(iterations, 1)
    return dict(
        timeline="gpu kernels" if gpu else "cpu ops (no GPU kernels in the trace)",
        iterations=iterations,
        iteration_ms=_length(_union(iters)) / 1e3 / per,
        update_kernels_per_iter=len(update) / per,
        update_us_per_iter=_length(_union(update)) / per,
        update_streams=update_streams,
        update_by_name=dict(sorted(by_name.items(), key=lambda kv: -kv[1]["us"])[:8]),
        backward_compute_streams=sorted(bwd_streams)[:8],
        update_overlap_backward=overlap_share(update, compute_bwd),
        all_gather_us_per_iter=_length(_union(gathers)) / per,
        all_gather_overlap_forward=overlap_share(gathers, compute_fwd),
        reduce_us_per_iter=_length(_union(reduces)) / per,
        reduce_overlap_backward=overlap_share(reduces, compute_bwd),
        host_syncs_per_iter={c.removeprefix("cuda").removesuffix("Synchronize").lower(): n / per
                             for c, n in syncs.items()},
        d2h_copies_per_iter=d2h / per,
        ranges=counts,
    )


def _profile(system: System, data: list, cuda: bool, path: str) -> dict:
    """PROFILE_WARMUP iterations, then PROFILE_ITERS under torch.profiler, exported to ``path``."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    for i in range(PROFILE_WARMUP):
        system.forward_backward(*data[i % len(data)])
        system.step()
        system.zero_grad()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(PROFILE_ITERS):
            x, y = data[(PROFILE_WARMUP + i) % len(data)]
            with record_function("gpu_run.iteration"):
                with record_function("gpu_run.forward"):
                    with torch.autocast(system.device.type, dtype=torch.bfloat16, enabled=system.cfg["amp"]):
                        _, loss = system.ddp(x, y)
                with record_function("gpu_run.backward"):
                    loss.backward()
                with record_function("gpu_run.step"):
                    system.step()
                    system.zero_grad()
        if cuda:
            torch.cuda.synchronize()  # outside the iterations: not counted
    system.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        return json.load(f)


def section_profile(run: Run, sec: Section) -> None:
    _init_group(run)
    cfg = run.models["gpt2-small"]
    data = _batches(cfg, PROFILE_WARMUP + PROFILE_ITERS, run.device, seed=1)
    work = tempfile.mkdtemp(prefix="gpu_run_trace_")
    try:
        for opt in PROFILED:
            what = f"trace {opt}"
            if not sec.fits(15.0 if run.cuda else 2.0, what):
                continue
            system = None
            with sec.measuring(what):
                system = System(f"fused_zero-{opt}", cfg, run.device)
                path = os.path.join(work, f"trace-{opt}.json")
                trace = _profile(system, data, run.cuda, path)
                numbers = analyze_trace(trace, PROFILE_ITERS)
                del trace
                saved = None
                if opt == "adamw" and not run.args.no_trace:
                    saved = _keep_trace(run, path, f"trace-{opt}-bucket.json.gz")
                run.rec.emit("trace", optimizer=opt, model="gpt2-small", overlap="bucket", params=system.params,
                             note=system.note, trace_file=saved, **numbers)
            if system is not None:
                system.close()
            del system
            _free(run)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _keep_trace(run: Run, path: str, name: str) -> str | None:
    dest = os.path.join(run.out, name)
    with open(path, "rb") as src, gzip.open(dest, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    size = os.path.getsize(dest)
    if size > TRACE_LIMIT:
        os.unlink(dest)
        run.rec.emit("skip", what=f"keep {name}", reason=f"{size / 2 ** 20:.1f} MiB compressed, over "
                                                         f"{TRACE_LIMIT >> 20} MiB")
        return None
    return name


# ---------------------------------------------------------------------------------------- ncu


NCU_METRICS = ["dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes_read.sum",
               "dram__bytes_write.sum", "gpu__time_duration.sum"]


def _ncu_child() -> None:
    """Under ncu: one AdamW fp32 update at 64M elements, launched twice (ncu profiles the second)."""
    import torch

    step = _fused_step("adamw-fp32", 64 << 20)
    step()
    step()
    torch.cuda.synchronize()


def section_ncu(run: Run, sec: Section) -> None:
    ncu = shutil.which("ncu")
    if not run.cuda or ncu is None:
        sec.skip("ncu", "no CUDA (dry run)" if not run.cuda else "ncu is not on PATH")
        return
    if not sec.fits(15.0, "ncu adamw-fp32 64M"):
        return
    with sec.measuring("ncu adamw-fp32 64M"):
        cmd = [ncu, "--kernel-name", "regex:_adam_kernel", "--launch-skip", "1", "--launch-count", "1", "--metrics",
               ",".join(NCU_METRICS), "--csv", sys.executable, os.path.abspath(__file__), "--ncu-child"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(sec.left() - 2, 5))
        except subprocess.TimeoutExpired:
            sec.skip("ncu adamw-fp32 64M", f"ncu ran past the section's {sec.limit:.0f} s")
            return
        metrics = {}
        for line in proc.stdout.splitlines():
            cells = [c.strip('"') for c in line.split('","')]
            if len(cells) >= 3 and cells[-3] in NCU_METRICS:
                metrics[cells[-3]] = f"{cells[-1]} {cells[-2]}".strip()
        run.rec.emit("ncu", kernel="_adam_kernel", variant="adamw-fp32", size=64 << 20, exit=proc.returncode,
                     metrics=metrics, output_tail=None if metrics else (proc.stdout + proc.stderr)[-800:])


# ---------------------------------------------------------------------------------------- 2+ GPUs


def _ranks_main(rank: int, world: int, cfg: dict, cuda: bool) -> dict:
    """One rank: DDP + torch's AdamW, then fused_zero.AdamW (bucket, param_sync="forward": the
    all-gathers run on into the next forward), timed; then three fused_zero iterations profiled on rank
    0: the all-gathers against the forward's compute, the reductions against the backward's."""
    import torch

    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    data = _batches(cfg, cfg["warmup"] + cfg["iters"], device, seed=rank)
    out = {"rank": rank}
    for name in ("ddp+torch-adamw", "fused_zero-bucket"):
        system = System(name, cfg, device, param_sync="forward")
        rows = _iterate(system, data, cfg["warmup"], cfg["iters"], cuda)
        out[name] = statistics.median(r[1] for r in rows) * 1e3
        if name == "fused_zero-bucket":
            path = os.path.join(tempfile.mkdtemp(prefix="gpu_run_ranks_"), f"trace-rank{rank}.json")
            trace = _profile(system, data, cuda, path)
            if rank == 0:
                out["trace"] = analyze_trace(trace, PROFILE_ITERS)
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        system.close()
        del system
        gc.collect()
    return out


def section_multi_gpu(run: Run, sec: Section) -> None:
    import torch

    gpus = torch.cuda.device_count() if run.cuda else 0
    if run.cuda and gpus < 2:
        sec.skip("multi_gpu", f"{gpus} GPU: the all-gather overlapping the next forward and the reduce-scatter "
                              "need one rank per GPU (NCCL refuses two ranks on one GPU)")
        return
    world = min(gpus, 8) if run.cuda else 2
    cfg = dict(run.models["gpt2-small"])
    if not sec.fits(30.0 if run.cuda else 5.0, f"multi_gpu world {world}"):
        return
    from fused_zero.demo.spawn import run_ranks

    with sec.measuring(f"multi_gpu world {world}"):
        outs = run_ranks(_ranks_main, world, cfg, run.cuda, timeout=max(sec.left() - 2, 5),
                         backend="nccl" if run.cuda else "gloo")
        r0 = outs[0]
        base, ours = r0["ddp+torch-adamw"], r0["fused_zero-bucket"]
        run.rec.emit("multi_gpu", world=world, backend="nccl" if run.cuda else "gloo", model="gpt2-small",
                     note=None if run.cuda else "dry run: gloo ranks on the CPU stand in for GPUs",
                     ddp_iter_ms=base, fused_zero_iter_ms=ours, vs_ddp=ours / base if base else None,
                     ranks=[{k: v for k, v in o.items() if k != "trace"} for o in outs], **r0.get("trace", {}))


# ---------------------------------------------------------------------------------------- summary


def read_lines(path: str) -> tuple[list[dict], int]:
    """The JSON lines of ``path``; lines that do not parse (a kill's torn tail) are counted, not read."""
    lines, bad = [], 0
    with open(path) as f:
        for raw in f:
            raw = raw.strip()
            if not raw:
                continue
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                bad += 1
    return lines, bad


def _f(v, fmt="{:.2f}", none="-"):
    return none if v is None else fmt.format(v)


def _gbs(v) -> str:
    """GB/s: whole numbers on a GPU, three digits for the dry run's tiny rates."""
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def summarize(lines: list[dict], torn: int = 0) -> str:
    """The markdown summary of a run's lines: complete or not, every table it can fill."""
    by = {}
    for rec in lines:
        by.setdefault(rec.get("kind"), []).append(rec)
    env = (by.get("env") or [{}])[0]
    out = [f"# fused_zero GPU run: {env.get('gpu') or env.get('device', '?')}", ""]
    if env.get("dry_run"):
        out.append("**Dry run** (CPU, tiny sizes, gloo, Triton's interpreter): the numbers mean nothing.")
    ended = by.get("end")
    if ended:
        out.append(f"Complete: {ended[-1].get('t')} s of a {env.get('budget')} s budget.")
    elif by.get("abort"):
        out.append(f"**Stopped**: {by['abort'][-1].get('reason')} at {by['abort'][-1].get('t')} s; "
                   "what follows is what it measured.")
    else:
        last = lines[-1].get("t") if lines else None
        out.append(f"**Incomplete** (no end line: killed?); last line at {last} s.")
    if torn:
        out.append(f"{torn} line(s) did not parse (a torn tail) and are left out.")
    out += ["", "## Environment", ""]
    smi = env.get("nvidia_smi")
    gpu0 = smi[0] if isinstance(smi, list) and smi else {}
    gpu = f"{env.get('gpu')} x {env.get('gpus')}" if env.get("gpu") else "none (the CPU)"
    if env.get("capability"):
        gpu += f", sm {env['capability']}, {env.get('sm_count')} SMs, {env.get('memory_gib')} GiB"
    clocks = (f"SM {gpu0.get('clocks.sm', '-')} / {gpu0.get('clocks.max.sm', '-')} MHz max, memory "
              f"{gpu0.get('clocks.mem', '-')} / {gpu0.get('clocks.max.mem', '-')} MHz max, {gpu0.get('pstate', '-')}, "
              f"driver {gpu0.get('driver_version', '-')}")
    versions = f"{env.get('torch')}, {env.get('triton')}, {env.get('cuda')}, {env.get('nccl')}"
    cache = f"{env.get('triton_cache')} ({env.get('triton_cache_entries_at_start')} entries at the start)"
    rows = [["GPU", gpu], ["clocks (nvidia-smi)", clocks], ["torch, Triton, CUDA, NCCL", versions],
            ["Triton cache", cache], ["commit", str(env.get("commit"))]]
    out += _table(["", ""], rows)

    out += ["", "## Compile", "", "Each variant's first launch (compile, or the cache's load, included)."]
    comp = by.get("compile", [])
    out += [""] + (_table(["variant", "seconds"], [[c["variant"], _f(c["seconds"], "{:.3f}")] for c in comp])
                   if comp else ["not measured"])

    kern = by.get("kernel", [])
    sizes = sorted({r["size"] for r in kern + by.get("step_level", []) + by.get("torch_kernel", [])})
    labels = [size_label(s) for s in sizes]
    out += ["", "## Kernels", "", "GB/s (median of the rounds, L2 flushed) and, for fused_zero's, the share of the "
            "same run's device copy moving the same bytes per element."]
    if kern:
        cell = {(r["provider"], r["size"]): r for r in kern}
        providers = list(dict.fromkeys(r["provider"] for r in kern))
        rows = []
        for p in providers:
            bpe = next(r["bytes_per_element"] for r in kern if r["provider"] == p)
            cells = []
            for s in sizes:
                r = cell.get((p, s))
                cells.append("-" if r is None else _gbs(r["gbs"]) + (f" ({r['vs_copy']:.0%})" if r.get("vs_copy")
                                                                        else ""))
            rows.append([p, str(bpe)] + cells)
        out += [""] + _table(["provider", "B/elem"] + labels, rows)
    else:
        out += ["", "not measured"]

    out += ["", "## Step level", "", "The update with the grad_sumsq pre-pass and the skip flag, as step() runs "
            "them: GB/s of the bytes actually moved (the pre-pass reads the gradient again) and of the update's "
            "useful bytes, the useful rate's share of the copy, and the update alone's time over the step's."]
    step = by.get("step_level", [])
    if step:
        cell = {(r["provider"], r["size"]): r for r in step}
        rows = []
        for p in dict.fromkeys(r["provider"] for r in step):
            r0 = next(r for r in step if r["provider"] == p)
            cells = []
            for s in sizes:
                r = cell.get((p, s))
                cells.append("-" if r is None else f"{_gbs(r['gbs_actual'])} / {_gbs(r['gbs_useful'])}"
                             f" ({_f(r.get('vs_copy'), '{:.0%}')}; {_f(r.get('vs_update'), '{:.2f}')})")
            rows.append([p, f"{r0['actual_bytes_per_element']} / {r0['useful_bytes_per_element']}"] + cells)
        out += [""] + _table(["step", "B/elem actual / useful"] + labels, rows)
    else:
        out += ["", "not measured"]

    out += ["", "## torch.optim", "", "torch's time over fused_zero's for the same update (above 1: fused_zero is "
            "faster); bf16: torch on fp32 masters with the gradient and parameter casts a user needs."]
    tk = by.get("torch_kernel", [])
    if tk:
        cell = {(r["provider"], r["size"]): r for r in tk}
        rows = []
        for p in dict.fromkeys(r["provider"] for r in tk):
            versus = next(r["versus"] for r in tk if r["provider"] == p)
            rows.append([f"{p} / {versus}"] + [_f((cell.get((p, s)) or {}).get("torch_over_fused_zero"), "{:.3g}x")
                                               for s in sizes])
        out += [""] + _table(["torch / fused_zero"] + labels, rows)
    else:
        out += ["", "not measured"]

    out += ["", "## End to end", "", "World 1, median iteration (CUDA events). Exposed: the iteration minus "
            "forward + backward alone (same model, DDP, no optimizer). Ratios: the iteration over DDP + torch's "
            "AdamW's and over ZeroRedundancyOptimizer's."]
    e2e = by.get("e2e", [])
    if e2e:
        for model in dict.fromkeys(r["model"] for r in e2e):
            rs = [r for r in e2e if r["model"] == model]
            r0 = rs[0]
            out += ["", f"**{model}**: {r0.get('params')} parameters, batch {r0.get('batch')} x {r0.get('block')}, "
                        f"bf16 autocast {r0.get('bf16_autocast')}, {r0.get('backend')}, {r0.get('iters')} iterations "
                        f"after {r0.get('warmup')} warm-up", ""]
            base = next((r["iter_ms"] for r in rs if r["system"] == "ddp+torch-adamw"), None)
            zero = next((r["iter_ms"] for r in rs if r["system"] == "ddp+zero"), None)
            alone = next((r["iter_ms"] for r in rs if r["system"] == "fwd+bwd"), None)
            rows = [[r["system"], _f(r["iter_ms"]), _f(r["fwd_bwd_ms"]),
                     _f(r["iter_ms"] - alone if alone is not None and r["system"] != "fwd+bwd" else None),
                     _f(r["iter_ms"] / base if base else None, "{:.3f}"),
                     _f(r["iter_ms"] / zero if zero else None, "{:.3f}"), r.get("note", "")] for r in rs]
            out += _table(["system", "iteration ms", "fwd+bwd ms (in it)", "exposed ms", "vs DDP", "vs ZeRO", "note"],
                          rows)
    else:
        out += ["", "not measured"]

    out += ["", "## Profile", "", "Bucket mode, three iterations under torch.profiler. Update kernels: fused_zero's "
            "Triton kernels and every kernel launched inside a fused_zero.update/.muon/.whole_params range; overlap: "
            "the share of their time during which the backward's compute kernels run too."]
    tr = by.get("trace", [])
    if tr:
        rows = []
        for r in tr:
            sync = r.get("host_syncs_per_iter") or {}
            rows.append([r["optimizer"], _f(r.get("iteration_ms")), _f(r.get("update_kernels_per_iter"), "{:.0f}"),
                         _f(r.get("update_us_per_iter"), "{:.0f}"), ",".join(r.get("update_streams") or []) or "-",
                         ",".join(r.get("backward_compute_streams") or []) or "-",
                         _f(r.get("update_overlap_backward"), "{:.0%}"),
                         " / ".join(f"{v:g}" for v in sync.values()) or "-", _f(r.get("d2h_copies_per_iter"), "{:g}"),
                         r.get("trace_file") or "-"])
        out += [""] + _table(["optimizer", "iteration ms", "update kernels/iter", "update us/iter", "update streams",
                              "backward streams", "overlap with backward", "syncs/iter stream / event / device",
                              "D2H/iter", "trace"], rows)
        out.append("")
        out.append(f"Timeline: {tr[0].get('timeline')}.")
    else:
        out += ["", "not measured"]

    out += ["", "## ncu", ""]
    ncu = by.get("ncu", [])
    out += [f"{r.get('variant')} at {r.get('size')} elements: "
            + (", ".join(f"{k} {v}" for k, v in r["metrics"].items()) or f"no metrics (exit {r.get('exit')})")
            for r in ncu] or [_skipped(by, "ncu")]

    out += ["", "## Two or more GPUs", ""]
    mg = by.get("multi_gpu", [])
    for r in mg:
        out.append(f"World {r['world']} ({r['backend']}{'; ' + r['note'] if r.get('note') else ''}): iteration "
                   f"{_f(r.get('fused_zero_iter_ms'))} ms against DDP + torch AdamW {_f(r.get('ddp_iter_ms'))} ms "
                   f"({_f(r.get('vs_ddp'), '{:.3f}')}x); all-gather {_f(r.get('all_gather_us_per_iter'), '{:.0f}')} "
                   f"us/iter, {_f(r.get('all_gather_overlap_forward'), '{:.0%}')} of it overlapping the next forward's "
                   f"compute; reductions {_f(r.get('reduce_us_per_iter'), '{:.0f}')} us/iter, "
                   f"{_f(r.get('reduce_overlap_backward'), '{:.0%}')} overlapping the backward's; update overlap "
                   f"{_f(r.get('update_overlap_backward'), '{:.0%}')}.")
    if not mg:
        out.append(_skipped(by, "multi_gpu"))

    out += ["", "## Skipped and failed", ""]
    bad = [f"- skip `{r.get('what')}` ({r.get('section')}): {r.get('reason')}" for r in by.get("skip", [])]
    bad += [f"- **error** `{r.get('what')}` ({r.get('section')}): {r.get('error')}" for r in by.get("error", [])]
    out += bad or ["none"]

    out += ["", "## Time", ""]
    secs = by.get("section", [])
    out += _table(["section", "plan s", "limit s", "used s", "status", "skipped", "errors"],
                  [[s["name"], str(s["plan"]), _f(s["limit"], "{:.0f}"), _f(s["used"], "{:.1f}"), s["status"],
                    str(s["skipped"]), str(s["errors"])] for s in secs]) if secs else ["no section finished"]
    return "\n".join(out) + "\n"


def _skipped(by: dict, section: str) -> str:
    reasons = [r.get("reason") for r in by.get("skip", []) if r.get("section") == section]
    errors = [r.get("error") for r in by.get("error", []) if r.get("section") == section]
    if errors:
        return f"failed: {errors[0]}"
    return f"skipped: {reasons[0]}" if reasons else "not measured"


def write_summary(run: Run) -> str:
    lines, torn = read_lines(run.rec.path)
    text = summarize(lines, torn)
    path = os.path.join(run.out, "summary.md")
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    return text


# ---------------------------------------------------------------------------------------- main

SECTIONS = [("env", section_env), ("compile", section_compile), ("kernels", section_kernels), ("e2e", section_e2e),
            ("profile", section_profile), ("ncu", section_ncu), ("multi_gpu", section_multi_gpu)]


def _stop(run: Run, reason: str, code: int) -> None:
    """Write what a stop must leave: an abort line and the summary; then end the process at once."""
    with contextlib.suppress(Exception):
        run.rec.emit("abort", reason=reason)
    with contextlib.suppress(Exception):
        run.rec.say(write_summary(run))
    os._exit(code)


def _watchdog(run: Run) -> None:
    deadline = T0 + run.budget + GRACE

    def watch():
        while time.monotonic() < deadline:
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.01)))
        _stop(run, f"the watchdog: {run.budget + GRACE:.0f} s since the start", 3)

    threading.Thread(target=watch, daemon=True, name="gpu_run watchdog").start()
    for sig in (signal.SIGTERM, signal.SIGINT):  # timeout(1)'s signals: the lines so far and a summary
        signal.signal(sig, lambda number, _: _stop(run, signal.Signals(number).name, 128 + number))


def main(argv=None) -> int:
    os.environ.setdefault("TRITON_CACHE_DIR", TRITON_CACHE)  # before anything imports Triton
    if ROOT not in sys.path:  # this checkout's fused_zero, installed or not
        sys.path.insert(0, ROOT)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", help="folder for run.jsonl, summary.md, the trace and run.log")
    p.add_argument("--summarize", metavar="JSONL", help="print the summary of a run's lines and exit")
    p.add_argument("--plan", action="store_true", help="print the sections' seconds and exit")
    p.add_argument("--dry-run", action="store_true", help="the CPU: tiny sizes, gloo, Triton's interpreter")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds from the start for the sections (default {BUDGET}); the watchdog stops the "
                        f"process {GRACE} s later")
    p.add_argument("--only", help="comma-separated sections to run (env and summary always run)")
    p.add_argument("--sizes", help="comma-separated kernel sizes in elements (default 1M,16M,64M,256M)")
    p.add_argument("--no-trace", action="store_true", help="keep no trace file under OUT")
    p.add_argument("--no-log", action="store_true", help="write no run.log (when stdout is kept anyway)")
    p.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ncu_child:
        _ncu_child()
        return 0
    if args.plan:
        for name, seconds in PLAN.items():
            print(f"{name:10} {seconds:4d} s")
        print(f"{'total':10} {BUDGET:4d} s (the watchdog stops the process at {BUDGET + GRACE} s)")
        return 0
    if args.summarize:
        lines, torn = read_lines(args.summarize)
        print(summarize(lines, torn), end="")
        return 0
    if not args.out:
        p.error("--out is required (or --summarize, --plan)")
    args.budget = BUDGET if args.budget is None else args.budget
    os.makedirs(args.out, exist_ok=True)
    for name in ("run.jsonl", "summary.md", "run.log"):  # one run per folder: a rerun starts clean
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(args.out, name))
    run = Run(args)
    _watchdog(run)
    for name, fn in SECTIONS:
        with run.section(name) as sec:
            if sec is not None:
                fn(run, sec)
        if name == "env" and run.device is None:
            break  # no device: nothing else can run
    with run.section("summary"):
        pass
    run.rec.emit("end", seconds=round(time.monotonic() - T0, 1))
    text = write_summary(run)
    run.rec.say(text)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if run.group_file:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(run.group_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
