"""Triton compiles each kernel variant at its first launch (tens of ms each): that must happen at
construction, not inside the first backward, so every variant the engine will launch is launched once
here on a one-element dummy with every parameter inactive."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ...algorithms.codecs import DTYPES
from ...algorithms.fused import UpdateArgs, grad_sumsq
from ...kernels import Segments

if TYPE_CHECKING:
    from ...options import ShardingOptions
    from ..buckets.param_table import ParamTable


def compile_kernels(parameters: ParamTable, options: ShardingOptions, side) -> None:
    """Launch each kernel variant once on a one-element dummy with every parameter inactive, so that
    Triton compiles now and not inside the first backward (tens of ms per variant). On the side
    stream (``side``, comm/streams.py), under the parameters' device guard, like every launch. Per
    dtype and state format of the engine's parameters (``parameters``, buckets/param_table.py), before any
    shard exists: construction compiles before it changes anything."""
    with side.run(follow_current=True):
        for m, dtype, fmt in sorted({(int(m), p.dtype, f) for p, m, f in
                                     zip(parameters.tensors, parameters.member_of, parameters.state_formats)},
                                    key=str):
            _compile_for(options, side, parameters.members[m], dtype, fmt)


def _compile_for(options: ShardingOptions, side, member, dtype: torch.dtype, fmt: str) -> None:
    one = lambda dt=torch.float32: torch.zeros(1, dtype=dt, device=side.device)  # noqa: E731
    moments = DTYPES[fmt]
    algo = member.algo
    state = {name: one(moments) for name in algo.state_names()}
    if options.keeps_master(dtype):
        state["master"] = one()
    scales = {name: one() for name in algo.state_names()} if moments == torch.uint8 else None
    coefs = algo.coefficients(member.hparams(), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=bool), 1.0)
    coefs = side.upload(coefs)
    rows = [(0, 1, 0, 0, 0)]
    segments = Segments.build(rows, upload=side.upload)
    clip = one() if options.max_grad_norm is not None else None
    scale = one() if options.grad_scaler is not None else None
    algo.compile("triton", rows, segments, coefs, UpdateArgs(
        one(dtype), one(dtype), state, grad_scale=scale, found_inf=one(), clip_coef=clip, scales=scales,
        stochastic=options.stochastic_rounding))
    grad_sumsq("triton", rows, segments, coefs, one(dtype), scale)
