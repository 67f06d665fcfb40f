"""How far torch.optim's own implementations (single-tensor, foreach, fused) are from each other on the GPU,
in the two cases whose tolerance the first H200 run exceeded (bench/results/2026-12-04-h200-gpu-check):
Adam with amsgrad on bf16-rounded inputs over 100 steps (tests/gpu ``_kernel_run``), and AdamW over a bf16
OddNet with fp32 masters (``_engine_parity``). A tolerance no tighter than torch's own fused-vs-single
distance is the one those cases can hold.

    python3 bench/gpu_tolerance.py --out OUT           # on a GPU (bench/gpu_check.sh's tests set, first)
    TOLDEV=cpu python3 bench/gpu_tolerance.py --out OUT   # the same on the CPU

Writes OUT/tolerances.json, which those two cases read (``GPU_TOLERANCES``, tests/gpu/gpu_cases.py
``measured_tolerance``): per case, the atol torch's fused result needs against its single-tensor one
at the case's rtol (the kernel case: relative to each tensor's scale, over the weights and every
state; the engine case: absolute, over every parameter and step), and foreach's beside it. The case
then uses max(today's atol, ``TOLERANCE_FACTOR`` x the fused distance). Also OUT/tol.jsonl (every
comparison); ``--ours`` also runs fused_zero's kernel case (OUT/ours.jsonl), which gpu-kernels runs anyway.
``OUT=dir`` in the environment is the old way to name OUT."""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "gpu")]

from gpu_cases import (  # noqa: E402  (tests/gpu: the cases' own sizes, tolerances and factor)
    ENGINE_BF16_ATOL,
    ENGINE_BF16_RTOL,
    KERNEL_ATOL,
    KERNEL_RTOL,
    SIZES,
    STEPS,
    TOLERANCE_FACTOR,
)

rows = []
IMPLS = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def needed_atol(a: torch.Tensor, b: torch.Tensor, rtol: float) -> float:
    """The smallest atol for which |a - b| <= atol + rtol |b| holds everywhere."""
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    return max(float(((a - b).abs() - rtol * b.abs()).max()), 0.0) if a.numel() else 0.0


def dist(a, b):
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    scale = float(b.abs().max()) or 1.0
    d = (a - b).abs()
    tol = KERNEL_RTOL * b.abs() + KERNEL_ATOL * scale  # the kernel case's tolerance
    return dict(max_abs=float(d.max()), max_rel_scale=float(d.max()) / scale, differing=int((d != 0).sum()),
                over_kernel_tol=int((d > tol).sum()), n=d.numel(),
                needed_atol_rel_scale=needed_atol(a, b, KERNEL_RTOL) / scale)


def device() -> torch.device:
    return torch.device(os.environ.get("TOLDEV", "cuda"))


