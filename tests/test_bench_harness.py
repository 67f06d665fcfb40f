"""The step benchmarks' harness (bench/test_bench_step.py), without running a benchmark: a failed
spawn fails every test of its world at once instead of spawning again, and a system that failed on
any rank is reported with every rank's traceback."""

import importlib.util
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
