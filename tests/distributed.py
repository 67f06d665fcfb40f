"""The test suite's ranks: gloo on 127.0.0.1, collectives that give up after 90 s, a call after 600 s.

Spawning a rank and importing torch, Triton and fused_zero into it costs about 3.5 CPU seconds, and the
suite makes over a hundred calls at 2 and 4 ranks: spawning anew each time was a third of its time on
2 cores. So the ranks are kept: a pool per world size holds its processes, which run one call after
another, each in a process group of its own (init, the function, a barrier, this process's checkpoint
servers stopped, destroy), with the working directory, the environment, the warning filters, grad
mode and torch's default seed put back as a fresh process has them. A module a function patches stays
patched for the next call, so functions restore what they patch (try/finally, as they do).

A call that fails or runs out of time takes its pool down (a rank may be stuck in a collective), and
the next call spawns a new one: a failure is reported exactly as by ``fused_zero.demo.spawn``.
``fresh=True`` spawns processes for the call alone: for frameworks that keep process-wide singletons
(Accelerate's ``PartialState``, Lightning's and the Trainer's environment) and for torch.compile's
caches.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import pickle
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fused_zero.demo.spawn import RanksFailed, _free_port, collect
from fused_zero.demo.spawn import run_ranks as _run_ranks

COLLECTIVE_TIMEOUT_S = 90.0
_DEFAULT_SEED = 67280421310721  # torch's default generator seed in a new process


def run_ranks(fn, world: int, *args, timeout: float = 600.0, backend: str | None = "gloo", fresh: bool = False):
    """Every rank's ``fn(rank, world, *args)``, in rank order. ``backend``: what ``init_process_group``
    is given (None: torch's default, no backend named)."""
    if fresh:
        return _run_ranks(fn, world, *args, timeout=timeout, backend=backend, collective_timeout=COLLECTIVE_TIMEOUT_S)
    pool = _pools.get(world)
    if pool is None or not pool.alive():
        pool = _pools[world] = _Pool(world)
    try:
        return pool.run(fn, args, backend, timeout)
    except BaseException:
        pool.close()
        _pools.pop(world, None)
        raise


class _Pool:
    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.calls = 0
        self.procs = [ctx.Process(target=_worker, args=(r, world, self.tasks[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, args, backend, timeout: float) -> list:
        self.calls += 1
        task = pickle.dumps((self.calls, fn, args, _free_port(), backend))
        for q in self.tasks:
            q.put(task)
        return collect(self.results, self.world, timeout, call=self.calls)

    def close(self) -> None:
        for q in self.tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


_pools: dict[int, _Pool] = {}


@atexit.register
def _close_all() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def _worker(rank: int, world: int, tasks, results) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores: more threads only contend
    cwd, environ = os.getcwd(), dict(os.environ)
    while True:
        task = tasks.get()
        if task is None:
            return
        call, fn, args, port, backend = pickle.loads(task)
        try:
            with warnings.catch_warnings():
                torch.manual_seed(_DEFAULT_SEED)
                torch.set_grad_enabled(True)
                dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                        world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
                try:
                    # by value: the queue's own pickler sends tensors as shared-memory handles
                    payload = pickle.dumps(fn(rank, world, *args))
                    dist.barrier()  # no rank tears its group down while a peer still talks to it
                    _stop_checkpoint_servers()
                finally:
                    dist.destroy_process_group()
                    gc.collect()  # what the call left in reference cycles (DDP, optimizers) holds its groups
            results.put((call, rank, "ok", payload))
        except BaseException:  # every failure must reach the parent, which then ends this pool
            results.put((call, rank, "error", traceback.format_exc()))
            return
        finally:
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(environ)


def _stop_checkpoint_servers() -> None:
    """The call's checkpoint servers (their threads wait on its process group's store), stopped as at exit."""
    from fused_zero.checkpoint.serving import server

    server.stop_all()


__all__ = ["RanksFailed", "run_ranks"]
