"""The GPU checks, run by test_gpu.py each in a fresh Python process without ``TRITON_INTERPRET`` (the
suite's conftest switches the interpreter on for the CPU tests, and Triton reads it once, at import):
``python gpu_cases.py CASE`` exits 0 when the case passes, 77 when this machine cannot run it (the
reason on the last line of stdout), anything else when it fails.

Every oracle is torch.optim on the same device: the kernels over 100 steps on ragged slices, the engine
at world 1 in every overlap mode and param_sync, two gloo ranks sharing one GPU, NCCL on 2+ GPUs with
every rank left on current device 0 (the DDP tutorial's ``model.to(rank)`` without ``set_device``).
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: scenarios.OddNet, shared with the CPU tests

SKIP = 77
DEVICE = os.environ.get("FUSED_ZERO_CASES_DEVICE", "cuda")  # "cpu": a dry run of the harness itself


def measure(kind: str, what: str, mine: torch.Tensor, theirs: torch.Tensor) -> None:
    """Record how far ``mine`` is from torch.optim's ``theirs`` (largest difference, relative to the
    tensor's scale and in ulps of it, share of elements that differ at all), one JSON line per call to
    the file ``GPU_MEASURE`` names (bench/gpu_check.sh sets it): the first GPU run measures what the
    tolerances below are set to; docs/performance-gpu-run.md lists the figures it must produce."""
    path = os.environ.get("GPU_MEASURE")
    if not path:
        return
    import json

    a, b = mine.detach().double().reshape(-1), theirs.detach().double().reshape(-1)
    scale = float(b.abs().max()) or 1.0
    diff = (a - b).abs()
    ulp = float(torch.finfo(theirs.dtype if theirs.is_floating_point() else torch.float32).eps) * scale
    with open(path, "a") as f:
        f.write(json.dumps({"kind": kind, "case": what, "max_abs": float(diff.max()), "scale": scale,
                            "max_rel_to_scale": float(diff.max()) / scale, "max_ulps_of_scale": float(diff.max()) / ulp,
                            "share_differing": float((diff != 0).double().mean())}) + "\n")


KERNEL_RTOL, KERNEL_ATOL = 2e-5, 2e-6
"""``_close``: rtol, and atol relative to the tensor's scale (a few fp32 ulps of it after 100 steps)."""
ENGINE_BF16_RTOL, ENGINE_BF16_ATOL = 2 ** -7, 1e-5
"""``_engine_parity`` on bf16 parameters: a few bf16 ulps; a skipped or doubled step is ~lr away."""
TOLERANCE_FACTOR = 2
"""How far past torch's own fused-vs-single distance a case's tolerance may go. The kernels round every
product and sum as written (FP fusion off); torch's single-tensor path fuses multiply-adds within each
op, its fused path across ops too: the kernels are expected no further from single than fused is, and
twice its distance leaves room for the few elements a rounding flips landing elsewhere."""
MEASURED = {"kernel_adam_amsgrad_bf16": KERNEL_ATOL, "engine_bf16": ENGINE_BF16_ATOL}
"""The two cases whose tolerance the GPU measures (bench/gpu_tolerance.py), with today's atol each."""


def measured_tolerance(case: str) -> float:
    """The atol of one of the two ``MEASURED`` cases: max(today's, TOLERANCE_FACTOR x torch's own fused-vs-
    single distance in that case, measured on this GPU in the same call) when the file ``GPU_TOLERANCES``
    names holds it (bench/gpu_check.sh's tests set runs bench/gpu_tolerance.py first), else today's.
    The distance is the atol torch's fused result needs against its single-tensor one at the case's
    rtol; never looser than that, never tighter than today's. Recorded in ``GPU_MEASURE``."""
    import json

    today, measured = MEASURED[case], None
    path = os.environ.get("GPU_TOLERANCES")
    if path and os.path.exists(path):
        with open(path) as f:
            measured = json.load(f)["cases"][case]["torch_fused_vs_single"]
    used = today if measured is None else max(today, TOLERANCE_FACTOR * measured)
    if os.environ.get("GPU_MEASURE"):
        with open(os.environ["GPU_MEASURE"], "a") as f:
            f.write(json.dumps({"kind": "tolerance", "case": case, "used": used, "today": today,
                                "torch_fused_vs_single": measured, "factor": TOLERANCE_FACTOR}) + "\n")
    return used


class Skip(Exception):
    """This machine cannot run the case; the message says why."""


# ---------------------------------------------------------------------------------------- kernels

SIZES = (1, 7, 1000, 4099, 33, 2050, 131073)
STEPS = 100


def _rows(sizes, lo, hi):
    """Segments rows of the flat slice [lo, hi): shard offsets local to the slice, param/grad global."""
    rows, start = [], 0
    for pid, n in enumerate(sizes):
        a, b = max(start, lo), min(start + n, hi)
        if a < b:
            rows.append((a - lo, b - a, a, a, pid))
        start += n
    return rows


