"""The test suite's ranks: gloo on 127.0.0.1, collectives that give up after 90 s, the whole spawn after
600 s. Spawning and importing torch costs seconds, so callers run many scenarios per spawn."""

from fused_zero.demo.spawn import run_ranks as _run_ranks


def run_ranks(fn, world: int, *args, timeout: float = 600.0, backend: str | None = "gloo"):
    """``backend``: what ``init_process_group`` is given (None: torch's default, no backend named)."""
    return _run_ranks(fn, world, *args, timeout=timeout, backend=backend, collective_timeout=90.0)


__all__ = ["run_ranks"]
