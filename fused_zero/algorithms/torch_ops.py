"""The update of the Triton kernels written with torch's own CPU ops, one call per row.

This is the fast path for CPU tensors (the Triton interpreter is a correctness tool, hundreds of times
slower). It reads the same rows and the same float32 coefficient table, and calls the very ops
torch.optim's single-tensor implementations call, with the same Python scalars, so its results are
the ones torch.optim computes, element for element. Moments stored in bf16 or 8 bits are decoded to
fp32 before those ops and encoded after them (codecs.py), as the kernels do. Rows go in merged runs;
with 8-bit moments or stochastic rounding the runs are merged from the kernels' own rows, each a block
whose scale is reduced on its own (``encode_blocks``), and runs of stochastically rounded weights keep
to one parameter, whose element indices draw the bits.
"""

from __future__ import annotations

import torch

from ..kernels import ADAM_COEFS, SGD_COEFS
from .codecs import SIGNED, decode, encode_blocks, round_stochastic

_ADAM = {name: i for i, name in enumerate(ADAM_COEFS)}
_SGD = {name: i for i, name in enumerate(SGD_COEFS)}


def _grad(args, go: int, n: int, grad_div: float, maximize: bool) -> tuple[torch.Tensor, bool]:
    """The row's gradient as the update reads it (divided, unscaled, clipped, negated), and whether it
    is a tensor of its own (else a view of the reduced buffer, which nothing may write).

    The updates only read it, so an fp32 gradient is not copied: the first op that changes it writes
    a new tensor, the later ones write that one in place: the values of a copy changed in place,
    without the copy's pass over memory."""
    g = args.grad[go:go + n]
    owned = g.dtype != torch.float32
    if owned:
        g = g.to(torch.float32)
    for op, value in ((torch.div, grad_div if grad_div != 1.0 else None),
                      (torch.div, None if args.grad_scale is None else args.grad_scale.to(torch.float32)),
                      (torch.mul, None if args.clip_coef is None else args.clip_coef.to(torch.float32))):
        if value is not None:
            g = op(g, value, out=g) if owned else op(g, value)
            owned = True
    if maximize:
        g, owned = (g.neg_() if owned else g.neg()), True
    return g, owned


def _add(g: torch.Tensor, owned: bool, other: torch.Tensor, alpha: float) -> tuple[torch.Tensor, bool]:
    """``g + alpha * other``, in place where ``g`` is a tensor of its own (see ``_grad``)."""
    return (g.add_(other, alpha=alpha) if owned else g.add(other, alpha=alpha)), True


def merged_runs(rows, table: list[list[float]]):
    """Rows back to back in all three buffers with equal coefficients, merged into one run each.

    A region holds its parameters back to back, so a bucket whose parameters share a param group and
    a step count is a handful of runs: the per-op cost is paid per run, not per parameter. Elementwise
    results do not depend on where a run is cut.
    """
    runs = []
    for so, n, po, go, pid, *_ in rows:
        if runs:
            rso, rn, rpo, rgo, rpid = runs[-1]
            if so == rso + rn and po == rpo + rn and go == rgo + rn and table[pid] == table[rpid]:
                runs[-1] = (rso, rn + n, rpo, rgo, rpid)
                continue
        runs.append((so, n, po, go, pid))
    return runs


def block_runs(rows, table: list[list[float]], stochastic: bool):
    """The kernels' rows (blocks: ``codecs.BlockTable.rows``) merged as ``merged_runs`` merges pieces,
    with what 8-bit moments and stochastic rounding need: ``(so, n, po, go, pid, elem, first, k)``,
    ``elem`` the first element's index in its parameter, ``first`` / ``k`` the run's first block and
    its number of blocks (consecutive rows of the table). With stochastic rounding a run stays within
    one parameter."""
    runs = []
    for so, n, po, go, pid, elem, block in rows:
        if runs:
            rso, rn, rpo, rgo, rpid, relem, first, k = runs[-1]
            if (so == rso + rn and po == rpo + rn and go == rgo + rn and table[pid] == table[rpid]
                    and (not stochastic or (pid == rpid and elem == relem + rn))):
                runs[-1] = (rso, rn + n, rpo, rgo, rpid, relem, first, k + 1)
                continue
        runs.append((so, n, po, go, pid, elem, block, 1))
    return runs


