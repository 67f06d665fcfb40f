"""What a process group reports about its backends on a GPU machine, stubbed on the CPU, so that the
code's own backend choices (pipeline/comm/collectives.py: the reduction plan, the reduce-scatter's future,
the gather plan, which dtypes sum) run as they would there instead of being patched to NCCL's answers.

Only the reports are stubbed: ``dist.get_backend`` (one name, no device) and ``dist.get_backend_config``
(one backend per device type), for every process group, and the NCCL version. The tensors stay on the
CPU, standing for CUDA ones (the stream-order checker's model), so the config is reported with CUDA's
entry under "cpu": a group ``init_process_group("cpu:gloo,cuda:nccl")`` made runs the modeled device's
tensors on NCCL. ``dist.get_backend`` is reported as torch reports it there ("undefined" after
``init_process_group()``, the whole string for a mixed one), so code that reads it instead of the
device's entry takes the choice it would take on the GPU machine.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

GPU_REPORTS = {
    "nccl": ("nccl", "cuda:nccl"),
    "cpu:gloo,cuda:nccl": ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
    None: ("undefined", "cuda:nccl"),
    "nccl2": ("nccl2", "cuda:nccl2"),
    "nccl-lazy": ("nccl-lazy", "cuda:nccl-lazy"),
    "nccl-legacy": ("nccl-legacy", "cuda:nccl-legacy"),
}
"""``init_process_group(backend=...)`` -> what ``dist.get_backend`` and ``dist.get_backend_config`` then
report on a GPU machine (torch 2.13: with no backend, the accelerator's default only; earlier torch
also listed "cpu:gloo", which changes nothing for CUDA tensors). Groups made by ``new_group`` without a
backend report the same. torch 2.14 registers the NCCL backend's variants under their own names
("nccl2": ProcessGroupNCCL2 on the torchcomms engine, which 2.15's "nccl" is unless
``TORCH_DIST_USE_NCCL2=0``; "nccl-lazy"; "nccl-legacy": the classic ProcessGroupNCCL)."""

MODELED_NCCL = (2, 21, 5)
"""The NCCL version reported: any that the supported torch builds ship (2.10 and later sum bfloat16)."""


def modeled_reports(backend: str | None, device_type: str = "cpu") -> tuple[str, str]:
    """``(get_backend, get_backend_config)`` as reported for ``backend``, with CUDA's entry of the config
    under ``device_type`` (the device the CPU tensors stand in for CUDA on)."""
    if backend not in GPU_REPORTS:
        raise ValueError(f"backend={backend!r}: the checker models {sorted(GPU_REPORTS, key=str)}")
    name, config = GPU_REPORTS[backend]
    served = dict(p.split(":", 1) for p in config.split(","))
    return name, f"{device_type}:{served['cuda']}"


def patches(name: str, config: str, nccl: tuple = MODELED_NCCL) -> list[tuple[object, str, object]]:
    """``(owner, attribute, value)``: every process group reports ``name`` and ``config``, and torch the
    NCCL version ``nccl``."""
    return [(dist, "get_backend", lambda group=None: dist.Backend(name)),
            (dist, "get_backend_config", lambda group=None: config),
            (torch.cuda.nccl, "version", lambda: nccl)]


def reported(name: str, config: str, nccl: tuple = MODELED_NCCL):
    """``patches`` applied inside the ``with``."""
    return patched(patches(name, config, nccl))


@contextlib.contextmanager
def patched(stubs):
    """``(owner, attribute, value)`` set for the block, put back after it whatever happens."""
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in stubs]
    for owner, attr, value in stubs:
        setattr(owner, attr, value)
    try:
        yield
    finally:
        for owner, attr, value in saved:
            setattr(owner, attr, value)