def kernel_case() -> dict:
    """torch.optim.Adam(amsgrad=True, weight_decay=0.1) single, foreach and fused side by side, 100 steps on
    bf16-rounded parameters and gradients cut into the kernel case's ragged sizes: each one's distance
    from single over the weights and every state, as the atol relative to the tensor's scale it needs."""
    dev = device()
    torch.manual_seed(0)
    total = sum(SIZES)
    p0 = (torch.randn(total, device=dev) * 0.5).to(torch.bfloat16).float()
    params = {k: [t.clone().requires_grad_(True) for t in p0.split(SIZES)] for k in IMPLS}
    opts = {k: torch.optim.Adam(params[k], lr=1e-2, weight_decay=0.1, amsgrad=True, **kw) for k, kw in IMPLS.items()}
    for step in range(1, STEPS + 1):
        lr = 1e-2 * (1 + 0.5 * math.cos(step))
        g = torch.randn(total, device=dev).to(torch.bfloat16).float()
        for k in IMPLS:
            for p, gg in zip(params[k], g.split(SIZES)):
                p.grad = gg.clone()
            for grp in opts[k].param_groups:
                grp["lr"] = lr
            opts[k].step()
    if dev.type == "cuda":
        torch.cuda.synchronize()

    def flat(k, what):
        if what == "weights":
            return torch.cat([p.detach() for p in params[k]])
        return torch.cat([opts[k].state[p][what].reshape(-1) for p in params[k]])

    out = {}
    for k in ("foreach", "fused"):
        worst = 0.0
        for what in ("weights", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            d = dist(flat(k, what), flat("single", what))
            worst = max(worst, d["needed_atol_rel_scale"])
            rows.append(dict(case=f"kernel Adam amsgrad bf16-rounded inputs, {STEPS} steps: {what}",
                             vs=f"torch {k} vs single", **d))
        out[f"torch_{k}_vs_single"] = worst
    return out


def engine_case(steps=20) -> dict:
    """AdamW over three bf16 OddNets with fp32 masters (single, foreach, fused), the engine case's
    training: each one's largest atol needed against single at rtol 2^-7, over every parameter and step."""
    from scenarios import VOCAB, batch, twin_models

    dev = device()
    models, masters, opts = {}, {}, {}
    for k, kw in IMPLS.items():
        m, _ = twin_models(dev, torch.bfloat16)
        models[k] = m
        ps = [p for p in m.parameters() if p.requires_grad]
        masters[k] = [p.detach().float().requires_grad_(True) for p in ps]
        opts[k] = torch.optim.AdamW(masters[k], lr=1e-2, weight_decay=0.1, **kw)
    worst = {"foreach": 0.0, "fused": 0.0}
    for step in range(1, steps + 1):
        x, y = (t.to(dev) for t in batch(step, 0, 0))
        for k in IMPLS:
            m = models[k]
            F.cross_entropy(m(x, use_branch=True).float().reshape(-1, VOCAB), y.reshape(-1)).backward()
            ps = [p for p in m.parameters() if p.requires_grad]
            for p, mm in zip(ps, masters[k]):
                mm.grad = None if p.grad is None else p.grad.float()
            opts[k].step()
            opts[k].zero_grad()
            with torch.no_grad():
                for p, mm in zip(ps, masters[k]):
                    p.copy_(mm)
                    p.grad = None
        for k in ("foreach", "fused"):
            for (name, p), q in zip(models[k].named_parameters(), models["single"].parameters()):
                a, b = p.detach().float(), q.detach().float()
                d = (a - b).abs()
                need = needed_atol(a, b, ENGINE_BF16_RTOL)
                worst[k] = max(worst[k], need)
                bad = int((d > ENGINE_BF16_RTOL * b.abs() + ENGINE_BF16_ATOL).sum())
                rows.append(dict(case=f"engine bf16 AdamW step {step} {name}", vs=f"torch {k} vs single",
                                 max_abs=float(d.max()), max_rel_scale=float(d.max()) / (float(b.abs().max()) or 1),
                                 over_engine_tol=bad, n=d.numel(), needed_atol=need))
    return {f"torch_{k}_vs_single": v for k, v in worst.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where tolerances.json and tol.jsonl go")
    p.add_argument("--ours", action="store_true", help="also fused_zero's kernel case (OUT/ours.jsonl)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cases = {
        "kernel_adam_amsgrad_bf16": dict(
            kernel_case(), quantity=f"atol relative to each tensor's scale at rtol {KERNEL_RTOL}, over the weights "
                                    "and every state after 100 steps", today=KERNEL_ATOL),
        "engine_bf16": dict(
            engine_case(), quantity=f"atol at rtol 2^-7 ({ENGINE_BF16_RTOL}), over every parameter and step",
            today=ENGINE_BF16_ATOL),
    }
    for case in cases.values():
        case["tolerance"] = max(case["today"], TOLERANCE_FACTOR * case["torch_fused_vs_single"])
    dev = device()
    summary = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__,
                   factor=TOLERANCE_FACTOR, rule="max(today, factor x torch fused vs single)", cases=cases)
    with open(os.path.join(args.out, "tol.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(args.out, "tolerances.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for name, case in cases.items():
        print(f"{name}: torch fused vs single {case['torch_fused_vs_single']:.3g}, foreach vs single "
              f"{case['torch_foreach_vs_single']:.3g} ({case['quantity']}); today {case['today']:.3g} -> "
              f"{case['tolerance']:.3g}")
    if args.ours:
        os.environ["GPU_MEASURE"] = os.path.join(args.out, "ours.jsonl")
        import gpu_cases

        try:
            gpu_cases._kernel_run("Adam", torch.bfloat16)
            print("fused_zero kernel Adam bf16: within the tolerance")
        except AssertionError as e:
            print("fused_zero kernel Adam bf16:", str(e).splitlines()[0])


if __name__ == "__main__":
    main()