def _kernel_run(opt_name, low, *, found_inf_step=None, clip=None, scale=None, world=3):
    """Step the fused kernel on ``world`` slices cut mid-parameter and torch.optim side by side."""
    from fused_zero.kernels import Segments, adam_coefficients, adam_step, sgd_coefficients, sgd_step

    dev = torch.device(DEVICE)
    total = sum(SIZES)
    master_needed = low != torch.float32
    p0 = torch.randn(total, device=dev) * 0.5
    param = p0.to(low)
    start = param.float()  # the reference starts from the rounded parameters, in fp32
    master = start.clone() if master_needed else None
    ref = [t.clone().requires_grad_(True) for t in start.split(SIZES)]
    is_adam = opt_name != "SGD"
    if is_adam:
        kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=opt_name == "Adam")
        opt = getattr(torch.optim, opt_name)(ref, foreach=False, **kw)
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if kw["amsgrad"] else [])
    else:
        kw = dict(lr=5e-2, momentum=0.9, weight_decay=0.01)
        opt = torch.optim.SGD(ref, foreach=False, **kw)
        names = ["momentum_buffer"]
    state = {n: torch.zeros(total, device=dev) for n in names}
    cut = [total * r // world for r in range(world + 1)]
    segs = [Segments.build(_rows(SIZES, cut[r], cut[r + 1]), dev) for r in range(world)]
    extra = dict(grad_scale=None if scale is None else torch.tensor([scale], device=dev),
                 clip_coef=None if clip is None else torch.tensor([clip], device=dev))
    found = torch.zeros(1, device=dev)
    taken = 0
    for step in range(1, STEPS + 1):
        lr = kw["lr"] * (1 + 0.5 * math.cos(step))
        g = torch.randn(total, device=dev).to(low)
        skip = step == found_inf_step
        if not skip:
            taken += 1
            for p, gg in zip(ref, g.float().split(SIZES)):
                gg = gg / scale if scale is not None else gg
                p.grad = gg * clip if clip is not None else gg
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        found.fill_(1.0 if skip else 0.0)
        if is_adam:
            coefs = adam_coefficients(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                      step=max(taken, 1), decoupled=opt_name == "AdamW").to(dev)
        else:
            coefs = sgd_coefficients(lr=lr, momentum=0.9, dampening=0.0, weight_decay=0.01,
                                     first=taken <= 1).to(dev)
        coefs = coefs.expand(len(SIZES), -1).contiguous()
        for r in range(world):
            lo, hi = cut[r], cut[r + 1]
            view = {n: t[lo:hi] for n, t in state.items()}
            m = None if master is None else master[lo:hi]
            if is_adam:
                adam_step(segs[r], coefs, grad=g, param=param, master=m, exp_avg=view["exp_avg"],
                          exp_avg_sq=view["exp_avg_sq"], max_exp_avg_sq=view.get("max_exp_avg_sq"),
                          found_inf=found, **extra)
            else:
                sgd_step(segs[r], coefs, grad=g, param=param, master=m,
                         momentum_buffer=view["momentum_buffer"], found_inf=found, **extra)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    what = f"{opt_name} {low} found_inf_step={found_inf_step} clip={clip} scale={scale}"
    plain = found_inf_step is None and clip is None and scale is None
    atol = measured_tolerance("kernel_adam_amsgrad_bf16") if (opt_name, low, plain) == ("Adam", torch.bfloat16, True) \
        else KERNEL_ATOL
    mine_w = master if master is not None else param.float()
    theirs_w = torch.cat([p.detach() for p in ref])
    _close(mine_w, theirs_w, f"{what}: weights", atol)
    for n in names:
        theirs = torch.cat([opt.state[p][n].reshape(-1) for p in ref])
        _close(state[n], theirs, f"{what}: {n}", atol)
    if master is not None:
        assert torch.equal(master.to(low), param), f"{what}: parameters are not the master rounded"


def _close(mine, theirs, what, atol=KERNEL_ATOL):
    """Within a few fp32 ulps of the tensor's scale after 100 steps (``atol`` relative to that scale):
    torch's CUDA kernels contract a*b+c into FMAs where the kernels round each product; a wrong or
    skipped step is off by ~lr."""
    measure("kernels", what, mine, theirs)
    scale = float(theirs.abs().max())
    torch.testing.assert_close(mine, theirs, rtol=KERNEL_RTOL, atol=atol * scale + 1e-12,
                               msg=lambda m: f"{what}: {m}")


def case_kernels_exact():
    """The compiled kernels against their exact reference (tests/kernels/kernel_reference.py): with FP
    fusion off, div_rn and sqrt_rn, the GPU's arithmetic is the reference's, bit for bit."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "kernels"))
    import test_kernel_exact as exact

    cases = [("adam", v) for v in exact.ADAM_VARIANTS] + [("sgd", v) for v in exact.SGD_VARIANTS]
    found = [f"{kind} {variant}: {diff}" for kind, variant in cases
             if (diff := exact.run(kind, *variant, device="cuda"))]
    if found:
        raise AssertionError("\n".join(found))


def case_kernels():
    for opt_name in ("AdamW", "Adam", "SGD"):
        for low in (torch.float32, torch.bfloat16, torch.float16):
            _kernel_run(opt_name, low)
    _kernel_run("AdamW", torch.bfloat16, found_inf_step=37)
    _kernel_run("AdamW", torch.float16, scale=1024.0, found_inf_step=5)
    _kernel_run("AdamW", torch.float32, clip=0.25)
    _kernel_run("SGD", torch.bfloat16, clip=0.5, scale=256.0, found_inf_step=50)


# ---------------------------------------------------------------------------------------- engine


def _engine_parity(rank, world, overlap, param_sync, dtype, device, steps=20, bucket_cap_mb=0.0001,
                   grad_reduce="reduce_scatter", graph="plain", zero_to_none=True):
    """fused_zero AdamW under DDP against DDP + torch.optim.AdamW (on fp32 masters for bf16), on
    ``device``; every step compares every parameter (param_sync="forward": after synchronize())."""
    from scenarios import VOCAB, batch, twin_models
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero

    model, ref = twin_models(device, dtype, freeze_never=graph == "plain")
    bf16_atol = measured_tolerance("engine_bf16") if world == 1 and dtype != torch.float32 else ENGINE_BF16_ATOL
    ids = [device.index] if device.index is not None else None
    kw = dict(bucket_cap_mb=bucket_cap_mb, device_ids=ids, find_unused_parameters=graph == "find_unused")
    ddp, ref_ddp = DDP(model, **kw), DDP(ref, **kw)
    opt = fused_zero.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1, ddp=ddp, overlap=overlap,
                           param_sync=param_sync, grad_reduce=grad_reduce)
    params = [p for p in ref.parameters() if p.requires_grad]
    masters = [p.detach().float().requires_grad_(True) for p in params] if dtype != torch.float32 else params
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in batch(step, 0, rank))
        use_branch = graph == "plain" or (step + rank) % 3 == 0
        for d, o in ((ref_ddp, None), (ddp, opt)):
            loss = F.cross_entropy(d(x, use_branch=use_branch).float().reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            if o is None:
                for p, m in zip(params, masters):
                    if m is not p:
                        m.grad = None if p.grad is None else p.grad.float()
                ref_opt.step()
                ref_opt.zero_grad()
                with torch.no_grad():
                    for p, m in zip(params, masters):
                        if m is not p:
                            p.copy_(m)
                        p.grad = None
            else:
                o.step()
                o.zero_grad(set_to_none=zero_to_none)  # False: an in-place write right after step()
        if param_sync == "forward" and step % 5:
            continue  # leave the gathers to the next forward's pre-hooks
        opt.synchronize()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            a, b = p.detach().float(), q.detach().float()
            measure("engine", f"world {world} {overlap} {grad_reduce} {param_sync} {dtype} {graph} step {step} {name}",
                    a, b)
            if dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            else:  # a few bf16 ulps: a skipped or doubled step is ~lr away on parameters near 1
                torch.testing.assert_close(a, b, rtol=ENGINE_BF16_RTOL, atol=bf16_atol,
                                           msg=lambda m, n=name: f"{n}: {m}")
    opt._engine.close()
    return opt._engine.layout_changes


def _world1(rank, world, steps):
    device = torch.device("cuda", 0)
    for overlap in ("bucket", "backward", "step"):
        for param_sync in ("step", "forward"):
            for dtype in (torch.float32, torch.bfloat16):
                _engine_parity(rank, world, overlap, param_sync, dtype, device, steps=steps,
                               zero_to_none=param_sync == "step")
    _engine_parity(rank, world, "bucket", "step", torch.float32, device, steps=steps, graph="find_unused")


def case_engine_world1():
    from fused_zero.demo.spawn import run_ranks

    run_ranks(_world1, 1, 20, backend="nccl", timeout=300)


def _muon(rank, world, steps=8):
    """fused_zero.Muon beside fused_zero.AdamW over one DDP module (OddNet's matrices and the rest, as the
    CPU tests split it) against torch.optim.Muon + AdamW, in every overlap mode: Newton-Schulz on the
    side stream, the AdamW part in the Triton kernels. The Muon part runs torch's own ops on the owner,
    so what differs is the kernels' AdamW (a few fp32 ulps) as it reaches the next steps' gradients;
    a skipped or doubled Muon step moves its matrices by lr x |O| ~ 5e-3."""
    from scenarios import VOCAB, Case, batch, muon_split, twin_models
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero

    device = torch.device("cuda", 0)
    for overlap in ("bucket", "backward", "step"):
        model, ref = twin_models(device)
        ddp, ref_ddp = (DDP(m, bucket_cap_mb=0.0001, device_ids=[0]) for m in (model, ref))
        case = Case(opt="Muon")
        opts = [getattr(fused_zero, kind)(groups, ddp=ddp, overlap=overlap) for kind, groups in muon_split(model, case)]
        ref_opts = [getattr(torch.optim, kind)(groups, **({} if kind == "Muon" else {"foreach": False}))
                    for kind, groups in muon_split(ref, case)]
        for step in range(1, steps + 1):
            x, y = (t.to(device) for t in batch(step, 0, rank))
            for d, os_ in ((ref_ddp, ref_opts), (ddp, opts)):
                F.cross_entropy(d(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1)).backward()
                for o in os_:
                    o.step()
                for o in os_:
                    o.zero_grad()
            opts[0].synchronize()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                measure("muon", f"world {world} {overlap} step {step} {name}", p, q)
                torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-3, atol=5e-4,
                                           msg=lambda m, n=f"{overlap} step {step} {name}": f"{n}: {m}")
        opts[0]._engine.close()


def case_muon():
    from fused_zero.demo.spawn import run_ranks

    run_ranks(_muon, 1, backend="nccl", timeout=300)


def _formats(rank, world):
    """Compact state with the compiled kernels: bf16 and 8-bit moments, per-group formats in mixed
    buckets, stochastic rounding, each against its oracle (tests/pipeline/updating/formats_scenarios.py: torch.optim
    with its moments put through the format), within the tolerance of the interpreted-kernel cases."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "pipeline", "updating"))
    from formats_scenarios import FormatCase, train

    cases = [FormatCase(state_format=f, overlap=o, backend="triton", device="cuda", steps=8)
             for f in ("bf16", "8bit") for o in ("bucket", "backward", "step")]
    cases += [FormatCase(groups=("8bit", "bf16", None), state_format="fp32", overlap="step", backend="triton",
                         device="cuda", bucket_cap_mb=0.002, steps=8),
              FormatCase(state_format="8bit", stochastic=True, overlap="backward", backend="triton", device="cuda",
                         steps=8),
              FormatCase(state_format="bf16", opt="SGD", overlap="bucket", backend="triton",
                         device="cuda", steps=8)]
    for case in cases:
        opt = train(case, rank, world)[2]
        opt._engine.close()
    _dcp_8bit(rank, world, FormatCase, train)


def _dcp_8bit(rank, world, FormatCase, train, device="cuda", backend="triton"):
    """DCP format 3 on a CUDA mesh: 8-bit codes and block scales saved (uint8 chunks of CUDA tensors, the
    scales gathered over NCCL), loaded into a fresh 8-bit optimizer (received in fp32, decoded on the
    device) and into an fp32 one, each past DDP's bucket rebuild (so the load encodes at once): the
    values the saver's ``state_dict()`` decodes, equal."""
    import tempfile

    import torch.distributed.checkpoint as dcp

    case = FormatCase(state_format="8bit", overlap="step", backend=backend, device=device, steps=2)
    built = train(case, rank, world)
    path = [tempfile.mkdtemp(prefix="fused_zero_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    path = path[0]
    dcp.save(built[2].sharded_state_dict(), checkpoint_id=path)
    for fmt in ("8bit", "fp32"):
        other = train(FormatCase(state_format=fmt, overlap="step", backend=backend, device=device, steps=2),
                      rank, world)
        other[0].load_state_dict(built[0].state_dict())
        target = other[2].sharded_state_dict()
        dcp.load(target, checkpoint_id=path)
        other[2].load_sharded_state_dict(target)
        mine, theirs = built[2].state_dict()["state"], other[2].state_dict()["state"]
        for i, entry in mine.items():
            for k, v in entry.items():
                if not torch.equal(v, theirs[i][k]):
                    raise AssertionError(f"DCP 8-bit into {fmt}: parameter {i} {k} differs after the load")
        other[2]._engine.close()
    built[2]._engine.close()


def case_formats():
    from fused_zero.demo.spawn import run_ranks

    run_ranks(_formats, 1, backend="nccl", timeout=300)


class _HostWaits:
    """Counts the host waits torch's sync debug mode does not flag (an event's or a stream's
    ``synchronize()``, ``torch.cuda.synchronize()``) while installed."""

    def __init__(self):
        self.counts = {"event": 0, "stream": 0, "device": 0}
        self._real = (torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize, torch.cuda.synchronize)

    def __enter__(self):
        ev, st, dev = self._real
        counts = self.counts

        def event_sync(event):
            counts["event"] += 1
            return ev(event)

        def stream_sync(stream):
            counts["stream"] += 1
            return st(stream)

        def device_sync(device=None):
            counts["device"] += 1
            return dev(device)

        torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize, torch.cuda.synchronize = \
            event_sync, stream_sync, device_sync
        return self

    def __exit__(self, *exc):
        torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize, torch.cuda.synchronize = self._real


SYNC_FREE_CONFIGS = [(o, sync, graph, scaler) for o in ("bucket", "backward", "step") for sync in ("step", "forward")
                     for graph in ("plain", "find_unused") for scaler in ((False, True) if o != "bucket" else (False,))]


def _no_host_sync(rank, world, device_index):
    """After the warm-up iterations (DDP rebuilds its buckets), in every overlap mode x param_sync x
    find_unused_parameters x GradScaler (fp16 with fp32 masters and an inf on some steps; else fp32):
    the backward and the step run under torch's sync debug mode set to "error", so any host
    synchronization on the step path (a .item(), a blocking copy) fails; and the event, stream and
    device waits that mode does not see are counted from the first iteration on: there must be none
    (the step counts live on the device, pipeline/updating/step_counts.py). With find_unused_parameters DDP's
    own reducer reads its used map on the host each backward, so there only the counted waits are
    checked."""
    from scenarios import VOCAB, OddNet, batch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero

    device = torch.device("cuda", device_index)
    found = []
    for overlap, sync, graph, with_scaler in SYNC_FREE_CONFIGS:
        torch.manual_seed(1234)
        model = OddNet()
        if graph == "plain":
            model.never.requires_grad_(False)
        model.to(device=device, dtype=torch.float16 if with_scaler else torch.float32)
        ddp = DDP(model, device_ids=[device_index], bucket_cap_mb=0.0001,
                  find_unused_parameters=graph == "find_unused")
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10) if with_scaler else None
        opt = fused_zero.AdamW(ddp.parameters(), lr=1e-3, ddp=ddp, overlap=overlap, param_sync=sync,
                               grad_scaler=scaler)
        waits = _HostWaits()
        for step in range(1, 9):
            x, y = (t.to(device) for t in batch(step, 0, rank))
            waits.__enter__()
            if step > 3 and graph == "plain":  # DDP's bucket rebuild synchronizes in the first ones
                torch.cuda.set_sync_debug_mode("error")
            try:
                loss = F.cross_entropy(ddp(x, use_branch=graph == "plain" or step % 2 == 0).float()
                                       .reshape(-1, VOCAB), y.reshape(-1))
                if scaler is not None and step in (5, 7):
                    loss = loss * float("inf")
                (scaler.scale(loss) if scaler is not None else loss).backward()
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode(0)
                waits.__exit__()
        what = f"world {world} overlap={overlap} param_sync={sync} {graph} scaler={with_scaler}"
        if scaler is not None and opt.skipped_steps != 2:
            found.append(f"{what}: {opt.skipped_steps} skipped steps, expected 2")
        c = waits.counts
        if c["event"] or c["stream"] or c["device"]:
            found.append(f"{what}: host waits over 8 iterations: {c}")
        opt._engine.close()
    if found:
        raise AssertionError("\n".join(found))


def case_no_host_sync():
    """At world 1 (a real NCCL process group of one rank: the engine's CUDA path, no collective), and
    at world 2 over NCCL where there are two GPUs. Not with two gloo ranks sharing one GPU: the sync
    debug mode is process-wide and gloo's CUDA work synchronizes in gloo's own threads, and a gloo
    Work's wait is a host wait by design, so that run could only fail. The step path at world 2 and
    4 with NCCL's ordering is checked for host synchronizations on the CPU (the stream-order checker,
    tests/pipeline/comm/test_stream_order.py)."""
    from fused_zero.demo.spawn import run_ranks

    run_ranks(_no_host_sync, 1, 0, backend="nccl", timeout=300)
    if torch.cuda.device_count() >= 2:
        run_ranks(_no_host_sync_per_rank, 2, backend="nccl", timeout=300)
    else:
        print(f"world 2 not run: NCCL needs one GPU per rank, this machine has {torch.cuda.device_count()}")


def _no_host_sync_per_rank(rank, world):
    torch.cuda.set_device(rank)
    _no_host_sync(rank, world, rank)


def case_engine_sanitized():
    """The world-1 engine checks again, fewer steps, with torch's CUDA sanitizer on: the parent sets
    TORCH_CUDA_SANITIZER=1, which torch reads at import (it sees torch's ops, not Triton's launches)."""
    from fused_zero.demo.spawn import run_ranks

    if not os.environ.get("TORCH_CUDA_SANITIZER"):
        raise Skip("TORCH_CUDA_SANITIZER is not set")
    run_ranks(_world1, 1, 4, backend="nccl", timeout=300)


_GLOO_CUDA_UNSUPPORTED = ("unsupported", "not supported", "no backend type associated with device type cuda",
                          "invalid device", "is not implemented for cuda")
"""What gloo says when it cannot run a collective on CUDA tensors: the only errors the probe skips on."""


def _gloo_cuda_probe(world) -> str | None:
    """None when this torch's gloo runs every collective fused_zero issues on CUDA tensors; else the skip
    reason, naming the collective and gloo's message. Any other error is raised: it is a failure."""
    from fused_zero.pipeline.comm import collectives

    dev = torch.device("cuda", 0)
    t = torch.ones(4 * world, device=dev)
    out = torch.empty(4, device=dev)
    probes = [("reduce_scatter", lambda: collectives.reduce_scatter(out, t, None, async_op=False)),
              ("all_gather", lambda: collectives.all_gather(t, out, None, async_op=False)),
              ("all_to_all_single", lambda: collectives.all_to_all_single(
                  torch.empty(4 * world, device=dev), t, [4] * world, [4] * world, None)),
              ("all_reduce", lambda: collectives.all_reduce(out, None).wait())]
    for name, probe in probes:
        try:
            probe()
            torch.cuda.synchronize()
        except (RuntimeError, NotImplementedError, ValueError) as e:
            message = str(e).splitlines()[0]
            if not any(m in message.lower() for m in _GLOO_CUDA_UNSUPPORTED):
                raise
            return f"skip: gloo in torch {torch.__version__} does not run {name} on CUDA tensors: {message}"
    return None


def _shared_gpu(rank, world):
    """Two gloo ranks on one GPU: first check that this torch's gloo takes CUDA tensors for every
    collective fused_zero issues, then the engine in each mode against DDP + torch.optim."""
    dev = torch.device("cuda", 0)
    reason = _gloo_cuda_probe(world)
    if reason:
        return reason
    changes = 0
    modes = (("bucket", "reduce_scatter"), ("backward", "all_reduce"), ("step", "reduce_scatter"))
    for overlap, grad_reduce in modes:
        changes += _engine_parity(rank, world, overlap, "forward", torch.float32, dev, steps=10,
                                  grad_reduce=grad_reduce)
    _engine_parity(rank, world, "bucket", "step", torch.float32, dev, steps=10, graph="find_unused")
    assert changes > 0, "DDP never rebuilt its buckets: the resharding path was not exercised"
    return "ok"


def case_two_ranks_one_gpu():
    from fused_zero.demo.spawn import run_ranks

    outs = run_ranks(_shared_gpu, 2, backend="gloo", timeout=400)
    if any(o.startswith("skip") for o in outs):
        raise Skip(outs[0])


def _nccl(rank, world):
    torch.cuda.set_device(0)  # what a script that never calls set_device has on every rank
    dev = torch.device("cuda", rank)
    changes = 0
    modes = (("bucket", "reduce_scatter", "forward"), ("backward", "all_reduce", "step"),
             ("step", "reduce_scatter", "forward"), ("bucket", "all_reduce", "forward"))
    for overlap, grad_reduce, sync in modes:
        for dtype in (torch.float32, torch.bfloat16):
            changes += _engine_parity(rank, world, overlap, sync, dtype, dev, steps=12, grad_reduce=grad_reduce)
    _engine_parity(rank, world, "backward", "forward", torch.float32, dev, steps=12, graph="find_unused")
    assert changes > 0, "DDP never rebuilt its buckets: the resharding path was not exercised"


def case_nccl_multi_gpu():
    from fused_zero.demo.spawn import run_ranks

    n = torch.cuda.device_count()
    if n < 2:
        raise Skip(f"NCCL needs one GPU per rank; this machine has {n}")
    run_ranks(_nccl, 2, backend="nccl", timeout=400)  # two: bf16 sums in DDP's order (see scenarios.py)


SLEEP_CYCLES = 200_000_000
"""GPU cycles the side stream sleeps before each iteration's updates (about 0.1 s): long after step()
has returned on the host, the updates are still queued."""


def _rank0_checkpoint(rank, world):
    """nanoGPT's rank-0-only ``state_dict()`` right after ``step()``, with every rank's updates still
    queued behind a ``torch.cuda._sleep`` on its side stream: the dict must be torch.optim's at that
    step, so each server's copy must wait for its published event (issue 28's defect 6 reads the region
    before the updates ran, whatever the timing). Rank 1 goes straight on into its next iteration."""
    from scenarios import VOCAB, batch, twin_models
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero

    dev = torch.device("cuda", 0)
    reason = _gloo_cuda_probe(world)
    if reason:
        return reason
    for overlap in ("bucket", "backward", "step"):
        model, ref = twin_models(dev)
        ddp, ref_ddp = DDP(model, bucket_cap_mb=0.0001), DDP(ref, bucket_cap_mb=0.0001)
        opt = fused_zero.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1, ddp=ddp, overlap=overlap)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        for step in range(1, 5):
            x, y = (t.to(dev) for t in batch(step, 0, rank))
            F.cross_entropy(ref_ddp(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            with torch.cuda.stream(opt._engine.side.stream):
                torch.cuda._sleep(SLEEP_CYCLES)  # every update of this iteration queues behind it
            F.cross_entropy(ddp(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
            if rank != 0:
                continue
            ours, theirs = opt.state_dict()["state"], ref_opt.state_dict()["state"]
            assert sorted(ours) == sorted(theirs), (overlap, step, sorted(ours), sorted(theirs))
            for k, entry in theirs.items():
                for name, value in entry.items():
                    a, b = ours[k][name].float().cpu(), value.float().cpu()
                    measure("rank0 state_dict", f"{overlap} step {step} param {k} {name}", a, b)
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                               msg=lambda m, w=(overlap, step, k, name): f"{w}: {m}")
        torch.distributed.barrier()
        opt._engine.close()
    return "ok"


def case_rank0_state_dict():
    from fused_zero.demo.spawn import run_ranks

    outs = run_ranks(_rank0_checkpoint, 2, backend="gloo", timeout=300)
    if any(o.startswith("skip") for o in outs):
        raise Skip(outs[0])


def _capture(rank, world, steps=14):
    """``capturable=True`` (step() replayed from a CUDA graph) against the same engine stepping eagerly,
    on the same weights and batches, with an lr changed every step by a scheduler and clipping: every
    parameter bit for bit after every step (the graph runs the same kernels on the same values), and
    the graph captured and replayed. Then against torch.optim.AdamW within the engine's tolerance."""
    from scenarios import VOCAB, batch, twin_models
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero

    device = torch.device("cuda", 0)
    model, twin = twin_models(device)
    _, ref = twin_models(device)
    ddps = [DDP(m, bucket_cap_mb=0.0001, device_ids=[0]) for m in (model, twin)]
    opts = [fused_zero.AdamW(d.parameters(), lr=1e-2, weight_decay=0.1, ddp=d, overlap="step", max_grad_norm=0.5,
                             capturable=c) for d, c in zip(ddps, (True, False))]
    ref_ddp = DDP(ref, bucket_cap_mb=0.0001, device_ids=[0])
    ref_opt = torch.optim.AdamW(ref_ddp.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (*opts, ref_opt)]
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in batch(step, 0, rank))
        for d, o in (*zip(ddps, opts), (ref_ddp, ref_opt)):
            F.cross_entropy(d(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1)).backward()
            if o is ref_opt:
                torch.nn.utils.clip_grad_norm_(ref_ddp.parameters(), 0.5)
            o.step()
            o.zero_grad()
        for s in schedules:
            s.step()
        opts[0].synchronize()
        opts[1].synchronize()
        for (name, p), q, r in zip(model.named_parameters(), twin.parameters(), ref.parameters()):
            assert torch.equal(p, q), f"step {step} {name}: the replayed step differs from the eager one"
            measure("capture", f"step {step} {name}", p, r)
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=f"step {step} {name}": f"{n}: {m}")
    graph = opts[0]._engine.graph
    assert graph.captures >= 1 and graph.replays >= steps - 6, (graph.captures, graph.replays)
    print(f"captures {graph.captures}, replays {graph.replays} of {steps} steps")
    for o in opts:
        o._engine.close()


def case_capture():
    from fused_zero.demo.spawn import run_ranks

    run_ranks(_capture, 1, backend="nccl", timeout=300)


# ------------------------------------------------------------------ several optimizers, each its own

FIRST = ("emb", "l1", "norm")  # the first optimizer's parameters; l1.weight's gradient overflows below


def _ids(device) -> list | None:
    return [device.index] if device.type == "cuda" else None  # DDP over a CPU module takes none


def _split(model, names=FIRST):
    first = [p for n, p in model.named_parameters() if p.requires_grad and n.startswith(names)]
    return first, [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith(names)]


def _muon_without_host_waits(device, rank, found, steps=8):
    """Muon beside AdamW in every overlap mode (default: the whole-matrix phase in the comm hooks), the
    backward and both steps under torch's sync debug mode "error" after DDP's rebuild, the event,
    stream and device waits counted from the first iteration: none (its skip and active flags stay on
    the device); every parameter within the Muon tolerance of torch.optim.Muon + AdamW."""
    from scenarios import VOCAB, Case, batch, muon_split, twin_models
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero

    for overlap in ("bucket", "backward", "step"):
        model, ref = twin_models(device)
        ddp, ref_ddp = (DDP(m, bucket_cap_mb=0.0001, device_ids=_ids(device)) for m in (model, ref))
        opts = [getattr(fused_zero, kind)(groups, ddp=ddp, overlap=overlap)
                for kind, groups in reversed(muon_split(model, Case(opt="Muon")))]  # AdamW first: member 0
        ref_opts = [getattr(torch.optim, kind)(groups, **({} if kind == "Muon" else {"foreach": False}))
                    for kind, groups in reversed(muon_split(ref, Case(opt="Muon")))]
        waits = _HostWaits()
        for step in range(1, steps + 1):
            x, y = (t.to(device) for t in batch(step, 0, rank))
            F.cross_entropy(ref_ddp(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1)).backward()
            for o in ref_opts:
                o.step()
                o.zero_grad()
            waits.__enter__()
            if step > 3:
                torch.cuda.set_sync_debug_mode("error")
            try:
                F.cross_entropy(ddp(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1)).backward()
                for o in opts:
                    o.step()
                for o in opts:
                    o.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode(0)
                waits.__exit__()
            opts[0].synchronize()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                measure("several", f"muon {overlap} step {step} {name}", p, q)
                torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-3, atol=5e-4,
                                           msg=lambda m, n=f"muon {overlap} step {step} {name}": f"{n}: {m}")
        if any(waits.counts.values()):
            found.append(f"Muon + AdamW overlap={overlap}: host waits over {steps} iterations: {waits.counts}")
        opts[0]._engine.close()


def _scaler_two_optimizers(device, rank, overlap, reduce, recipe, steps=6):
    """One GradScaler over fused_zero.AdamW (emb, l1, norm) and fused_zero.SGD (the rest), torch's recipe
    (``unscale_`` of those in ``recipe``, a clip of the first's unscaled gradients when it is unscaled,
    ``scaler.step`` of each, one ``update``); an inf in l1.weight's gradient at step 3: the first skips,
    the second steps, the scale halves, as with torch.optim. Returns each optimizer's skipped steps."""
    from scenarios import VOCAB, batch, twin_models
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero

    model, ref = twin_models(device)
    ddp, ref_ddp = (DDP(m, bucket_cap_mb=0.0001, device_ids=_ids(device), gradient_as_bucket_view=True)
                    for m in (model, ref))
    scalers = [torch.amp.GradScaler(device.type, init_scale=2.0 ** 10) for _ in range(2)]
    mine, rest = _split(model)
    opts = [fused_zero.AdamW(mine, lr=1e-2, weight_decay=0.1, ddp=ddp, overlap=overlap, grad_reduce=reduce,
                             grad_scaler=scalers[0]),
            fused_zero.SGD(rest, lr=5e-2, momentum=0.9, ddp=ddp, overlap=overlap, grad_reduce=reduce,
                           grad_scaler=scalers[0])]
    ref_mine, ref_rest = _split(ref)
    refs = [torch.optim.AdamW(ref_mine, lr=1e-2, weight_decay=0.1, foreach=False),
            torch.optim.SGD(ref_rest, lr=5e-2, momentum=0.9, foreach=False)]
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in batch(step, 0, rank))
        for d, os_, scaler in ((ref_ddp, refs, scalers[1]), (ddp, opts, scalers[0])):
            loss = F.cross_entropy(d(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1))
            handle = d.module.l1.weight.register_hook(lambda g: g * float("inf")) if step == 3 else None
            scaler.scale(loss).backward()
            if handle is not None:
                handle.remove()
            for i in recipe:
                scaler.unscale_(os_[i])
                if i == 0:
                    torch.nn.utils.clip_grad_norm_([p for g in os_[0].param_groups for p in g["params"]], 0.5)
            for o in os_:
                scaler.step(o)
            scaler.update()
            for o in os_:
                o.zero_grad()
        opts[0].synchronize()
        what = f"scaler {overlap}/{reduce} unscale {recipe} step {step}"
        assert scalers[0].get_scale() == scalers[1].get_scale(), f"{what}: scale {scalers[0].get_scale()}"
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            measure("several", f"{what} {name}", p, q)
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=f"{what} {name}": f"{n}: {m}")
    skipped = [o.skipped_steps for o in opts]
    opts[0]._engine.close()
    return skipped


