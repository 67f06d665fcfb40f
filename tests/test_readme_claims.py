"""Promises the README and the docs pages make that no other test holds: every relative link resolves,
to a file and to one of its headings (GitHub's anchors), every file named by its path exists, no docs
page is over 20,000 bytes, every python code block runs (or is named below with the test that runs it
elsewhere), the README's option table is the one fused_zero/options.py describes, the README fits its
size, the example runs as written, and the bound on the replicated tail (docs/shard-groups.md)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import doc_blocks
import pytest
import torch
from distributed import run_ranks

import fused_zero
from fused_zero.optimizer.twins import optimizer_table
from fused_zero.options import OPTIONS, ShardingOptions, option_table
from fused_zero.pipeline.buckets.layout import BucketLayout

ROOT = Path(__file__).resolve().parents[1]
README_LIMIT = 12288
DOCS_LIMIT = 20000
"""A docs page is about one task or one mechanism; docs/design.md and docs/performance.md list theirs."""

# python blocks not run by test_doc_blocks_run, each with the test that covers it; a key is (page, a
# string only that block of the page holds)
ELSEWHERE = {
    ("docs/integrations.md", "import lightning.pytorch as pl"):
        "examples/train_lightning.py (test_integration_blocks_are_the_examples): "
        "tests/integrations/test_lightning.py runs it",
    ("docs/integrations.md", "from accelerate import Accelerator"):
        "examples/train_accelerate.py (test_integration_blocks_are_the_examples): "
        "tests/integrations/test_accelerate.py::test_accelerate_example_runs runs it",
    ("docs/integrations.md", "from transformers import"):
        "tests/integrations/test_transformers.py::test_readme_trainer_section_runs_as_written runs it "
        "under torchrun",
    ("docs/checkpointing.md", "if iter_num % eval_interval == 0 and master_process:"):
        "a fragment of nanoGPT's train.py; tests/checkpoint/test_rank0_state_dict.py runs its pattern "
        "(state_dict() on rank 0 alone after a rank-0-only evaluation)",
    ("docs/usage.md", "ddp=model, lr=3e-4"):
        "a process without a process group: tests/pipeline/test_single_process.py::test_usage_block_runs",
    ("docs/usage.md", "capturable=True"):
        "CUDA parameters only: tests/gpu/gpu_cases.py case_capture (bench/gpu_check.sh) runs this loop on a GPU, "
        "tests/pipeline/step_end/test_step_graph.py on the stream-order checker's CPU model",
}


def _elsewhere(name: str, code: str) -> str | None:
    page = name.split(",")[0]
    found = [why for (p, marker), why in ELSEWHERE.items() if p == page and marker in code]
    return found[0] if found else None


def test_readme_fits():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move detail into docs/"


def oversized(pages) -> list[str]:
    """Every page over ``DOCS_LIMIT`` bytes, named with its size."""
    sizes = [(page, len(page.read_bytes())) for page in pages]
    return [f"{doc_blocks.page_name(page)} is {size} bytes, over {DOCS_LIMIT}: split it into pages by task"
            for page, size in sizes if size > DOCS_LIMIT]


def test_docs_pages_fit():
    assert oversized(sorted((ROOT / "docs").glob("*.md"))) == []


def test_an_oversized_page_is_named(tmp_path):
    """The size check itself can fail: a page one byte over the limit is named, one at it is not."""
    (tmp_path / "big.md").write_bytes(b"x" * (DOCS_LIMIT + 1))
    (tmp_path / "fits.md").write_bytes(b"x" * DOCS_LIMIT)
    assert oversized(sorted(tmp_path.glob("*.md"))) == [f"big.md is {DOCS_LIMIT + 1} bytes, over {DOCS_LIMIT}: "
                                                         "split it into pages by task"]


NAMED_PATH = re.compile(r"(?<![\w/.])((?:bench|docs|examples|fused_zero|kernels|tests)/[\w/.-]*\.(?:md|py|sh))")
"""A repository path as the pages, scripts and docstrings write it: from a top-level folder, to a file."""


def stale_paths(root: Path, files) -> list[str]:
    """Each path a file names (NAMED_PATH) that does not exist under ``root``, with where it is named."""
    return [f"{file.relative_to(root)}: {path}" for file in files
            for path in sorted(set(NAMED_PATH.findall(file.read_text()))) if not (root / path).exists()]


def test_named_files_exist():
    """Every file the README, the docs, .ci/run, the benchmarks and the code name by its path from the
    repository's root exists: a file moved or renamed leaves no stale name behind (bench/results/ keeps
    what a past run printed)."""
    files = [ROOT / "README.md", ROOT / ".ci" / "run", ROOT / "pyproject.toml", *ROOT.glob("docs/*.md"),
             *ROOT.glob("bench/*.py"), *ROOT.glob("bench/*.sh"), *ROOT.glob("examples/*.py"),
             *ROOT.glob("tests/**/*.py"), *ROOT.glob("fused_zero/**/*.py"), *ROOT.glob("kernels/*.py")]
    assert stale_paths(ROOT, files) == []


def test_a_stale_path_is_named(tmp_path):
    """The path check itself can fail: a moved test file's old path is named, its new one and a path
    inside another word are not."""
    (tmp_path / "tests" / "pipeline" / "comm").mkdir(parents=True)
    (tmp_path / "tests" / "pipeline" / "comm" / "test_backends.py").write_text("")
    moved = "tests/pipeline/" + "test_backends.py"  # in two, or this file would name a path that is not
    page = tmp_path / "page.md"
    page.write_text(f"`{moved}` and tests/pipeline/comm/test_backends.py, not my_tests/x.py\n")
    assert stale_paths(tmp_path, [page]) == [f"page.md: {moved}"]

@pytest.mark.parametrize("page", doc_blocks.PAGES, ids=doc_blocks.page_name)
def test_relative_links_resolve(page):
    assert doc_blocks.broken_links(page) == []


def test_a_broken_link_is_named(tmp_path):
    """The link check itself can fail: a missing file and a missing heading are both reported, in the
    page itself and in another one, with GitHub's anchors (punctuation but '-' and '_' dropped, spaces as
    '-', a repeated heading's anchor numbered)."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n[a](missing.md) [b](#title) [c](#nowhere) [d](https://x.org/y)\n")
    assert doc_blocks.broken_links(page) == ["page.md: missing.md (no such file)",
                                             "page.md: #nowhere (no heading #nowhere in page.md)"]
    (tmp_path / "other.md").write_text("# Top\n## The default overlap (\"auto\")\n## `snake_case`, a-b\n## Top\n")
    page.write_text("[a](other.md#the-default-overlap-auto) [b](other.md#snake_case-a-b) [c](other.md#top-1)\n"
                    "[d](other.md#top-2) [e](other.md#the-default-overlap)\n")
    assert doc_blocks.broken_links(page) == [
        "page.md: other.md#top-2 (no heading #top-2 in other.md)",
        "page.md: other.md#the-default-overlap (no heading #the-default-overlap in other.md)"]


