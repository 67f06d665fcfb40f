"""torch.optim.Adafactor over DDP's buckets: torch's own update, on whole parameters.

Adafactor is not elementwise: a matrix's step reads the mean square of each of its rows and columns, the
norm of the whole parameter and the norm of the whole update. A rank's slice of a bucket holds pieces of
matrices, so the step runs where the whole tensors are: every rank of the shard group assembles each of
its Adafactor parameters whole (the reduced gradient, all-gathered in ``grad_reduce="reduce_scatter"``,
where each rank holds only its slice; the fp32 master weights, all-gathered where the parameters are
bf16/fp16) and runs ``torch.optim._adafactor.adafactor`` on them, as DDP + torch.optim.Adafactor does
on every rank. So the update is torch's, bit for bit; the factored statistics (``row_var``,
``col_var``; ``variance`` for a vector), a few numbers per row and column, are kept on every rank
beside the step counts; the fp32 masters stay sharded (1/W). pipeline/updating/whole_params.py drives it.

Why this path (docs/optimizers.md, "Adafactor"): the alternatives move fewer bytes but give up the bits
(row and column sums reduced across the slices' ranks, m + n words per matrix and step, in another
order of sums) or hold the statistics on one owner rank per matrix (Muon's path), which moves each
slice element three times per step and makes the checkpoints ask the owners. Assembling the gradient
is what ``grad_reduce="all_reduce"`` already does, so there it costs nothing beyond the repeated
arithmetic; with reduce-scatter it is one all-gather of the bucket's reduced slices.
"""

from __future__ import annotations

import torch

from .elementwise import ElementwiseAlgorithm, Spec, declaration
from .interface import Algorithm, Runs

SPEC = Spec("Adafactor", "_adafactor", function_name="adafactor",
            lists={"row_vars": "row_var", "col_vars": "col_var", "variances": "variance", "state_steps": "step"},
            renames={"eps1": lambda g: g["eps"][0], "eps2": lambda g: g["eps"][1]}, moments=False,
            test=dict(lr=1e-2, weight_decay=0.01), bench=dict(lr=1e-2))


def _kept_shapes(shape: torch.Size) -> dict[str, list[int]]:
    """torch's Adafactor state of a parameter of ``shape``: row and column statistics of a matrix
    (its last dimension, resp. the one before, reduced to 1), the full second moment of a vector."""
    if len(shape) > 1:
        rows, cols = list(shape), list(shape)
        rows[-1], cols[-2] = 1, 1
        return {"row_var": rows, "col_var": cols}
    return {"variance": list(shape)}


