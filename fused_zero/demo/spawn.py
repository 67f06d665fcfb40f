"""Run a function on W local ranks: spawned processes in one process group on 127.0.0.1 (NCCL with one
GPU per rank where CUDA is available, else gloo), with timeouts that turn a hang into an error.

Used by ``fused-zero demo``, the test suite and the benchmarks. ``run_ranks(fn, world, *args)`` returns
every rank's ``fn(rank, world, *args)``; a failure on any rank raises ``RanksFailed`` with that rank's
traceback, and the other ranks (which may now wait in a collective forever) are killed.
"""

from __future__ import annotations

import datetime
import pickle
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RanksFailed(RuntimeError):
    """A rank raised, or the ranks did not finish in time."""


AUTO = "auto"
"""``run_ranks(backend=AUTO)``: NCCL where CUDA is available, else gloo (``backend=None`` is torch's own
default instead: ``init_process_group()`` with no backend)."""


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _on_cuda(backend: str | None) -> bool:
    """Whether the ranks' tensors live on CUDA: an NCCL backend for CUDA tensors, or torch's default
    where CUDA is available."""
    if backend is None:
        return torch.cuda.is_available()
    return backend == "nccl" or "cuda:nccl" in backend


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, backend, collective_timeout, fn, args, results):
    try:
        if _on_cuda(backend):
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)  # the ranks share the machine's cores: more threads only contend
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        try:
            # by value: the queue's own pickler sends tensors as shared-memory handles, which vanish
            # when this process exits before the parent has read them (FileNotFoundError there)
            results.put((None, rank, "ok", pickle.dumps(fn(rank, world, *args))))
            # no rank tears its group down while a peer still talks to it: with gloo that race aborts
            # the process ("terminate called without an active exception"), 1 exit in 3 on 2 CPU ranks
            dist.barrier()
        finally:
            dist.destroy_process_group()
        return
    except BaseException:  # every failure must reach the parent
        results.put((None, rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout: float = 600.0, backend: str | None = AUTO,
              collective_timeout: float = 120.0) -> list:
    """Every rank's return value, in rank order. ``fn`` must be importable (a module-level function).
    ``backend``: what ``init_process_group`` is given ("gloo", "nccl", "cpu:gloo,cuda:nccl", or None
    for torch's default), or ``AUTO``."""
    backend = default_backend() if backend == AUTO else backend
    if _on_cuda(backend) and world > torch.cuda.device_count():
        raise ValueError(f"{world} NCCL ranks need {world} GPUs; this machine has {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, backend, collective_timeout, fn, args, results),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return collect(results, world, timeout)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def collect(results, world: int, timeout: float, call=None) -> list:
    """Every rank's value from ``results``, whose messages are ``(call, rank, "ok" or "error", payload)``,
    in rank order; messages of another call (a kept process's earlier one) are dropped. The first
    error, or ``timeout`` seconds without every rank's answer, raises RanksFailed: the other ranks may
    now hang in a collective, so nobody waits for them."""
    outs, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(outs) < world:
            tag, rank, status, payload = results.get(timeout=max(deadline - time.monotonic(), 1.0))
            if tag != call:
                continue
            if status == "ok":
                outs[rank] = pickle.loads(payload)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break
    except Exception as e:  # queue.Empty: a rank hung or died without a word
        errors.append(f"ranks timed out after {timeout}s ({type(e).__name__}); finished: {sorted(outs)}")
    if errors:
        raise RanksFailed("\n".join(errors))
    return [outs[r] for r in range(world)]
