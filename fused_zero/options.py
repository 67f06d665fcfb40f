"""The sharding options every fused_zero optimizer takes, checked once, at construction.

Hyperparameters (``lr``, ``betas``, ...) live in ``param_groups`` as in torch.optim, so schedulers keep
working; these options say how the optimizer is sharded and when it runs, and cannot change after
construction.
"""

from __future__ import annotations

import difflib
import os
import warnings
from dataclasses import dataclass

import torch

OVERLAPS = ("auto", "bucket", "backward", "step")
GRAD_REDUCES = ("reduce_scatter", "all_reduce")
BACKENDS = ("auto", "triton", "torch")
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STATE_FORMATS = ("fp32", "bf16", "8bit")
STATE_FORMAT_ALIASES = {"int8": "8bit"}  # the 0.x name, still accepted (and in checkpoints' metadata)
MASTER_WEIGHTS = (None, True, False, "stochastic")
PARAM_SYNCS = ("step", "forward")
ON_NONFINITES = ("skip", "raise")
GRAD_REDUCE_DTYPES = (None, torch.bfloat16, torch.float16)


OPTIONS = (
    # (name, values, meaning): the one description of the keyword-only options. ShardingOptions'
    # docstring, `fused-zero options` and the README's table (tests/test_readme_claims.py) are
    # made from it.
    ("ddp", "the DDP module (in one process without a process group: the plain module)",
     "registers the comm hook at construction; or leave it out and `opt.attach(ddp)` later "
     "([docs/usage.md](docs/usage.md#one-process-no-ddp))"),
    ("grad_reduce", '`"reduce_scatter"` (default), `"all_reduce"`',
     "ZeRO-2 traffic (each rank receives only its slice) or ZeRO-1 (`param.grad` then holds DDP's averaged "
     "gradient)"),
    ("overlap", '`"auto"` (default), `"bucket"`, `"backward"`, `"step"`',
     "when the updates run: each bucket as its reduction completes, every bucket once the last one is "
     "reduced, or in `step()`; `\"auto\"` is `\"backward\"` with `max_grad_norm` or `grad_scaler`, else "
     "`\"bucket\"`. Only `\"step\"` applies a clip or `.grad` edit made after the backward "
     "([docs/usage.md](docs/usage.md#overlap-modes))"),
    ("master_weights", '`None` (default: on for bf16/fp16), `True`, `False`, `"stochastic"`',
     "how bf16/fp16 parameters are updated: from an fp32 master copy (`None`, `True`), in place rounded to "
     'nearest (`False`), or in place with stochastic rounding, unbiased (`"stochastic"`: bf16 parameters '
     "only, no master copy)"),
    ("max_grad_norm", "float",
     "global-norm clipping as `clip_grad_norm_`, of the reduced gradients; needs every gradient before any "
     'update: not with `overlap="bucket"`'),
    ("grad_scaler", "a `torch.amp.GradScaler`",
     'the scaler the loop steps through (fp16); not with `overlap="bucket"`'),
    ("on_nonfinite", '`"skip"` (default), `"raise"`',
     "a step whose reduced gradients hold an inf or NaN on some rank is skipped on every rank (counted in "
     '`skipped_steps`); `"raise"` then raises in `step()`. With a scaler, overflows are skipped as torch does'),
    ("param_sync", '`"step"` (default), `"forward"`',
     "when the all-gathered parameters are waited for: `step()` returns with every parameter updated, or "
     "each module's forward pre-hook waits for the buckets it can read"),
    ("state_format", '`"fp32"` (default), `"bf16"`, `"8bit"`',
     "how the moments are kept: fp32, bf16 (rounded to nearest even) or 8-bit floats (sign + E4M3, E5M3 for "
     'the second moment) in blocks of up to 2048 elements with one fp32 scale each (`"int8"`, its old name, '
     "is accepted) ([docs/compact-state.md](docs/compact-state.md)); a param group may set its own"),
    ("seed", "int in `[0, 2**32)`, default 0",
     'with `master_weights="stochastic"` only (refused otherwise): the rounding\'s seed; the bits depend on '
     "(seed, step, element index in its parameter) only, never on the world size or the bucket layout"),
    ("shard_group", "`None` (default: all of DDP's ranks), an int S, a `ProcessGroup`, a `DeviceMesh`",
     "shard within groups (S consecutive ranks; this rank's group; a 2-D mesh `(replicate, shard)`), "
     "replicate across them: state per rank 1/S ([docs/shard-groups.md](docs/shard-groups.md))"),
    ("grad_reduce_dtype", "`None` (default: each gradient in its dtype), `torch.bfloat16`, `torch.float16`",
     "fp32 gradients cast and divided by W in that dtype before the reduction, as DDP's `bf16_compress_hook` "
     "/ `fp16_compress_hook`; the update reads them into fp32"),
)