class AdafactorAlgorithm(ElementwiseAlgorithm):
    """Adafactor (module docstring): updates in a phase of its own, with collectives, on every rank."""

    spec = SPEC
    runs = Runs.WHOLE_PARAMS
    kept_names = ("row_var", "col_var", "variance")

    def __init__(self, param_groups: list[dict], defaults: dict):
        self.kept: dict[int, dict[str, torch.Tensor]] = {}  # engine pid -> its factored statistics
        super().__init__(param_groups, defaults)

    def check_group(self, group: dict, i: int) -> None:
        """torch.optim.Adafactor refuses a complex parameter at its first step; here at once, in its words
        (its constructor has checked the rest: optimizer/twins.py)."""
        if any(torch.is_complex(p) for p in group["params"]):
            raise RuntimeError("Adafactor does not support complex parameters")

    def state_names(self) -> list[str]:
        return []  # nothing region-shaped: the statistics are per row and column (``kept``)

    def kept_needed(self, name: str, param) -> bool:
        return name in _kept_shapes(param.shape)

    def statistics(self, pid: int, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter ``pid``'s statistics, made at its first step as torch makes them (zeros, fp32)."""
        if pid not in self.kept:
            self.kept[pid] = {name: torch.zeros(shape, dtype=torch.float32, device=param.device)
                              for name, shape in _kept_shapes(param.shape).items()}
        return self.kept[pid]

    def kept_entries(self, pid: int, group: dict, device) -> dict[str, torch.Tensor]:
        return dict(self.kept.get(pid, {}))

    def check_kept(self, name: str, value, shape) -> str | None:
        """``shape``: the parameter's."""
        want = _kept_shapes(torch.Size(shape)).get(name)
        if want is None:
            return f"state {name!r} is not Adafactor's for a parameter of shape {tuple(shape)}"
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return f"state {name!r} should be a float tensor, got {type(value).__name__}"
        if list(value.shape) != want:
            return f"state {name!r} has shape {tuple(value.shape)}, the parameter needs {tuple(want)}"
        if not bool(torch.isfinite(value).all()):
            return f"state {name!r} holds non-finite values"
        return None

    def load_kept(self, pid: int, saved: dict, device) -> None:
        values = {name: saved[name] for name in self.kept_names if saved.get(name) is not None}
        if not values:
            self.kept.pop(pid, None)
            return
        self.kept[pid] = {name: torch.as_tensor(v, dtype=torch.float32).detach().to(device).clone()
                          for name, v in values.items()}

    def bytes_kept(self) -> int:
        """What this rank keeps beside the regions (``memory()``): every parameter's statistics."""
        return sum(t.numel() * t.element_size() for kept in self.kept.values() for t in kept.values())

    def reference_bytes(self, params) -> int:
        """torch.optim.Adafactor's state of ``params`` (fp32 statistics; the step counts aside)."""
        return sum(4 * int(torch.Size(s).numel()) for p in params for s in _kept_shapes(p.shape).values())

    def check_options(self, options: dict, where: str) -> None:
        fmt = options.get("state_format", "fp32") or "fp32"
        if fmt != "fp32":
            raise ValueError(f"{where}: state_format={fmt!r} is not supported for Adafactor: its state is a few "
                             "row and column statistics per matrix, kept in fp32 on every rank; use "
                             "state_format='fp32'")
        if options.get("stochastic_rounding"):
            raise ValueError(f"{where}: stochastic_rounding is not supported for Adafactor; keep fp32 master "
                             "weights (master_weights=True) for low-precision parameters instead")

    apply = Algorithm.apply  # whole parameters, in its own phase: a launch is refused (interface.py)

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor], pids: list[int], steps: list[float],
             group: dict) -> None:
        """torch's Adafactor over whole fp32 ``params`` (updated in place) of one param group, with their
        ``grads``, kept statistics and counts before this step."""
        kept = [self.statistics(pid, p) for pid, p in zip(pids, params)]
        lists = {"row_vars": [k.get("row_var") for k in kept], "col_vars": [k.get("col_var") for k in kept],
                 "variances": [k.get("variance") for k in kept],
                 "state_steps": [torch.tensor(s, dtype=torch.float32) for s in steps]}
        self.spec.function(params, grads, **lists, **self.keywords(group))

    def step_on_device(self, params: list[torch.Tensor], grads: list[torch.Tensor], pids: list[int],
                       steps: list[torch.Tensor], keep: list[torch.Tensor], group: dict) -> None:
        """``step`` where the host must not read the device (CUDA): ``steps`` are the counts after this
        step and ``keep`` whether each parameter's update is written, device tensors. torch's Adafactor reads
        its step count and two norms per parameter on the host (``.item()``: a wait for the device each,
        inside DDP's comm hook in the default modes); here the same values stay on the device
        (``device_step``). The statistics are updated in copies and written where ``keep``; the caller
        does the same with ``params``."""
        keywords = self.keywords(group)
        for param, grad, pid, step, ok in zip(params, grads, pids, steps, keep):
            kept = self.statistics(pid, param)
            work = {name: t.clone() for name, t in kept.items()}
            device_step(param, grad, work, step, **keywords)
            for name, t in kept.items():
                torch.where(ok, work[name], t, out=t)


def device_step(param: torch.Tensor, grad: torch.Tensor, kept: dict[str, torch.Tensor], step: torch.Tensor, *,
                d: float, lr, beta2_decay: float, weight_decay: float, eps1: float | None, eps2: float,
                maximize: bool, **_) -> None:
    """torch's ``_single_tensor_adafactor`` on one parameter, op for op, with ``step`` (the count after
    this step) a device tensor. The scalars torch computes in Python floats from ``step_t.item()`` and from
    the norms' ``.item()`` are computed on the device in float64, by the same IEEE operations where torch's
    are (division, square root, min, max); ``step ** beta2_decay`` is the device's ``pow`` (within an ulp of
    the host's), and ``param.add_(update, alpha=-alpha / denom)`` becomes a multiply-add by the float32
    value that alpha rounds to. So the bits are torch's but for those two roundings (docs/optimizers.md)."""
    if isinstance(lr, torch.Tensor):
        lr = float(lr)
    if maximize:
        grad = -grad
    if eps1 is None:
        eps1 = torch.finfo(param.dtype).eps
    count = step.double()
    one_minus_beta2_t = count.pow(beta2_decay).float()
    rho_t = count.sqrt().reciprocal().clamp(max=lr)  # min(lr, 1 / step ** 0.5)
    alpha = (param.norm(2).double() / (param.numel() ** 0.5)).clamp(min=eps2).mul(rho_t)
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    if grad.dim() > 1:
        row_var, col_var = kept["row_var"], kept["col_var"]
        row_mean = torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
        row_var.lerp_(row_mean, one_minus_beta2_t)
        col_mean = torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
        col_var.lerp_(col_mean, one_minus_beta2_t)
        var_estimate = row_var @ col_var
        var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    else:
        variance = kept["variance"]
        variance.lerp_(grad * grad, one_minus_beta2_t)
        var_estimate = variance.clone()
    update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
    update.mul_(grad)
    denom = (update.norm(2).double() / ((update.numel() ** 0.5) * d)).clamp(min=1.0)
    param.addcmul_(update, alpha.neg().div(denom).float())


ADAFACTOR = declaration(SPEC, AdafactorAlgorithm,
                        "row_var, col_var of a matrix, variance of a vector; step: on every rank", "-",
                        "torch's own update on each parameter whole, on every rank")

__all__ = ["ADAFACTOR", "SPEC", "AdafactorAlgorithm", "device_step"]