def test_every_elsewhere_entry_names_one_block():
    """An ELSEWHERE entry that matches no block (the page changed) would excuse nothing: refuse it."""
    for (page, marker) in ELSEWHERE:
        matching = [n for n, code in doc_blocks.python_blocks() if n.startswith(page + ",") and marker in code]
        assert len(matching) == 1, (page, marker, matching)


def test_doc_blocks_run(tmp_path):
    """Every python block of the README and docs/*.md not in ELSEWHERE, on 2 gloo ranks, one spawn."""
    todo = [(n, c) for n, c in doc_blocks.python_blocks() if _elsewhere(n, c) is None]
    assert len(todo) >= 10, [n for n, _ in todo]
    results = run_ranks(doc_blocks.run, 2, todo, str(tmp_path), fresh=True)
    for rank, outcomes in enumerate(results):
        failed = [f"{name} (rank {rank}):\n{outcome}" for name, outcome, _ in outcomes if outcome != "ok"]
        assert failed == [], "\n".join(failed)
        assert [name for name, _, _ in outcomes] == [n for n, _ in todo]
        # docs/benchmarks.md: with param_sync="forward" the forward's waits are profiler ranges
        profiled = [ranges for name, _, ranges in outcomes if name.startswith("docs/benchmarks.md")]
        assert profiled and "fused_zero.forward_wait" in profiled[0], profiled