def _pinned_bytes(engine) -> int:
    staging = engine.side._staging
    return sum(buf.numel() * buf.element_size() for ring in staging.rings.values() for buf, _ in ring)


def _captured_onecycle(device, rank, steps=30):
    """Two capturable optimizers over one module (AdamW, Adam), each under OneCycleLR with its default
    ``cycle_momentum`` (beta1 changes every step): each step replayed from its own graph, every parameter
    bit for bit with the same pair stepping eagerly, and the pinned staging memory the same at the last
    step as at step 10. Returns (captures, replays, pinned bytes at step 10, at the end)."""
    from scenarios import VOCAB, batch, twin_models
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero

    model, twin = twin_models(device)
    pairs = []
    for m, capturable in ((model, True), (twin, False)):
        d = DDP(m, bucket_cap_mb=0.0001, device_ids=_ids(device))
        first, rest = _split(m)
        os_ = [fused_zero.AdamW(first, lr=1e-2, ddp=d, overlap="step", max_grad_norm=0.5, capturable=capturable),
               fused_zero.Adam(rest, lr=2e-2, ddp=d, overlap="step", max_grad_norm=0.5, capturable=capturable)]
        scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=steps + 1) for o in os_]
        pairs.append((d, os_, scheds))
    pinned = []
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in batch(step, 0, rank))
        for d, os_, scheds in pairs:
            F.cross_entropy(d(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1)).backward()
            for o in os_:
                o.step()
            for o in os_:
                o.zero_grad()
            for s in scheds:
                s.step()
        pairs[0][1][0].synchronize()
        pairs[1][1][0].synchronize()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), f"OneCycleLR step {step} {name}: the replayed step differs from the eager one"
        if step in (10, steps):
            pinned.append(_pinned_bytes(pairs[0][1][0]._engine))
    graph = pairs[0][1][0]._engine.graph
    out = (graph.captures, graph.replays, *pinned)
    for _, os_, _ in pairs:
        os_[0]._engine.close()
    return out