class _Moments:
    """One run's moments as fp32 working tensors (views of fp32 storage, decoded copies otherwise),
    and their storing back (8-bit: each of the run's blocks with its own scale). The run's slots'
    blocks are a view of the table's cached ``slots`` (codecs.BlockTable): nothing is built per step."""

    def __init__(self, args, so: int, n: int, first: int, k: int):
        self.args, self.so, self.n = args, so, n
        if args.scales:
            self.first, self.k = first, k
            self.block = args.blocks.slots()[so:so + n]  # global block numbers, first .. first + k - 1

    def get(self, name: str) -> torch.Tensor:
        t = self.args.state[name][self.so:self.so + self.n]
        if t.dtype == torch.float32:
            return t
        if t.dtype == torch.bfloat16:
            return t.float()
        return decode(t, SIGNED[name]) * self.args.scales[name].index_select(0, self.block)

    def put(self, name: str, x: torch.Tensor) -> None:
        t = self.args.state[name][self.so:self.so + self.n]
        if t.dtype == torch.bfloat16:
            t.copy_(x)  # round to nearest even
        elif t.dtype == torch.uint8:
            codes, scales = encode_blocks(x, self.block, self.args.blocks.count, SIGNED[name])
            t.copy_(codes)
            lo, hi = self.first, self.first + self.k
            self.args.scales[name][lo:hi] = scales[lo:hi]  # the others are 0: blocks of other runs


def working_weights(master: torch.Tensor | None, so: int, param: torch.Tensor, po: int, n: int) -> torch.Tensor:
    """A piece's fp32 weights as an update works on them: the masters' slots ``[so, so + n)`` where there
    are masters, else the parameters' ``[po, po + n)``: themselves in fp32, an fp32 copy otherwise (the
    caller rounds it back into the parameters)."""
    if master is not None:
        return master[so:so + n]
    p = param[po:po + n]
    return p if p.dtype == torch.float32 else p.float()


def apply(row, rows, coefs: torch.Tensor, args) -> None:
    """One launch on the torch backend: ``row(args, coefs, p, moments, n, go)`` (``adam_row``, ``sgd_row``, with
    the algorithm's flags) over each active run of ``rows``, its weights rounded back into the parameters."""
    if args.found_inf is not None and float(args.found_inf) != 0.0:
        return
    table = coefs.tolist()
    master = args.state.get("master")
    blockwise = bool(args.scales) or args.stochastic
    units = block_runs(args.blocks.rows, table, args.stochastic) if blockwise else \
        [(*run, 0, 0, 0) for run in merged_runs(rows, table)]
    keys = coefs[:, -1].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF if args.stochastic else None
    for so, n, po, go, pid, elem, first, k in units:
        coef = table[pid]
        if coef[0] == 0.0:  # inactive: no gradient this step
            continue
        p = working_weights(master, so, args.param, po, n)
        moments = _Moments(args, so, n, first, k)
        row(args, coef, p, moments, n, go)
        if args.stochastic:
            args.param[po:po + n].copy_(round_stochastic(
                p, int(keys[pid]), torch.arange(elem, elem + n, dtype=torch.int64, device=p.device)))
        elif master is not None or args.param.dtype != torch.float32:
            args.param[po:po + n].copy_(p)