def option_table() -> str:
    """OPTIONS as the markdown table the README holds."""
    rows = ["| option | values | meaning |", "|---|---|---|"]
    rows += [f"| `{name}` | {values} | {meaning} |" for name, values, meaning in OPTIONS]
    return "\n".join(rows)


def _docstring() -> str:
    lines = ["The keyword-only options of every fused_zero optimizer (OPTIONS, the one description of them):", ""]
    for name, values, meaning in OPTIONS:
        if name != "ddp":
            lines += [f"    {name}: {values}. {meaning}.", ""]
    return "\n".join(lines)


@dataclass(frozen=True)
class ShardingOptions:
    __doc__ = _docstring()

    grad_reduce: str = "reduce_scatter"
    overlap: str = "auto"
    master_weights: bool | None = None
    max_grad_norm: float | None = None
    param_sync: str = "step"
    _backend: str = "auto"  # the tests' knob (docs/testing.md): the device decides
    grad_scaler: object = None
    on_nonfinite: str = "skip"
    state_format: str = "fp32"
    seed: int | None = None
    shard_group: object = None
    grad_reduce_dtype: torch.dtype | None = None

    def __post_init__(self):
        _check_choice("overlap", self.overlap, OVERLAPS)
        _check_choice("grad_reduce", self.grad_reduce, GRAD_REDUCES)
        _check_choice("param_sync", self.param_sync, PARAM_SYNCS)
        _check_choice("_backend", self._backend, BACKENDS)
        _check_choice("on_nonfinite", self.on_nonfinite, ON_NONFINITES)
        object.__setattr__(self, "overlap", resolve_overlap(self.overlap, self.max_grad_norm, self.grad_scaler))
        if self.grad_scaler is not None:
            check_whole_step("grad_scaler", "scaler", self.overlap)
        _check_choice("state_format", self.state_format, STATE_FORMATS)
        if not (self.master_weights is None or isinstance(self.master_weights, bool)
                or self.master_weights == "stochastic"):
            raise ValueError(f"master_weights={self.master_weights!r} is not one of None (fp32 masters for "
                             "bf16/fp16 parameters), True, False (updated in place, rounded to nearest), "
                             "'stochastic' (bf16 updated in place, stochastic rounding)")
        if self.seed is not None:
            if not self.stochastic_rounding:
                raise ValueError(f"seed={self.seed!r} seeds stochastic rounding, which is off "
                                 f"(master_weights={self.master_weights!r}): pass master_weights='stochastic' "
                                 "with it, or drop seed")
            if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2 ** 32:
                raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        elif self.stochastic_rounding:
            object.__setattr__(self, "seed", 0)
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise ValueError(f"grad_reduce_dtype={self.grad_reduce_dtype!r} is not one of None (each gradient in "
                             "its own dtype), torch.bfloat16, torch.float16")
        if isinstance(self.shard_group, bool) or (isinstance(self.shard_group, int) and self.shard_group < 1):
            raise ValueError(f"shard_group={self.shard_group!r}: give the number of consecutive ranks per shard "
                             "group (a divisor of DDP's world size), a ProcessGroup or a DeviceMesh")
        if self.max_grad_norm is not None:
            check_whole_step("max_grad_norm", "clip", self.overlap)
            if not self.max_grad_norm > 0:
                raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")

    @property
    def stochastic_rounding(self) -> bool:
        return self.master_weights == "stochastic"

    @property
    def backend(self) -> str:
        return self._backend

    def resolved_backend(self, device: torch.device) -> str:
        if self.backend == "auto":
            return "triton" if device.type == "cuda" else "torch"
        if self.backend == "torch" and device.type != "cpu":
            raise ValueError(f"_backend='torch' is the CPU path (torch's own CPU ops, one call per run of "
                             f"elements: bit-identical to torch.optim on CPU, with host reads of its flags); the "
                             f"parameters are on {device}: use _backend='auto' or 'triton'")
        if self.backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("_backend='triton' on CPU tensors runs Triton's interpreter: set TRITON_INTERPRET=1 "
                             "before importing fused_zero, or use _backend='torch'")
        return self.backend

    def keeps_master(self, dtype: torch.dtype) -> bool:
        """Whether parameters of ``dtype`` get fp32 master weights."""
        return dtype != torch.float32 and self.master_weights in (None, True)

    def check_params(self, params: list[torch.Tensor]) -> None:
        """Stochastic rounding writes bf16: every parameter must be one."""
        if self.stochastic_rounding:
            others = sorted({str(p.dtype) for p in params if p.dtype != torch.bfloat16})
            if others:
                raise ValueError(f"master_weights='stochastic' rounds fp32 results to bf16 parameters, and this model "
                                 f"has {', '.join(others)} parameters: convert the model to bf16 (model.bfloat16()), "
                                 "or keep master weights for 16-bit parameters (master_weights=None)")