def _several(rank, world):
    device = torch.device("cuda", 0) if DEVICE == "cuda" else torch.device(DEVICE)
    found = []
    _muon_without_host_waits(device, rank, found)
    for overlap, reduce, recipe in (("step", "all_reduce", (0,)), ("step", "all_reduce", (0, 1)),
                                    ("backward", "reduce_scatter", ()), ("step", "reduce_scatter", ())):
        skipped = _scaler_two_optimizers(device, rank, overlap, reduce, recipe)
        if skipped != [1, 0]:
            found.append(f"scaler {overlap}/{reduce} unscale {recipe}: skipped steps {skipped}, expected [1, 0]")
    captures, replays, pinned10, pinned_end = _captured_onecycle(device, rank)
    print(f"OneCycleLR capturable: captures {captures}, replays {replays}, pinned bytes {pinned10} at step 10, "
          f"{pinned_end} at step 30")
    if replays < 2 * (30 - 6) or pinned_end != pinned10:
        found.append(f"OneCycleLR capturable: {captures} captures, {replays} replays of 2 x 30 steps, "
                     f"pinned bytes {pinned10} at step 10 and {pinned_end} at step 30")
    if found:
        raise AssertionError("\n".join(found))


def case_several_optimizers():
    from fused_zero.demo.spawn import run_ranks

    run_ranks(_several, 1, backend="nccl", timeout=300)