def test_integration_blocks_are_the_examples():
    """docs/integrations.md shows the Lightning and Accelerate examples as they are (their tests run them)."""
    code = {n: c for n, c in doc_blocks.python_blocks() if n.startswith("docs/integrations.md")}
    for example, marker in (("train_lightning.py", "import lightning.pytorch as pl"),
                            ("train_accelerate.py", "from accelerate import Accelerator")):
        source = (ROOT / "examples" / example).read_text()
        body = source[source.index('"""', 3) + 3:].lstrip("\n")  # without the module docstring
        shown = [c for c in code.values() if marker in c]
        assert shown == [body], f"docs/integrations.md's block differs from examples/{example}"


def test_optimizer_table_is_generated():
    """docs/optimizers.md's table of optimizers is `fused-zero options`' first table: every fused_zero
    optimizer, and every torch.optim optimizer without a twin, with the reason; the README names them."""
    page = (ROOT / "docs" / "optimizers.md").read_text()
    table = page.split("<!-- optimizers: generated by `fused-zero options`", 1)[1].split("-->\n", 1)[1]
    table = table.split("\n<!-- end of optimizers -->", 1)[0]
    assert table == optimizer_table(), "docs/optimizers.md's table is stale: paste `fused-zero options` into it"
    readme = (ROOT / "README.md").read_text().split("## Every torch.optim optimizer", 1)[1].split("\n## ", 1)[0]
    for name in fused_zero.__all__:
        if name[0].isupper():
            assert f"| `{name}` |" in table, name
    torch_optimizers = [n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type) and
                        issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"]
    for name in torch_optimizers:  # every torch.optim optimizer: a twin, or a reason
        assert f"`torch.optim.{name}`" in table and f"`{name}`" in readme, name


def test_option_table_is_generated_from_options_py():
    """The README's table is `fused-zero options`' output, and that describes exactly ShardingOptions'
    fields (plus ddp): one description of the options."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- options: generated by `fused-zero options`", 1)[1].split("-->\n", 1)[1]
    table = table.split("\n<!-- end of options -->", 1)[0]
    assert table == option_table(), "README.md's option table is stale: paste `fused-zero options` into it"
    public = [f for f in ShardingOptions.__dataclass_fields__ if not f.startswith("_")]  # _backend: docs/testing.md
    assert sorted(name for name, _, _ in OPTIONS) == sorted(["ddp", *public])
    printed = subprocess.run([sys.executable, "-m", "fused_zero.demo.cli", "options"], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
    assert printed.returncode == 0 and printed.stdout == optimizer_table() + "\n\n" + option_table() + "\n", \
        printed.stderr
    assert all(f"    {name}:" in ShardingOptions.__doc__ for name, _, _ in OPTIONS[1:])


@pytest.mark.parametrize("example", ["train_ddp.py", "train_muon.py"])
def test_example_runs_as_written_on_two_ranks(example):
    """``torchrun --nproc_per_node 2 examples/<example>``, as the README and its docstring say."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           f"examples/{example}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 5 and losses[-1] < losses[0], proc.stdout
    assert "optimizer bytes on this rank" in proc.stdout


@pytest.mark.parametrize("world", [2, 8, 64, 100, 1024])
@pytest.mark.parametrize("numel", [7, 1000, 4099, 65_537, 6_553_600, 8 * 1024 * 1024, 13_107_200])
def test_replicated_tail_bound(world, numel):
    """Under W x 32 elements always; under an eighth of a slice in buckets of at least 8 W^2 elements,
    under W elements in smaller ones (docs/shard-groups.md, Memory at scale)."""
    layout = BucketLayout.build([0], [numel], [0], world, 0)
    assert layout.tail < world * 32
    if numel >= 8 * world * world:
        assert layout.tail <= numel / world / 8
    else:
        assert layout.tail < world


def test_default_buckets_at_1024_ranks():
    """docs/shard-groups.md's figures: DDP's 25 MiB bucket at W=1024 in bf16 and in fp32."""
    bf16 = BucketLayout.build([0], [25 * 2**20 // 2], [0], 1024, 0)
    assert bf16.tail <= bf16.numel / 1024 / 8
    fp32 = BucketLayout.build([0], [25 * 2**20 // 4], [0], 1024, 0)
    assert fp32.numel // 1024 == 6400 and fp32.tail < 1024
    worst = BucketLayout.build([0], [25 * 2**20 // 4 + 1023], [0], 1024, 0)
    assert worst.tail == 1023
