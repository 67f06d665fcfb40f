"""The README's and the docs pages' code blocks and links, read from the markdown, and one rank's run of
the python blocks (tests/test_readme_claims.py spawns the ranks once for all of them).

A block runs as a user would paste it into a script started by torchrun: the process group exists
(``init_process_group`` and ``destroy_process_group`` in a block are no-ops here, the spawn owns the
group), and the pages' stated context is given: ``model`` (a small fp32 MLP with a LayerNorm),
``loader`` (three ``(x, y)`` batches, this rank's own) and ``loss_fn``. ``LOCAL_WORLD_SIZE`` is 1, as
torchrun sets it with one rank per node."""

from __future__ import annotations

import contextlib
import io
import os
import re
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def page_name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def blocks(path: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of a page, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


def python_blocks() -> list[tuple[str, str]]:
    """(a name saying where the block is, code) of every python block of every page."""
    out = []
    for path in PAGES:
        for i, code in enumerate(code for lang, code in blocks(path) if lang == "python"):
            out.append((f"{page_name(path)}, python block {i + 1}", code))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor (outside code blocks); as on GitHub, a repeated one gets -1, -2, ..."""
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#+ (.+)$", text, re.M):
        name = slug(m.group(1))
        out.add(f"{name}-{seen[name]}" if name in seen else name)
        seen[name] = seen.get(name, 0) + 1
    return out


def broken_links(path: Path) -> list[str]:
    """Every relative link of the page (outside code blocks) whose file, or heading, does not exist."""
    out = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            out.append(f"{page_name(path)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{page_name(path)}: {target} (no heading #{anchor} in {dest.name})")
    return out


def _context() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8))
    g = torch.Generator().manual_seed(dist.get_rank())
    xs = [torch.randn(8, 16, generator=g, dtype=torch.float32, device="cpu") for _ in range(3)]
    return {"__name__": "__main__", "model": model, "loader": [(x, x[:, :8].argmax(dim=1)) for x in xs],
            "loss_fn": F.cross_entropy}


def run(rank: int, world: int, named_blocks: list[tuple[str, str]], workdir: str) -> list[tuple[str, str, list]]:
    """Each block's (name, "ok" or the traceback, the fused_zero.* profiler ranges its ``prof`` holds)."""
    os.chdir(workdir)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    real = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = dist.destroy_process_group = lambda *a, **k: None
    out = []
    try:
        for name, code in named_blocks:
            ns = _context()
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    exec(compile(code, name, "exec"), ns)
                outcome = "ok"
            except Exception:
                outcome = traceback.format_exc()
            prof = ns.get("prof")
            ranges = sorted({e.key for e in prof.key_averages() if e.key.startswith("fused_zero.")}) if prof else []
            out.append((name, outcome, ranges))
            dist.barrier()  # the next block starts together on every rank
    finally:
        dist.init_process_group, dist.destroy_process_group = real
    return out