DEVICE_COUNTS = {"Adagrad": {"fused": True}, "Adafactor": {}}
"""torch.optim's form whose step counts stay on the device, as the twins' CUDA path keeps them
(algorithms/elementwise.py): ``capturable=True`` but for these (Adagrad has only a fused path; Adafactor has
neither, and its device path rounds two scalars otherwise: algorithms/adafactor.py)."""


def _torch_optimizers(rank, world, steps=6):
    """Each torch.optim twin (optimizer/twins.py) and Adafactor against torch.optim.<Name> in the form
    whose counts stay on the device (``DEVICE_COUNTS``: the twins' CUDA path runs torch's own function that
    way, over the slice views), in the bucket and step overlaps: within a few fp32 ulps (every difference
    measured, to see whether the pieces give the whole tensors' bits); a skipped or doubled step moves a
    weight by about lr. From step 3 on (DDP's bucket rebuild done) under torch's sync debug mode "error":
    no host synchronization on the step path. Then Adagrad with ``fused=True`` (torch's fused kernel
    takes device counts: before, the host's, read as device pointers), and RMSprop stepping eagerly beside
    an AdamW whose step replays from a CUDA graph (before: the twin's host reads inside AdamW's capture).
    Prints each one's state bytes against torch's."""
    from scenarios import DEFAULT_HPARAMS

    from fused_zero.optimizer import TWINS

    device = torch.device("cuda", 0)
    runs = [(name, overlap, {}) for name in (*TWINS, "Adafactor") for overlap in ("bucket", "step")]
    runs.append(("Adagrad", "step", {"fused": True}))
    for name, overlap, extra in runs:
        hp = {**DEFAULT_HPARAMS[name], **extra}
        oracle = {**DEVICE_COUNTS.get(name, {"capturable": True}), **extra}
        opt = _twin_run(device, rank, name, overlap, hp, oracle, steps, f"{name}{extra or ''} {overlap}")
        print(f"{name}{extra or ''} {overlap}: state bytes {opt.memory()['state']} (torch.optim: "
              f"{opt.memory()['reference_state']})")
        opt._engine.close()
    _twin_beside_captured(device, rank, steps=10)


