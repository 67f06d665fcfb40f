"""Turn pytest-benchmark JSON files from bench/ into a markdown report with plots.

    python bench/report.py RESULTS.json [MORE.json ...] --out DIR

writes ``DIR/report.md`` and PNGs next to it (matplotlib, Agg backend):

    kernels_gbps.png     update-kernel GB/s against the slice size, per provider, with the copy rooflines
                         of the same run (test_bench_kernels.py)
    e2e_iteration.png    iteration time per system, split into forward / backward / opt.step / zero_grad
    step_iteration.png   the same for every model of the step benchmark
    host_overhead.png    µs per bucket inside fused_zero's comm hook
    (no plot)            the "Against the floor" table (test_bench_floor.py): iteration ratios to
                         ZeroRedundancyOptimizer and to the floor, from the same run
    scaling.png          per-rank iteration time and optimizer state against the world size

Sections whose benchmarks are absent are left out, so a kernel-only or a step-only JSON works. Every
comparison (% of copy, hidden share, state against torch) uses baselines from the same file: numbers
from different files are listed, never divided by each other.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict

STEP_KINDS = ("step", "e2e", "host", "scaling")
SYSTEM_ORDER = ["ddp+torch-adamw", "ddp+zero", "fused_zero-bucket", "fused_zero-backward", "fused_zero-step"]
PHASES = [("fwd_ms", "forward"), ("bwd_ms", "backward"), ("step_ms", "opt.step"),
          ("zero_grad_ms", "zero_grad")]


# ------------------------------------------------------------------ loading

def load(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """(sources, benchmarks): one source per file; every benchmark tagged with its source index."""
    sources, benches = [], []
    for i, path in enumerate(paths):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        sources.append({"path": path, "machine": data.get("machine_info", {}),
                        "datetime": data.get("datetime"), "commit": data.get("commit_info", {}),
                        "version": data.get("version")})
        for b in data.get("benchmarks", []):
            b = dict(b)
            b["source"] = i
            benches.append(b)
    return sources, benches


def kind_of(b: dict) -> str:
    info = b.get("extra_info", {})
    if info.get("bench") in STEP_KINDS + ("floor",):
        return info["bench"]
    if "provider" in info and "size" in info and "bytes" in info:
        return "kernel"
    if info.get("provider") == "adam_coefficients":
        return "coefficients"
    return "other"


# ------------------------------------------------------------------ formatting

def fmt(v, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int,)) and not isinstance(v, bool):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if v == 0:
            return "0"
        mag = abs(v)
        if mag >= 100:
            return f"{v:,.0f}"
        if mag >= 10:
            return f"{v:.1f}"
        return f"{v:.{digits - 1}f}" if mag >= 1 else f"{v:.{digits}g}"
    return str(v)


def size_label(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):g}M"
    if n >= 1 << 10:
        return f"{n / (1 << 10):g}K"
    return str(n)


def mib(n) -> str:
    return "-" if n is None else f"{n / (1 << 20):.3f} MiB"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in r) + " |")
    return "\n".join(lines)


def system_key(name: str) -> int:
    return SYSTEM_ORDER.index(name) if name in SYSTEM_ORDER else len(SYSTEM_ORDER)


def suffix(src: int, benches: list[dict]) -> str:
    """File-name suffix of a plot of source ``src``: none for the first source holding such benchmarks."""
    return "" if src == min(b["source"] for b in benches) else f"_{src}"


def gbps(b: dict) -> float:
    info = b["extra_info"]
    return info.get("GB/s") or info["bytes"] / b["stats"]["median"] / 1e9


def ms(b: dict, stat: str = "median") -> float:
    return b["stats"][stat] * 1e3


# ------------------------------------------------------------------ floor

def floor_section(benches: list[dict], outdir: str, plots: list[str]) -> str:
    """test_bench_floor.py: every system's median iteration and its ratios to ZeroRedundancyOptimizer
    and to the floor, as computed in the ranks from the same run."""
    mine = [b for b in benches if kind_of(b) == "floor"]
    if not mine:
        return ""
    out = ["## Against the floor (test_bench_floor)", ""]
    for src in sorted({b["source"] for b in mine}):
        run = [b for b in mine if b["source"] == src]
        e = run[0]["extra_info"]
        out.append(f"{e['model']} ({e['params']:,} parameters), world {e['world']} ({e['backend']}), batch "
                   f"{e['batch_per_rank']} per rank, bucket_cap_mb {e['bucket_cap_mb']}, {e['warmup']} warm-up + "
                   f"{e['iters']} measured iterations in {e['rounds']} rounds, {e['device']}; load average "
                   f"{e['load_before'][0]:.2f} before, {e['load_after'][0]:.2f} after (1 min; after includes the "
                   f"benchmark's own {e['world']} ranks).")
        out.append("")
        rows = [[f"`{b['extra_info']['system']}`", b["extra_info"]["iter_ms_median"],
                 b["extra_info"]["fwd_ms_median"], b["extra_info"]["bwd_ms_median"],
                 b["extra_info"]["step_ms_median"], mib(b["extra_info"]["state_bytes"]),
                 b["extra_info"]["vs_zero"], b["extra_info"]["vs_zero_fused"], b["extra_info"]["vs_floor"],
                 b["extra_info"]["optimizer_impl"]] for b in run]
        out.append(table(["system", "iteration ms", "fwd ms", "bwd ms", "opt.step ms", "state/rank",
                          "/ ddp+zero", "/ ddp+zero-fused", "/ floor", "implementation"], rows))
        out.append("")
    return "\n".join(out)


# ------------------------------------------------------------------ header

def header(sources: list[dict], benches: list[dict]) -> str:
    lines = ["# fused_zero benchmark report", ""]
    for i, s in enumerate(sources):
        m = s["machine"]
        cpu = m.get("cpu", {}) or {}
        mine = [b for b in benches if b["source"] == i]
        devices = sorted({b.get("extra_info", {}).get("device") for b in mine} - {None, "host"})
        torch_v = m.get("torch_version") or next(
            (b["extra_info"]["torch"] for b in mine if "torch" in b.get("extra_info", {})), "not recorded")
        commit = s["commit"] or {}
        lines += [
            f"**{os.path.basename(s['path'])}**",
            "",
            f"- machine: {cpu.get('brand_raw') or m.get('processor') or m.get('machine', '?')}"
            f" ({cpu.get('count', m.get('cpu_count', '?'))} logical CPUs), node `{m.get('node', '?')}`,"
            f" {m.get('system', '')} {m.get('release', '')}",
            f"- date: {s['datetime'] or '?'}",
            f"- torch {torch_v}" + (f", triton {m['triton_version']}" if m.get("triton_version") else "")
            + f", Python {m.get('python_version', '?')}, pytest-benchmark {s.get('version') or '?'}",
            f"- device: {', '.join(devices) if devices else '?'}"
            + (f" ({m['cuda_device_count']} GPUs)" if m.get("cuda_device_count") else ""),
        ]
        if commit.get("id"):
            lines.append(f"- commit: {commit['id'][:12]}{' (dirty)' if commit.get('dirty') else ''}")
        lines.append("")
    lines += [
        "Every baseline (the copy roofline, torch.optim, ZeroRedundancyOptimizer, plain DDP) was measured in "
        "the same run as the numbers compared with it; numbers from different files are not divided by "
        "each other. Times are medians unless a column says mean.",
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------ kernels

def kernel_section(benches: list[dict], outdir: str, plots: list[str]) -> str:
    ks = [b for b in benches if kind_of(b) == "kernel"]
    coef = [b for b in benches if kind_of(b) == "coefficients"]
    if not ks and not coef:
        return ""
    out = ["## Update kernels (bench/test_bench_kernels.py)", ""]
    if ks:
        out += [
            "GB/s = the bytes an ideal single pass moves per step (Adam/AdamW 28, SGD 20 per element) / "
            "median step time. % of copy: against `copy-<bytes per element>B` of the same size, same run. "
            "On CPU the fused_zero providers run through the Triton interpreter (see `triton_interpret`): a "
            "check that the benchmarks run, not a performance number.",
            "",
        ]
        for src in sorted({b["source"] for b in ks}):
            mine = [b for b in ks if b["source"] == src]
            sizes = sorted({b["extra_info"]["size"] for b in mine})
            by = {(b["extra_info"]["provider"], b["extra_info"]["size"]): b for b in mine}
            providers = list(dict.fromkeys(b["extra_info"]["provider"] for b in mine))
            rows = []
            for p in providers:
                row = [f"`{p}`"]
                for n in sizes:
                    b = by.get((p, n))
                    if b is None:
                        row.append("-")
                        continue
                    rate = gbps(b)
                    copy = by.get((f"copy-{b['extra_info']['bytes'] // n}B", n))
                    if copy is not None and not p.startswith("copy"):
                        cg = gbps(copy)
                        row.append(f"{fmt(rate)} ({fmt(100 * rate / cg, 2)}% of {fmt(cg)})")
                    else:
                        row.append(fmt(rate))
                interp = any(by[(p, n)]["extra_info"].get("triton_interpret") for n in sizes if (p, n) in by)
                row.append("yes" if interp else "")
                rows.append(row)
            if len({b["source"] for b in ks}) > 1:
                out.append(f"Source {src}:")
            out += [table(["provider"] + [f"{size_label(n)} GB/s (% of copy GB/s)" for n in sizes]
                          + ["interpreter"], rows), ""]
            time_rows = [[f"`{p}`"] + [fmt(by[(p, n)]["stats"]["median"] * 1e6) if (p, n) in by else "-"
                                       for n in sizes] for p in providers]
            out += ["Median step time (µs):", "",
                    table(["provider"] + [size_label(n) for n in sizes], time_rows), ""]
            plots.append(plot_kernels(mine, providers, sizes, outdir, suffix(src, ks)))
            out += [f"![GB/s against size]({os.path.basename(plots[-1])})", ""]
    if coef:
        rows = [[b["extra_info"].get("n_params"), b["stats"]["median"] * 1e6, b["stats"]["mean"] * 1e6]
                for b in coef]
        out += ["Host cost of a new Adam coefficient table:", "",
                table(["parameters", "median µs", "mean µs"], rows), ""]
    return "\n".join(out)


def plot_kernels(mine, providers, sizes, outdir, suffix) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    palette = plt.get_cmap("tab10")
    others = [p for p in providers if not p.startswith("copy")]
    for p in providers:
        pts = sorted((b["extra_info"]["size"], gbps(b)) for b in mine if b["extra_info"]["provider"] == p)
        xs, ys = zip(*pts)
        style = dict(color="black", linestyle="--", linewidth=2, marker="s") if p.startswith("copy") else \
            dict(marker="o", color=palette(others.index(p) % 10),
                 linestyle=":" if "torch" in p else "-")
        if p == "copy-20B":
            style.update(color="gray")
        ax.plot(xs, ys, label=p + (" (roofline)" if p.startswith("copy") else ""), **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [size_label(n) for n in sizes])
    if len(sizes) == 1:
        ax.set_xlim(sizes[0] / 2, sizes[0] * 2)
    ax.set_xlabel("elements per step")
    ax.set_ylabel("GB/s (ideal bytes / median time, log)")
    device = mine[0]["extra_info"].get("device", "")
    ax.set_title(f"Update throughput against the copy roofline - {device}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = os.path.join(outdir, f"kernels_gbps{suffix}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------ step benchmarks

def system_rows(entries: dict[str, dict], step_stats: dict[str, dict] | None = None) -> list[list]:
    """One row per system: entries maps system -> benchmark whose stats are iteration times."""
    rows = []
    plain = entries.get("ddp+torch-adamw")
    plain_state = plain["extra_info"]["state_bytes"] if plain else None
    for system in sorted(entries, key=system_key):
        b = entries[system]
        e = b["extra_info"]
        step_med = (step_stats[system]["stats"]["median"] * 1e3 if step_stats and system in step_stats
                    else e.get("step_ms_median"))
        state = e["state_bytes"]
        rows.append([
            f"`{system}`", ms(b), ms(b, "mean"), e["fwd_ms"], e["bwd_ms"], step_med,
            mib(state) + (f" ({100 * state / plain_state:.0f}%)" if plain_state else ""),
            mib(max(e.get("state_bytes_ranks") or [state])),
            e.get("hidden_share"), e.get("iter_minus_plain_ms"),
        ])
    return rows


SYSTEM_HEADER = ["system", "iteration ms", "mean ms", "fwd ms (mean)", "bwd ms (mean)", "opt.step ms",
                 "state/rank (rank 0, % of torch)", "state max rank", "hidden share", "vs plain DDP ms"]


def describe(e: dict) -> str:
    return (f"{e['model']} ({e['params']:,} parameters), world {e['world']} ({e['backend']}), batch "
            f"{e['batch_per_rank']} x {e['block']} tokens per rank, bucket_cap_mb {e['bucket_cap_mb']}, "
            f"{e['warmup']} warm-up + {e['iters']} measured iterations in {e.get('rounds', 1)} rounds, "
            f"{e['device']}")


STEP_NOTES = (
    "Iteration = forward + backward + opt.step + zero_grad measured inside the ranks (rank 0). "
    "fused_zero's forward includes waiting for the previous step's all-gathers; in bucket and backward mode "
    "its updates run inside the backward (DDP's comm hook), so its opt.step column is near zero by design. "
    "ddp+zero on gloo is plain ZeroRedundancyOptimizer.step() (broadcasts included); with NCCL its overlap "
    "hook steps inside the backward. hidden share = clamp(1 - (t_iter_fused - t_fwd_bwd_plain) / "
    "t_step_plain, 0, 1) from medians of the same run (1: the whole step hidden behind the backward); "
    "'vs plain DDP' = fused_zero iteration - ddp+torch-adamw iteration. State: fused_zero "
    "opt.memory()['state'] (moments; runs before the in-place reduce-scatter add a gradient region), "
    "torch AdamW 8 B/parameter, ZeRO the local optimizer's state tensors."
)


def step_section(benches: list[dict], outdir: str, plots: list[str]) -> str:
    out = []
    e2e = [b for b in benches if kind_of(b) == "e2e"]
    step = [b for b in benches if kind_of(b) == "step"]
    if e2e:
        out += ["## End to end: the demo model (test_e2e)", "", STEP_NOTES, ""]
        for src in sorted({b["source"] for b in e2e}):
            entries = {b["extra_info"]["system"]: b for b in e2e if b["source"] == src}
            first = next(iter(entries.values()))["extra_info"]
            out += [describe(first) + ".", "", table(SYSTEM_HEADER, system_rows(entries)), ""]
            plots.append(plot_phases({"demo": entries}, os.path.join(
                outdir, f"e2e_iteration{suffix(src, e2e)}.png"),
                f"End to end, world {first['world']} - {first['device']}"))
            out += [f"![iteration time per system]({os.path.basename(plots[-1])})", ""]
    if step:
        out += ["## Step: every system on models of several sizes (test_step)", "",
                "As above; the opt.step column is the median of the `opt.step` measurement.", ""]
        for src in sorted({b["source"] for b in step}):
            mine = [b for b in step if b["source"] == src]
            models = list(dict.fromkeys(b["extra_info"]["model_label"] for b in mine))
            per_model = {}
            for label in models:
                of_model = [b for b in mine if b["extra_info"]["model_label"] == label]
                it = {b["extra_info"]["system"]: b for b in of_model
                      if b["extra_info"].get("measure") == "iteration"}
                st = {b["extra_info"]["system"]: b for b in of_model
                      if b["extra_info"].get("measure") == "opt.step"}
                if not it:
                    continue
                per_model[label] = it
                first = next(iter(it.values()))["extra_info"]
                out += [f"### {label}", "", describe(first) + ".", "",
                        table(SYSTEM_HEADER, system_rows(it, st)), ""]
            if per_model:
                first = next(iter(next(iter(per_model.values())).values()))["extra_info"]
                plots.append(plot_phases(per_model, os.path.join(
                    outdir, f"step_iteration{suffix(src, step)}.png"),
                    f"Iteration time per system, world {first['world']} - {first['device']}"))
                out += [f"![iteration time per system and model]({os.path.basename(plots[-1])})", ""]
    return "\n".join(out)


def plot_phases(per_model: dict[str, dict[str, dict]], path: str, title: str) -> str:
    """Stacked bars: mean forward / backward / opt.step / zero_grad per system, one panel per model."""
    import matplotlib.pyplot as plt

    n = len(per_model)
    fig, axes = plt.subplots(1, n, figsize=(max(6.5, 4.2 * n), 4.8), squeeze=False)
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    for ax, (label, entries) in zip(axes[0], per_model.items()):
        systems = sorted(entries, key=system_key)
        bottoms = [0.0] * len(systems)
        for (key, name), color in zip(PHASES, colors):
            vals = [entries[s]["extra_info"].get(key) or 0.0 for s in systems]
            ax.bar(range(len(systems)), vals, bottom=bottoms, color=color, label=name)
            bottoms = [a + b for a, b in zip(bottoms, vals)]
        for x, s in enumerate(systems):
            med = ms(entries[s])
            ax.plot([x - 0.4, x + 0.4], [med, med], color="black", linewidth=1)
            ax.text(x, bottoms[x] * 1.01, f"{med:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(systems)), [s.replace("fused_zero-", "fz-") for s in systems],
                      rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("ms per iteration (bars: phase means; line, label: median)")
        ax.set_title(f"{label} ({next(iter(entries.values()))['extra_info']['params']:,} params)", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def host_section(benches: list[dict], outdir: str, plots: list[str]) -> str:
    hs = [b for b in benches if kind_of(b) == "host"]
    if not hs:
        return ""
    out = ["## Host overhead of the orchestrator (test_host_overhead)", "",
           "Time inside `Engine.on_bucket` (DDP's comm hook) per call, nothing subtracted; launches = "
           "update calls per step. On CPU with backend torch, bucket mode runs the update (and waits for the "
           "previous bucket's reduction) inside on_bucket; step mode only starts the reduction there, so its "
           "µs/bucket is the orchestration alone and its updates are in opt.step.", ""]
    rows = []
    for b in sorted(hs, key=lambda b: (b["source"], b["extra_info"]["world"], b["extra_info"]["overlap"])):
        e = b["extra_info"]
        rows.append([e["world"], e["overlap"], b["stats"]["median"] * 1e6, e["us_per_bucket"],
                     e["buckets_per_step"], e["launches_per_step"], e["update_us_per_launch"],
                     e["on_bucket_ms_per_step"], e["iter_ms_median"], e["params"], e["bucket_cap_mb"]])
    out += [table(["world", "overlap", "µs/bucket", "mean µs/bucket", "buckets/step", "launches/step",
                   "update µs/launch", "on_bucket ms/step", "iteration ms", "params", "bucket_cap_mb"],
                  rows), ""]
    out += [f"Device: {hs[0]['extra_info']['device']}.", ""]
    plots.append(plot_host(hs, outdir))
    out += [f"![host µs per bucket]({os.path.basename(plots[-1])})", ""]
    return "\n".join(out)


def plot_host(hs, outdir) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    hs = sorted(hs, key=lambda b: (b["source"], b["extra_info"]["world"], b["extra_info"]["overlap"]))
    labels = [f"w{b['extra_info']['world']} {b['extra_info']['overlap']}" for b in hs]
    vals = [b["stats"]["median"] * 1e6 for b in hs]
    upd = [b["extra_info"]["update_us_per_launch"] * b["extra_info"]["launches_per_step"]
           / max(b["extra_info"]["buckets_per_step"], 1) if b["extra_info"]["overlap"] == "bucket" else 0.0
           for b in hs]
    ax.bar(range(len(hs)), vals, color="#4c72b0", label="inside on_bucket (median)")
    ax.bar(range(len(hs)), upd, color="#dd8452", alpha=0.8, width=0.5,
           label="of which update calls (mean, bucket mode)")
    ax.set_xticks(range(len(hs)), labels)
    ax.set_ylabel("µs per bucket")
    ax.set_title(f"fused_zero comm-hook host time - {hs[0]['extra_info']['device']}", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(outdir, "host_overhead.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def scaling_section(benches: list[dict], outdir: str, plots: list[str]) -> str:
    sc = [b for b in benches if kind_of(b) == "scaling"]
    if not sc:
        return ""
    out = ["## Scaling with the world size (test_scaling)", "",
           "Weak scaling: the same batch per rank at every world size; rank 0's iteration time. "
           "Oversubscribed = more ranks than CPU cores (each rank 1 thread): contention, not scaling.", ""]
    rows = []
    order = list(dict.fromkeys(b["extra_info"]["model_label"] for b in sc))

    def key(b):
        e = b["extra_info"]
        return b["source"], order.index(e["model_label"]), e["world"], system_key(e["system"])

    by = {(b["source"], *(b["extra_info"][k] for k in ("model_label", "world", "system"))): b for b in sc}
    for b in sorted(sc, key=key):
        e = b["extra_info"]
        plain = by.get((b["source"], e["model_label"], e["world"], "ddp+torch-adamw"))
        rel = (f"{100 * e['state_bytes'] / plain['extra_info']['state_bytes']:.0f}%" if plain else "-")
        rows.append([e["model_label"], e["params"], e["world"], f"`{e['system']}`", ms(b), e["fwd_bwd_ms"],
                     e["step_ms_median"], mib(e["state_bytes"]), rel, e.get("hidden_share"),
                     "yes" if e.get("oversubscribed") else ""])
    out += [table(["model", "params", "world", "system", "iteration ms", "fwd+bwd ms (mean)", "opt.step ms",
                   "state/rank", "state % of torch", "hidden share", "oversubscribed"], rows), ""]
    plots.append(plot_scaling(sc, outdir))
    out += [f"![scaling]({os.path.basename(plots[-1])})", ""]
    return "\n".join(out)


def plot_scaling(sc, outdir) -> str:
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    series = defaultdict(list)
    for b in sc:
        e = b["extra_info"]
        series[(b["source"], e["model_label"], e["system"])].append(
            (e["world"], ms(b), e["state_bytes"] / (1 << 20), e.get("oversubscribed")))
    models = list(dict.fromkeys(k[1] for k in series))
    markers = "osD^v"
    several = len({k[0] for k in series}) > 1
    def order(kv):
        src, label, system = kv[0]
        return src, models.index(label), system_key(system)

    for (src, label, system), pts in sorted(series.items(), key=order):
        pts.sort()
        ws, t, mem, over = zip(*pts)
        style = dict(marker=markers[models.index(label) % len(markers)],
                     linestyle="-" if system.startswith("fused_zero") else "--",
                     color=f"C{models.index(label)}")
        name = f"{f'[{src}] ' if several else ''}{label} {system}"
        a1.plot(ws, t, label=name, **style)
        a2.plot(ws, mem, label=name, **style)
    worlds = sorted({b["extra_info"]["world"] for b in sc})
    over = sorted({b["extra_info"]["world"] for b in sc if b["extra_info"].get("oversubscribed")})
    if over:
        for ax in (a1, a2):
            ax.axvspan(over[0] / 1.25, max(worlds) * 1.25, color="red", alpha=0.06)
            ax.text(over[0], 0.98, " oversubscribed\n (ranks > cores)", transform=ax.get_xaxis_transform(),
                    fontsize=7, va="top", color="darkred")
    for ax, yl in ((a1, "ms per iteration (median, rank 0)"), (a2, "optimizer state MiB per rank")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(worlds, [str(w) for w in worlds])
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel(yl)
        ax.grid(True, alpha=0.3)
    a1.set_title("iteration time (dashed: ddp+torch-adamw, solid: fused_zero)", fontsize=9)
    a2.set_title("optimizer state per rank", fontsize=9)
    a2.legend(fontsize=6)
    fig.suptitle(f"Scaling - {sc[0]['extra_info']['device']}", fontsize=10)
    fig.tight_layout()
    path = os.path.join(outdir, "scaling.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="pytest-benchmark JSON files (--benchmark-json)")
    parser.add_argument("--out", required=True, help="directory for report.md and the PNGs")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    os.makedirs(args.out, exist_ok=True)
    sources, benches = load(args.results)
    if not benches:
        print("no benchmarks in " + ", ".join(args.results), file=sys.stderr)
        return 1
    plots: list[str] = []
    parts = [header(sources, benches)]
    for section in (step_section, floor_section, host_section, scaling_section, kernel_section):
        text = section(benches, args.out, plots)
        if text:
            parts.append(text)
    other = [b for b in benches if kind_of(b) == "other"]
    if other:
        parts.append("## Other benchmarks\n\n" + table(
            ["name", "group", "median µs"], [[b["name"], b.get("group") or "", b["stats"]["median"] * 1e6]
                                             for b in other]) + "\n")
    path = os.path.join(args.out, "report.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts).rstrip() + "\n")
    print(f"wrote {path}" + "".join(f"\nwrote {p}" for p in plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