WHOLE_STEP = {
    "clip": "the global gradient norm is known only once every bucket is reduced, and overlap='bucket' "
            "updates each bucket before the next is reduced",
    "scaler": "with overlap='bucket' a bucket is updated before the later buckets' overflow check is known",
}
"""What needs every bucket's reduced gradients before any update, and why: the one statement of the
rule that these need an overlap mode other than "bucket" (the options, the GradScaler check at step,
and the integrations' checks all raise through ``check_whole_step``)."""


def resolve_overlap(overlap: str, max_grad_norm=None, grad_scaler=None) -> str:
    """``overlap="auto"``: "backward" where clipping or a GradScaler needs every gradient before any
    update (one launch after the last bucket, inside the backward), else "bucket" (the most
    overlapped). An explicit mode is kept as given."""
    if overlap != "auto":
        return overlap
    return "backward" if max_grad_norm is not None or grad_scaler is not None else "bucket"


def check_whole_step(what: str, need: str, overlap: str, error: type = ValueError) -> None:
    """Refuse ``what`` (something needing ``WHOLE_STEP[need]``) with overlap="bucket"."""
    if overlap == "bucket":
        raise error(f"{what} needs overlap='backward' or overlap='step' (got overlap='bucket'): "
                    f"{WHOLE_STEP[need]}. Leave overlap out (the default, 'auto', picks a mode "
                    "that takes it) or pass overlap='backward' or 'step'")


def canonical_state_format(fmt):
    """A state format's name, with the 0.x alias ("int8", also in checkpoints' metadata) mapped."""
    return STATE_FORMAT_ALIASES.get(fmt, fmt) if isinstance(fmt, str) else fmt


_RENAMED = {
    "stochastic_rounding": "stochastic_rounding=True is now master_weights='stochastic'",
    "backend": "backend is decided by the device (Triton on CUDA, torch's ops on CPU): leave it out",
}


def normalize_options(options: dict, owner: str, stacklevel: int = 4) -> dict:
    """The keyword-only options as ShardingOptions takes them: the 0.x spellings (``stochastic_rounding``,
    ``backend``, ``state_format="int8"``) mapped onto today's, with one DeprecationWarning naming the new
    spelling, and an unknown keyword refused naming ``owner`` (the optimizer class), the closest option
    and every valid one (not ShardingOptions, which users never build)."""
    public = [name for name, _, _ in OPTIONS if name != "ddp"]
    out, old = {}, []
    for name, value in options.items():
        if name == "stochastic_rounding":
            old.append(_RENAMED[name])
            if value is True:
                if options.get("master_weights") is True:  # 0.x wrote master_weights=False with it
                    raise ValueError(f"stochastic_rounding=True (now master_weights='stochastic') with "
                                     f"master_weights={options['master_weights']!r}: give master_weights only")
                out["master_weights"] = "stochastic"
            elif value is not False:
                raise ValueError(f"stochastic_rounding must be True or False, got {value!r}; today's "
                                 "spelling is master_weights='stochastic'")
        elif name == "backend":
            old.append(_RENAMED[name])
            out["_backend"] = value
        elif name == "state_format" and value in STATE_FORMAT_ALIASES:
            old.append(f"state_format={value!r} is now {STATE_FORMAT_ALIASES[value]!r}")
            out[name] = STATE_FORMAT_ALIASES[value]
        elif name in public or name == "_backend":
            out.setdefault(name, value)
        else:
            close = difflib.get_close_matches(name, public, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}=?" if close else "."
            raise TypeError(f"{owner} got an unknown keyword argument {name!r}{hint} Its options are "
                            f"{', '.join(public)} (and ddp=); see `fused-zero options`")
    if old:
        warnings.warn(f"{owner}: {'; '.join(old)}. The old spelling is accepted with the new meaning",
                      DeprecationWarning, stacklevel=stacklevel)
    return out


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")


def group_state_formats(param_groups: list[dict], default: str) -> list[str]:
    """Each param group's moment format: its ``state_format``, else ``default`` (checked here too: a
    group's key may have been edited since ``add_param_group`` checked it)."""
    formats = [canonical_state_format(g.get("state_format", default)) for g in param_groups]
    for i, fmt in enumerate(formats):
        _check_choice(f"param group {i}: state_format", fmt, STATE_FORMATS)
    return formats