def _twin_run(device, rank, name, overlap, hp, oracle, steps, what):
    from scenarios import VOCAB, batch, twin_models
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero

    model, ref = twin_models(device)
    ddp, ref_ddp = (DDP(m, bucket_cap_mb=0.0001, device_ids=[0]) for m in (model, ref))
    opt = getattr(fused_zero, name)(ddp.parameters(), ddp=ddp, overlap=overlap, **hp)
    ref_opt = getattr(torch.optim, name)(ref_ddp.parameters(), **{**hp, **oracle})
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in batch(step, 0, rank))
        for d, o in ((ref_ddp, ref_opt), (ddp, opt)):
            if o is opt and step >= 3:
                torch.cuda.set_sync_debug_mode("error")
            try:
                F.cross_entropy(d(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1)).backward()
                o.step()
                o.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        opt.synchronize()
        for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
            measure("torch-optimizers", f"{what} step {step} {pname}", p, q)
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=f"{what} step {step} {pname}": f"{n}: {m}")
    return opt


def _twin_beside_captured(device, rank, steps):
    """RMSprop (eager) over the hidden matrices beside an AdamW with ``capturable=True`` over the rest, in
    overlap="step": AdamW's step captured and replayed, RMSprop's eager, against the same pair eager."""
    from scenarios import VOCAB, batch, twin_models
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero

    model, twin = twin_models(device)
    pairs = []
    for m, capturable in ((model, True), (twin, False)):
        d = DDP(m, bucket_cap_mb=0.0001, device_ids=[0])
        mats = [p for n, p in m.named_parameters() if n in ("l1.weight", "l2.weight", "branch.weight")]
        rest = [p for n, p in m.named_parameters() if p.requires_grad and all(p is not q for q in mats)]
        pairs.append((m, d, [fused_zero.AdamW(rest, lr=1e-2, ddp=d, overlap="step", capturable=capturable),
                             fused_zero.RMSprop(mats, lr=1e-3, momentum=0.9, ddp=d, overlap="step")]))
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in batch(step, 0, rank))
        for _, d, opts in pairs:
            F.cross_entropy(d(x, use_branch=True).reshape(-1, VOCAB), y.reshape(-1)).backward()
            for o in opts:
                o.step()
                o.zero_grad()
        for _, _, opts in pairs:
            opts[0].synchronize()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p, q), f"RMSprop beside a captured AdamW, step {step} {name}: not the eager pair's"
    graph = pairs[0][2][0]._engine.graph
    print(f"RMSprop beside a captured AdamW: {graph.captures} captures, {graph.replays} replays of {steps} steps")
    assert graph.replays >= steps - 6, (graph.captures, graph.replays)
    for _, _, opts in pairs:
        opts[0]._engine.close()


