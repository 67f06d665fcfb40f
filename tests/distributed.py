"""Run a function on W spawned ranks (gloo on 127.0.0.1), with timeouts that turn a hang into a failure.

``run_ranks(fn, world, *args)`` spawns ``world`` processes that each call ``fn(rank, world, *args)``
inside an initialised process group. Every rank's exception comes back to the test with its rank and
traceback; a rank that does not finish within ``timeout`` seconds fails the test and is killed.
Spawning and importing torch costs seconds, so callers run many scenarios per spawn.
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=90)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, results):
    os.environ["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)  # ranks share the machine's cores: more threads only contend
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=COLLECTIVE_TIMEOUT)
        try:
            out = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout: float = 600.0):
    """Return the list of each rank's return value; raise with every failing rank's traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    outs, errors = {}, []
    try:
        for _ in range(world):
            rank, status, payload = results.get(timeout=timeout)
            if status == "ok":
                outs[rank] = payload
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # the others may now hang in a collective: stop waiting for them
    except Exception as e:  # queue.Empty: a rank hung
        errors.append(f"ranks timed out after {timeout}s ({type(e).__name__}); finished: {sorted(outs)}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [outs[r] for r in range(world)]


__all__ = ["run_ranks"]