def adam_row(args, coefs, p, moments, n, go, maximize, amsgrad):
    """torch.optim's single-tensor Adam/AdamW, op for op, with its temporaries reused: the L2 term
    added in place into a gradient of its own, the denominator computed into that gradient's memory
    once the moments no longer read it, and divided in place (torch's ``v.sqrt() / bc`` writes a
    second temporary). Each op computes what torch's computes, so the values are torch's; what is
    saved is one or two fresh temporaries of the row's size per step, which glibc's malloc hands back
    to the system at these sizes (mmap, or a trim of the heap's top) and faults in anew at the next
    step: 4.2M elements on one core, about 10 ms here against 13-23 ms for torch's AdamW step.
    ``moments`` reads and writes the moments in their storage format (algorithms/codecs.py)."""
    g, owned = _grad(args, go, n, coefs[_ADAM["grad_div"]], maximize)
    m = moments.get("exp_avg")
    v = moments.get("exp_avg_sq")
    if coefs[_ADAM["decay_mul"]] != 1.0:
        p.mul_(coefs[_ADAM["decay_mul"]])
    if coefs[_ADAM["l2"]] != 0.0:
        g, owned = _add(g, owned, p, coefs[_ADAM["l2"]])
    m.lerp_(g, coefs[_ADAM["lerp_w"]])
    v.mul_(coefs[_ADAM["beta2"]]).addcmul_(g, g, value=coefs[_ADAM["one_minus_beta2"]])
    if amsgrad:
        vmax = moments.get("max_exp_avg_sq")
        torch.maximum(vmax, v, out=vmax)
        moments.put("max_exp_avg_sq", vmax)
    root = vmax if amsgrad else v
    denom = torch.sqrt(root, out=g) if owned else root.sqrt()  # g is not read after this
    denom.div_(coefs[_ADAM["bc2_sqrt"]]).add_(coefs[_ADAM["eps"]])
    p.addcdiv_(m, denom, value=coefs[_ADAM["neg_step_size"]])
    moments.put("exp_avg", m)
    moments.put("exp_avg_sq", v)


def sgd_row(args, coefs, p, moments, n, go, maximize, nesterov):
    g, owned = _grad(args, go, n, coefs[_SGD["grad_div"]], maximize)
    if coefs[_SGD["weight_decay"]] != 0.0:  # in place into a gradient of its own (see adam_row)
        g, owned = _add(g, owned, p, coefs[_SGD["weight_decay"]])
    if "momentum_buffer" in args.state:
        buf = moments.get("momentum_buffer")
        if coefs[_SGD["first"]] != 0.0:
            buf.copy_(g)
        else:
            buf.mul_(coefs[_SGD["momentum"]]).add_(g, alpha=coefs[_SGD["one_minus_dampening"]])
        moments.put("momentum_buffer", buf)
        g = _add(g, owned, buf, coefs[_SGD["momentum"]])[0] if nesterov else buf
    p.add_(g, alpha=coefs[_SGD["neg_lr"]])


def grad_sumsq(rows, coefs: torch.Tensor, grad: torch.Tensor, grad_scale: torch.Tensor | None):
    """Same contract as kernels.grad_sumsq.

    Every step runs this (the non-finite check), so the common case is one vectorized norm per run
    (about the cost of a copy); only when some norm is not finite does it count element by element,
    telling infs and NaNs apart from finite values whose squares overflow fp32.
    """
    table = coefs.tolist()
    runs = [r for r in merged_runs(rows, table) if table[r[4]][0] != 0.0]
    if not runs:
        return torch.zeros((), dtype=torch.float32, device=coefs.device), \
            torch.zeros((), dtype=torch.float32, device=coefs.device)
    scale = 1.0 if grad_scale is None else float(grad_scale)
    norms = torch.stack([torch.linalg.vector_norm(grad[go:go + n], dtype=torch.float32) for _, n, _, go, _ in runs])
    norms = norms / torch.tensor([table[pid][1] * scale for *_, pid in runs], dtype=torch.float32, device=coefs.device)
    if bool(torch.isfinite(norms).all()):
        return (norms * norms).sum(), torch.zeros((), dtype=torch.float32, device=coefs.device)
    sumsq = torch.zeros((), dtype=torch.float32, device=coefs.device)
    bad = torch.zeros((), dtype=torch.float32, device=coefs.device)
    for _, n, _, go, pid in runs:
        g = grad[go:go + n].float() / table[pid][1]
        if grad_scale is not None:
            g = g / grad_scale.float()
        finite = g.isfinite()
        sumsq += torch.where(finite, g * g, 0.0).sum()
        bad += (~finite).sum()
    return sumsq, bad