def case_torch_optimizers():
    from fused_zero.demo.spawn import run_ranks

    run_ranks(_torch_optimizers, 1, backend="nccl", timeout=300)


def _late_lr_on_rank_zero(rank, world, overlap):
    """A scheduler stepped under ``if rank == 0`` between the backward and ``step()`` at step 3, in a mode
    whose update ran in the backward: rank 0 refuses in its step 3; rank 1, which learns it from the
    flags all-reduced on the relay stream (pipeline/step_end/refusals.py), raises RefusedOnAnotherRank by its
    step 4 instead of waiting for rank 0 in a collective. Returns where this rank raised."""
    from scenarios import VOCAB, OddNet, batch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fused_zero

    dev = torch.device("cuda", 0)
    reason = _gloo_cuda_probe(world)
    if reason:
        return reason
    torch.manual_seed(0)
    model = OddNet().to(dev)
    model.never.requires_grad_(False)
    ddp = DDP(model, bucket_cap_mb=0.0001, device_ids=[0])
    opt = fused_zero.AdamW(ddp.parameters(), lr=1e-2, ddp=ddp, overlap=overlap)
    raised = None
    try:
        for step in range(1, 7):
            x, y = (t.to(dev) for t in batch(step, 0, rank))
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
        raised = (step, where, type(e).__name__, str(e)[:200])
    return raised


def case_refusal_on_every_rank():
    """Two gloo ranks sharing one GPU (CUDA tensors: the engine's CUDA path), one run per mode."""
    from fused_zero.demo.spawn import run_ranks

    for overlap in ("bucket", "backward"):
        outs = run_ranks(_late_lr_on_rank_zero, 2, overlap, backend="gloo", timeout=200, collective_timeout=60)
        if any(isinstance(o, str) and o.startswith("skip") for o in outs):
            raise Skip(outs[0])
        print(f"overlap={overlap}: where each rank raised: {outs}")
        assert outs[0] is not None and outs[0][:3] == (3, "step", "RuntimeError"), (overlap, outs)
        assert outs[1] is not None and outs[1][0] in (3, 4) and outs[1][2] == "RefusedOnAnotherRank", (overlap, outs)


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main(name: str) -> int:
    if not torch.cuda.is_available():
        print("skip: CUDA is not available")
        return SKIP
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 would run the kernels in the interpreter, not on the GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    try:
        CASES[name]()
    except Skip as e:
        print(f"skip: {e}")
        return SKIP
    print(f"{name}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
