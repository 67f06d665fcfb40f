"""The step benchmarks' harness (bench/test_bench_step.py), without running a benchmark: a failed
spawn fails every test of its world at once instead of spawning again, and a system that failed on
any rank is reported with every rank's traceback."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fused_zero.demo.spawn import RanksFailed


@pytest.fixture
def bench(monkeypatch):
    path = Path(__file__).resolve().parents[1] / "bench" / "test_bench_step.py"
    spec = importlib.util.spec_from_file_location("bench_step_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "_CACHE", {})
    return module


def test_a_failed_spawn_is_cached(bench, monkeypatch):
    spawns = []

    def failing(fn, world, *args):
        spawns.append(world)
        raise RanksFailed("--- rank 1 ---\nboom")

    monkeypatch.setattr(bench, "run_ranks", failing)
    request = SimpleNamespace(session=SimpleNamespace(items=[]))
    for label in ("n64-l2", "n128-l2", "n64-l2"):
        with pytest.raises(pytest.fail.Exception, match="boom"):
            bench._results(request, ("step", 2, label))
    assert spawns == [2, 2], "a failed scenario was spawned again"


def test_every_ranks_errors_are_reported(bench):
    res = {"scenario": bench._scenario("step", 2, "n64-l2"),
           "ranks": [{"errors": {}, "systems": {}},
                     {"errors": {"fused_zero-bucket": "Traceback: only on rank 1"}, "systems": {}}]}
    with pytest.raises(pytest.fail.Exception, match=r"(?s)rank 1.*only on rank 1"):
        bench._system_info(res, "fused_zero-bucket")


def test_scale_model_follows_the_layout():
    """bench/scale_model.py (the tables of docs/performance-scale.md): its state per rank is the layout's
    regions, 1/S of DDP + AdamW's plus the tails; the bytes follow the ring formulas."""
    path = Path(__file__).resolve().parents[1] / "bench" / "scale_model.py"
    spec = importlib.util.spec_from_file_location("scale_model_under_test", path)
    sm = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sm  # its dataclass looks its module up there
    spec.loader.exec_module(sm)
    buckets = sm.ddp_buckets(sm.build("GPT-2 small"))
    params = sum(sum(b) for b in buckets)
    assert params == 124_439_808  # GPT-2 small with its tied embedding
    ddp, flat, shard = (sm.row("GPT-2 small", buckets, 64, c) for c in ("ddp", "flat", "shard8"))
    assert ddp["state_bytes"] == 12 * params
    for r, s in ((flat, 64), (shard, 8)):
        assert params / s * 12 <= r["state_bytes"] <= (params / s + len(buckets) * s * 32) * 12
    ring = 2 * 63 / 64 * 2 * params  # DDP: an all-reduce of 2-byte gradients over 64 ranks
    assert ddp["nvl_bytes"] + ddp["ib_bytes"] == pytest.approx(ring)
    assert ddp["ib_bytes"] == pytest.approx(ring / 8)
    assert shard["ib_bytes"] == pytest.approx(2 * 7 / 8 * 2 * params / 8, rel=1e-3)  # slices across 8 nodes


def test_muon_scale_model_runs_each_matrix_once_and_balances_it():
    """bench/muon_scale_model.py (docs/performance-scale.md's Muon tables): every matrix gets one owner, so the
    ranks together do one process's NS work; the busiest rank is within 5% of the mean at W=8; one rank
    sends and receives nothing; the momentum is 1/W."""
    bench_dir = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench_dir))
    try:
        spec = importlib.util.spec_from_file_location("muon_scale_model_under_test", bench_dir / "muon_scale_model.py")
        mm = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mm)
    finally:
        sys.path.remove(str(bench_dir))
    shapes = [(1, 5), (1, 4), (1, 3), (1, 3), (1, 2), (1, 2), (1, 1)]  # NS FLOPs per step 4 n + 2
    own = mm.owners(shapes, 3)  # fused_zero.Muon's own assignment
    loads = [sum(4 * n + 2 for (_, n), r in zip(shapes, own) if r == k) for k in range(3)]
    assert loads == [22 + 10, 18 + 10 + 6, 14 + 14]  # LPT, lower rank on ties: every matrix once
    assert mm.ns_flops((768, 3072)) == mm.ns_flops((3072, 768)) == 5 * (4 * 768 ** 2 * 3072 + 2 * 768 ** 3)
    one, eight = mm.row("GPT-2 small", 1), mm.row("GPT-2 small", 8)
    assert one["extra_bytes_max"] == 0 and one["zero1_bytes"] == 0
    assert eight["matrices"] == 48 and eight["muon_elements"] == 12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072)
    assert eight["ns_flops_mean"] * 8 == pytest.approx(eight["ns_flops_every_rank"])
    assert 1.0 <= eight["balance"] <= 1.05
    assert eight["momentum_bytes"] == 4 * eight["muon_elements"] / 8
