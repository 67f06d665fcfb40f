"""Training scenarios run on every rank: fused_zero next to DDP + the same torch.optim class.

A scenario trains two copies of one model on the same data, step by step: the reference under
plain DDP with torch.optim (with fp32 master copies for bf16 models, as mixed-precision training
does it), ours under DDP with a fused_zero optimizer. After every step it compares every parameter
of every rank with the reference, and every rank's parameters with rank 0's.

What "agree" means (``_compare``): fp32 with torch's ops as the update (the CPU default) is
bit-identical to torch.optim wherever the reductions add in the same order as DDP's (``exact``); the
Triton kernels under the interpreter agree to 2e-5 relative; bf16 parameters agree to a few bf16 ulps
per element and differ at all on few elements (``_compare_low`` says why that catches a skipped step).

With ``param_sync="forward"`` the all-gathers are held back (``held_gathers``): their data lands only
when the Work is waited for, as a slow network would make it, and only every other step ends with
``synchronize()`` (to compare the parameters); on the others the next forward's pre-hooks alone
must wait, and the losses, compared every step, show whether they did.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.algorithms import registry

VOCAB, DIM, HIDDEN = 13, 7, 33


class OddNet(nn.Module):
    """Odd parameter sizes (so slices cut parameters and buckets have tails), a tied weight, a
    branch used only on some steps and ranks, and a parameter no step uses."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.l1 = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.l2 = nn.Linear(HIDDEN, DIM)
        self.branch = nn.Linear(DIM, DIM)
        self.never = nn.Linear(3, 5)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # weight tying

    def forward(self, x, use_branch: bool = False):
        h = self.emb(x)
        h = h + self.l2(torch.tanh(self.norm(self.l1(h))))
        if use_branch:  # the branch may be kept in fp32 in a bf16 model (its own DDP bucket dtype)
            h = h + self.branch(h.to(self.branch.weight.dtype)).to(h.dtype)
        return self.head(h)


def twin_models(device="cpu", dtype=torch.float32, freeze_never=True) -> tuple[OddNet, OddNet]:
    """Two OddNets with the same weights (seed 1234) on ``device``: ours and torch.optim's reference;
    ``freeze_never``: the layer no step uses frozen, as DDP without find_unused_parameters needs."""
    torch.manual_seed(1234)
    model, ref = OddNet(), OddNet()
    ref.load_state_dict(model.state_dict())
    for m in (model, ref):
        if freeze_never:
            m.never.requires_grad_(False)
        m.to(device=device, dtype=dtype)
    return model, ref


@dataclass(frozen=True)
class Case:
    opt: str = "AdamW"
    kwargs: dict = field(default_factory=dict)
    overlap: str = "bucket"
    grad_reduce: str = "reduce_scatter"
    bucket_cap_mb: float = 25.0
    groups: int = 1
    dtype: torch.dtype = torch.float32
    graph: str = "plain"  # plain | static | find_unused
    as_view: bool = True
    steps: int = 12
    accumulate: int = 1  # micro-batches per step; all but the last under no_sync()
    nanogpt_accumulate: bool = False  # accumulate with require_backward_grad_sync instead
    scheduler: bool = True
    max_grad_norm: float | None = None
    backend: str = "torch"
    param_sync: str = "step"  # "forward": only the forward pre-hooks wait for the all-gathers
    fp32_branch: bool = False  # mixed dtypes: keep the branch in fp32 in a bf16 model
    breaks: tuple | None = None  # test of the checks: ("skip" | "double", step, parameter name)
    master: bool | None = None  # master_weights=; False: 16-bit parameters updated without an fp32 copy
    shard: int | str | None = None  # shard_group=: an int, "group:S" (a ProcessGroup), "mesh:S" (a 2-D DeviceMesh)
    reduce_dtype: torch.dtype | None = None  # grad_reduce_dtype=; the reference uses DDP's compression hook
    plan: str = "auto"  # "nccl": NCCL's reduce-scatter plan forced on gloo (collectives.py)

    def name(self) -> str:
        return (f"{self.opt}{self.kwargs or ''}-{self.overlap}-{self.grad_reduce}-cap{self.bucket_cap_mb}-"
                f"g{self.groups}-{str(self.dtype)[6:]}-{self.graph}-view{int(self.as_view)}-acc{self.accumulate}"
                f"{'-nanogpt' if self.nanogpt_accumulate else ''}-clip{self.max_grad_norm}-{self.backend}"
                f"-sync{self.param_sync}{'-fp32branch' if self.fp32_branch else ''}"
                f"{f'-breaks{self.breaks}' if self.breaks else ''}{'-nomaster' if self.master is False else ''}"
                f"{f'-shard{self.shard}' if self.shard is not None else ''}"
                f"{f'-reduce{str(self.reduce_dtype)[6:]}' if self.reduce_dtype else ''}"
                f"{f'-plan{self.plan}' if self.plan != 'auto' else ''}")


DEFAULT_HPARAMS = {d.name: dict(d.test) for d in registry.DECLARATIONS}
"""Each optimizer's hyperparameters in the tests, as it declares them (fused_zero/algorithms/registry.py):
each with its options that change the update on (weight decay, momentum, centering, a nonzero start)."""

CONSTRUCTOR_ONLY = {d.name: d.constructor_only for d in registry.DECLARATIONS if d.constructor_only}
"""Hyperparameters torch.optim reads from its constructor only: Adagrad fills its accumulator with the
constructor's ``initial_accumulator_value`` when it is built, and a param group's key of that name is
ignored. ``param_groups`` leaves them out; ``constructor_kwargs`` gives them to the constructors."""


def constructor_kwargs(kind: str, case: Case | None = None) -> dict:
    """The hyperparameters of ``kind`` (a case's, with its ``kwargs``) that go to the constructor."""
    base = {**DEFAULT_HPARAMS[kind], **(case.kwargs if case is not None and case.opt == kind else {})}
    return {k: base[k] for k in CONSTRUCTOR_ONLY.get(kind, ()) if k in base}


def param_groups(model: nn.Module, case: Case):
    base = {k: v for k, v in {**DEFAULT_HPARAMS[case.opt], **case.kwargs}.items()
            if k not in CONSTRUCTOR_ONLY.get(case.opt, ())}
    if case.groups == 1:
        return [{"params": list(model.parameters()), **base}]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, **base}, {"params": rest, **base, "lr": base["lr"] * 0.3, "weight_decay": 0.0}]


def muon_split(model: nn.Module, case: Case) -> list[tuple[str, list]]:
    """``opt="Muon"``: Muon over the matrices but the (tied) embedding, as Muon's users split a model,
    in ``case.groups`` param groups (the second at 0.3 times the lr); AdamW over the rest, as
    DEFAULT_HPARAMS["AdamW"]."""
    base = {**DEFAULT_HPARAMS["Muon"], **case.kwargs}
    mats = [p for n, p in model.named_parameters() if p.dim() == 2 and n != "emb.weight"]
    rest = [p for n, p in model.named_parameters() if p.dim() != 2 or n == "emb.weight"]
    muon = [{"params": mats, **base}] if case.groups == 1 else \
        [{"params": mats[:2], **base}, {"params": mats[2:], **base, "lr": base["lr"] * 0.3}]
    return [("Muon", muon), ("AdamW", [{"params": rest, **DEFAULT_HPARAMS["AdamW"]}])]


class Optimizers:
    """Several optimizers over one model stepped as one (Muon beside AdamW): ``param_groups`` are all
    of theirs (the scenarios' lr schedule scales each), the rest is the first one's (the engine is
    theirs together)."""

    def __init__(self, opts: list):
        self.opts = opts

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.opts for g in o.param_groups]

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad()

    def state_dict(self, **kwargs) -> list:
        return [o.state_dict(**kwargs) for o in self.opts]

    def load_state_dict(self, state_dicts: list) -> None:
        for o, sd in zip(self.opts, state_dicts, strict=True):
            o.load_state_dict(sd)

    def sharded_state_dict(self) -> dict:
        return {str(i): o.sharded_state_dict() for i, o in enumerate(self.opts)}

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        for i, o in enumerate(self.opts):
            o.load_sharded_state_dict(state_dict[str(i)])

    def __getattr__(self, name):
        return getattr(self.opts[0], name)


def optimizer_groups(model: nn.Module, case: Case) -> list[tuple[str, list]]:
    """``(class name, param groups)`` of each optimizer a case builds over ``model``."""
    return muon_split(model, case) if case.opt == "Muon" else [(case.opt, param_groups(model, case))]


def build(case: Case, rank: int):
    torch.manual_seed(1234)
    model = OddNet().to(case.dtype)
    ref_model = OddNet().to(case.dtype)
    ref_model.load_state_dict(model.state_dict())
    if case.graph == "plain":  # DDP without find_unused needs every trainable parameter used: freeze it
        for m in (model, ref_model):
            m.never.requires_grad_(False)
    if case.fp32_branch:
        for m in (model, ref_model):
            m.branch.float()
    ddp_kw = dict(bucket_cap_mb=case.bucket_cap_mb, gradient_as_bucket_view=case.as_view,
                  static_graph=case.graph == "static", find_unused_parameters=case.graph == "find_unused")
    ddp = DDP(model, **ddp_kw)
    ref_ddp = DDP(ref_model, **ddp_kw)
    if case.reduce_dtype is not None:  # DDP's own compression: cast, divide by W, all-reduce, copy back
        ref_ddp.register_comm_hook(None, compress_hook(case.reduce_dtype))
    options = dict(ddp=ddp, overlap=case.overlap, grad_reduce=case.grad_reduce, max_grad_norm=case.max_grad_norm,
                   _backend=case.backend, param_sync=case.param_sync, master_weights=case.master,
                   shard_group=shard_group(case.shard), grad_reduce_dtype=case.reduce_dtype)
    with forced_plan(case.plan):
        opts = [getattr(fused_zero, kind)(groups, **constructor_kwargs(kind, case), **options)
                for kind, groups in optimizer_groups(model, case)]
    ref_params = list(ref_model.parameters())
    masters = None
    ref_groups = optimizer_groups(ref_model, case)
    if case.dtype != torch.float32:  # mixed precision: torch.optim on fp32 master copies
        masters = [p.detach().float().requires_grad_(True) for p in ref_params]
        index = {id(p): i for i, p in enumerate(ref_params)}
        for _, groups in ref_groups:
            for g in groups:
                g["params"] = [masters[index[id(p)]] for p in g["params"]]
    ref_opts = [getattr(torch.optim, kind)(groups, **constructor_kwargs(kind, case),
                                           **({} if kind == "Muon" else {"foreach": False}))
                for kind, groups in ref_groups]
    if len(opts) == 1:
        return model, ddp, opts[0], ref_model, ref_ddp, ref_opts[0], masters
    return model, ddp, Optimizers(opts), ref_model, ref_ddp, Optimizers(ref_opts), masters


def compress_hook(dtype: torch.dtype):
    """DDP's ``bf16_compress_hook`` / ``fp16_compress_hook``, called unchanged. ``register_comm_hook``
    refuses a hook named ``bf16_compress_hook`` unless NCCL 2.10+ is there, a check by name only: gloo
    sums bf16 on the CPU, and the hook runs there as written."""
    hook = {torch.bfloat16: default_hooks.bf16_compress_hook, torch.float16: default_hooks.fp16_compress_hook}[dtype]

    def ddp_compress_hook(state, bucket):
        return hook(state, bucket)
    return ddp_compress_hook


@contextlib.contextmanager
def forced_plan(plan: str):
    """``plan="nccl"``: build the optimizer with NCCL's reduction plan (reduce-scatter in the shard group,
    all-reduce across replicas) on gloo, whose own plan is one all-reduce (collectives.py)."""
    from fused_zero.pipeline.comm import collectives

    real = collectives.all_reduce_replaces_reduce_scatter
    if plan == "nccl":
        collectives.all_reduce_replaces_reduce_scatter = lambda group, device: False
    try:
        yield
    finally:
        collectives.all_reduce_replaces_reduce_scatter = real


def shard_group(spec):
    """The ``shard_group=`` option a Case names: None, an int, or a ProcessGroup / DeviceMesh of S
    consecutive ranks made here (a collective of every rank)."""
    if spec is None or isinstance(spec, int):
        return spec
    kind, size = spec.split(":")
    size, world = int(size), dist.get_world_size()
    if kind == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", (world // size, size))
    groups = [dist.new_group(list(range(i, i + size))) for i in range(0, world, size)]
    return groups[dist.get_rank() // size]


def batch(step: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(step * 1000 + micro * 10 + rank)
    x = torch.randint(0, VOCAB, (4, 5), generator=g)
    return x, torch.randint(0, VOCAB, (4, 5), generator=g)


def use_branch(case: Case, step: int, rank: int) -> bool:
    if case.graph == "find_unused":
        return (step + rank) % 3 == 0  # some steps: on one rank only; some: on none
    return case.graph == "plain"  # plain DDP needs every parameter used: branch always on


def loss_of(ddp, case, step, micro, rank):
    x, y = batch(step, micro, rank)
    logits = ddp(x, use_branch=use_branch(case, step, rank))
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


class _HeldGather:
    """An all-gather whose result reaches the parameters only when it is waited for."""

    def __init__(self, out: torch.Tensor, staged: torch.Tensor):
        self.out, self.staged = out, staged

    def wait(self, timeout=None):
        self.out.copy_(self.staged)
        return True


@contextlib.contextmanager
def held_gathers():
    """Make fused_zero's all-gathers land only at ``wait()``: the collective runs into a staging
    buffer, so until the wait the parameters hold stale values outside this rank's own slice, and a
    forward that reads them without waiting computes a wrong loss instead of winning a race."""
    from fused_zero.pipeline.comm import collectives

    real = collectives.all_gather

    def all_gather(out, inp, group, async_op=True):
        staged = torch.empty_like(out)
        real(staged, inp, group, async_op=False)
        return _HeldGather(out, staged)

    collectives.all_gather = all_gather
    try:
        yield
    finally:
        collectives.all_gather = real


@contextlib.contextmanager
def _broken_update(case: Case, opt, model, step_of):
    """For ``case.breaks``: skip or repeat, at one step, the update of one parameter (and of no other:
    its bucket may hold parameters whose values make a lost step easy to see). Torch backend: the rows
    passed are the ones updated."""
    if case.breaks is None:
        yield
        return
    assert case.backend == "torch"
    how, at, name = case.breaks
    engine = opt._engine
    pid = engine.pid_of[dict(model.named_parameters())[name]]
    algo = engine.members[0].algo
    real = algo.apply

    def update(backend, rows, segments, coefs, args):
        if step_of() != at or not any(r[4] == pid for r in rows):
            return real(backend, rows, segments, coefs, args)
        real(backend, [r for r in rows if r[4] != pid] if how == "skip" else rows, segments, coefs, args)
        if how == "double":
            real(backend, [r for r in rows if r[4] == pid], segments, coefs, args)

    algo.apply = update
    try:
        yield
    finally:
        algo.apply = real


def run_case(case: Case, rank: int, world: int) -> dict:
    model, ddp, opt, ref_model, ref_ddp, ref_opt, masters = build(case, rank)
    lr0 = [g["lr"] for g in opt.param_groups]
    worst, changes, step = 0.0, [], 0
    held = held_gathers() if case.param_sync == "forward" else contextlib.nullcontext()
    try:
        with held, _broken_update(case, opt, model, lambda: step):
            for step in range(1, case.steps + 1):
                _train_step(case, step, rank, lr0, (ddp, opt), (ref_ddp, ref_opt), ref_model, masters)
                changes.append(opt._engine.layout_changes)
                # param_sync="forward": on odd steps nothing waits but the next forward's pre-hooks
                if case.param_sync == "forward" and step % 2 and step != case.steps:
                    continue
                opt.synchronize()
                worst = max(worst, _compare(model, ref_model, case, step, rank, world))
                _check_ranks_agree(model, step)
        if case.opt in (*fused_zero.optimizer.TWINS, "Adafactor"):  # their state too (AdamW's: tests/checkpoint)
            _compare_state(opt, ref_opt, rank, _exact(case, world) and case.dtype == torch.float32)
    except AssertionError as e:
        if case.breaks is None:
            raise
        return {"detected": str(e).splitlines()[0], "layout_changes": changes[-1] if changes else 0,
                "layout_history": changes}
    finally:
        opt._engine.close()
    # layout_changes: how many times the state moved; layout_history: the count after each step
    buckets = len([i for i in opt._engine.registry.by_index if i >= 0])  # DDP's, as the hook saw them
    layouts = [(s.layout.numel, s.layout.world_size, s.layout.tail, s.layout.region_size)
               for s in opt._engine.shards()]  # what this rank holds (test_sharding: 1/S of the state)
    return {"worst": worst, "layout_changes": changes[-1], "layout_history": changes, "buckets": buckets,
            "memory": opt.memory(), "layouts": layouts}


def _train_step(case, step, rank, lr0, ours, reference, ref_model, masters):
    lr_scale = 1.0 + 0.5 * math.cos(step) if case.scheduler else 1.0
    for o in (ours[1], reference[1]):
        for g, base in zip(o.param_groups, lr0):
            g["lr"] = base * lr_scale
    losses = []
    for which, (d, o) in enumerate((reference, ours)):
        total = 0.0
        for micro in range(case.accumulate):
            last = micro == case.accumulate - 1
            if case.nanogpt_accumulate:
                d.require_backward_grad_sync = last
                loss = loss_of(d, case, step, micro, rank)
                loss.backward()
            else:
                with d.no_sync() if not last else contextlib.nullcontext():
                    loss = loss_of(d, case, step, micro, rank)
                    loss.backward()
            total += float(loss.detach())
        losses.append(total)
        if which == 0:
            _reference_step(ref_model, o, masters, case)
        else:
            o.step()
            o.zero_grad()
    ref_loss, loss = losses
    # the loss shows what the forward read: with param_sync="forward", whether the pre-hooks waited
    if case.dtype == torch.float32:
        ok = loss == ref_loss if case.backend == "torch" and _exact(case, dist.get_world_size()) else \
            math.isclose(loss, ref_loss, rel_tol=1e-5 if case.reduce_dtype is None else 1e-3)
    else:
        ok = math.isclose(loss, ref_loss, rel_tol=1e-2)
    assert ok, f"rank {rank} step {step}: loss {loss!r} != torch.optim's {ref_loss!r}"


def _reference_step(ref_model, ref_opt, masters, case):
    params = list(ref_model.parameters())
    if case.max_grad_norm is not None:
        grads = [p for p in params if p.grad is not None]
        if masters is None:
            torch.nn.utils.clip_grad_norm_(grads, case.max_grad_norm)
    if masters is not None:
        for p, m in zip(params, masters):
            m.grad = None if p.grad is None else p.grad.float()
        if case.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([m for m in masters if m.grad is not None], case.max_grad_norm)
        ref_opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
                if case.master is False:  # no master: the next step starts from the rounded weight
                    m.copy_(p)
    else:
        ref_opt.step()
    ref_opt.zero_grad()
    for p in params:
        p.grad = None


def _exact(case: Case, world: int) -> bool:
    """Whether fp32 parameters must be bit-identical to torch.optim's: torch's ops do the update, at
    one or two ranks. Beyond, a reduce-scatter (NCCL's plan, forced on gloo) adds in another order than
    DDP's all-reduce; gloo's own plan is an all-reduce of the bucket as DDP's, but fused_zero and DDP
    divide fp32 sums by W at different points, which rounds unless W is a power of two (so both plans
    at four ranks stay exact on gloo's). Gradients reduced in 16 bits are divided before the sum, as
    DDP's compression hook divides them (cast, divide, sum): on gloo's plan that is the hook's very
    arithmetic at any W, three included. Clipping's global norm is summed in another order than
    clip_grad_norm_'s, so its coefficient may differ in the last bit."""
    if case.backend != "torch" or case.max_grad_norm is not None:
        return False
    # gloo's own plan is DDP's all-reduce (the same tensor, the same group, the same order of sums), and
    # so is any plan with shard groups of one rank
    same_sums = case.plan == "auto" or case.grad_reduce == "all_reduce" or case.shard == 1
    if case.reduce_dtype is not None:
        return world <= 2 or same_sums
    return world <= 2 or (same_sums and world & (world - 1) == 0)


BF16_ULPS = 4
"""Largest difference of a bf16 parameter, in bf16 ulps of torch.optim's value."""
BF16_SHARE = 0.05
"""Largest share of a parameter's elements that may differ from torch.optim's at all (at least two
elements may, whatever the parameter's size: 33 elements at 5% would allow one)."""


def _compare(model, ref_model, case, step, rank, world=None) -> float:
    world = dist.get_world_size() if world is None else world
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        a, b = p.detach().float(), q.detach().float()
        msg = f"rank {rank} step {step} {name}"
        if p.dtype == torch.bfloat16:
            _compare_low(a, b, msg, torch.bfloat16)
        elif _exact(case, world):
            assert torch.equal(a, b), f"{msg}: not bit-identical, largest difference {_largest(a, b):.3e}"
        elif case.reduce_dtype is not None:
            _compare_reduced(a, b, msg, case, step)
        else:
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=lambda m, msg=msg: f"{msg}: {m}")
        worst = max(worst, _largest(a, b))
    return worst


REDUCED_ULPS = 2
"""Largest difference per step, in 16-bit ulps of the update (``_compare_reduced``)."""


def _compare_reduced(a: torch.Tensor, b: torch.Tensor, msg: str, case: Case, step: int) -> None:
    """fp32 parameters whose gradients were reduced in 16 bits, where the sums run in another order than
    DDP's compression hook (NCCL's plan beyond two ranks: the shard group's sum, then the replicas'). Each
    partial sum rounds to the 16-bit dtype, so a reduced gradient differs from the hook's by an ulp or
    two of it, and an update by as much of its size: Adam's step is at most about ``lr`` per element and
    SGD's ``lr`` times the gradient, so after ``step`` steps the parameters may differ by ``step x lr x
    REDUCED_ULPS x 2^-bits``, an eighth of one update at twelve steps: a skipped or doubled step (one
    whole update) still fails."""
    bits = 1 - int(math.log2(torch.finfo(case.reduce_dtype).eps))
    lr = DEFAULT_HPARAMS[case.opt]["lr"] * (1.5 if case.scheduler else 1.0)
    bound = step * lr * REDUCED_ULPS * 2.0 ** -bits
    worst = _largest(a, b)
    assert worst <= bound, f"{msg}: {worst:.3e} from torch.optim + DDP's compression hook (at most {bound:.3e})"


def _largest(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, NaN as infinitely far (Python's max() would drop it)."""
    if not a.numel():
        return 0.0
    return float(torch.nan_to_num((a - b).abs().max(), nan=math.inf))


def _compare_low(a: torch.Tensor, b: torch.Tensor, msg: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """bf16 (or fp16) parameters against torch.optim's (rounded from its fp32 masters).

    Beyond two ranks gloo's reduce-scatter adds bf16 gradients in another order than DDP's all-reduce,
    so a few elements differ in their last bits. A tolerance relative to the value (rtol 2**-6) is
    blind where it matters most: near 1 (LayerNorm weights) one bf16 ulp is 2**-7 = 0.0078, about
    one Adam step at lr 1e-2, so a skipped or doubled step passes. Hence two checks: every element
    within ``BF16_ULPS`` ulps of torch.optim's value (catches a wrong step on small values, where a
    step is many ulps), and at most ``BF16_SHARE`` of each parameter's elements differing at all
    (catches it on large values, where a step moves nearly every element by about an ulp).
    ``test_bf16_check_catches_a_skipped_or_doubled_step`` (parity) and
    ``test_bf16_check_catches_a_wrong_step_of_one_parameter`` (mixed precision) skip and double the step
    of a LayerNorm weight once and see both fail.
    """
    bits = 1 - int(math.log2(torch.finfo(dtype).eps))  # significand bits: 8 for bf16, 11 for fp16
    ulp = torch.ldexp(torch.ones_like(b), torch.frexp(b).exponent - bits).clamp_min(2.0 ** -24)
    diff = (a - b).abs()
    ulps = torch.nan_to_num(diff / ulp, nan=math.inf)
    assert not a.numel() or float(ulps.max()) <= BF16_ULPS, \
        f"{msg}: {float(ulps.max()):.1f} {dtype} ulps from torch.optim (at most {BF16_ULPS})"
    differing = int((diff != 0).sum())
    assert differing <= max(BF16_SHARE * a.numel(), 2), \
        f"{msg}: {differing} of {a.numel()} elements differ from torch.optim (at most {BF16_SHARE:.0%}, or 2)"


def _compare_state(opt, ref_opt, rank: int, exact: bool) -> None:
    """Every entry of torch.optim's state dict in ours (``step``, the tensors, the 0-dim scalars),
    gathered from every rank: bit for bit where the parameters are (``exact``), else within 1e-3
    relative (a skipped or doubled step is off by its whole size): with clipping the coefficient's last
    bit differs (``_exact``), and a centered RMSprop's ``square_avg - grad_avg ** 2`` cancels, which
    leaves a few elements of its momentum 1e-4 apart while the parameters, lr times that, stay within
    2e-5. An entry torch has and we do not only for a parameter without a gradient (Adagrad's state,
    made at construction, of the frozen layer); ours may add ``fp32_master``."""
    ours, ref = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    params = [p for g in opt.param_groups for p in g["params"]]  # the model's (torch's may be fp32 masters)
    for i, entry in ref.items():
        if i not in ours:
            assert not params[i].requires_grad, f"rank {rank}: no state for parameter {i}"
            continue
        for name, value in entry.items():
            assert name in ours[i], f"rank {rank} parameter {i}: no {name!r} in fused_zero's state"
            mine, where = ours[i][name].to(value.dtype), f"rank {rank} parameter {i} {name!r}"
            if exact:
                assert torch.equal(mine, value), f"{where}: differs by {_largest(mine.float(), value.float()):.3e}"
            else:
                torch.testing.assert_close(mine, value, rtol=1e-3, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
    assert set(ours) <= set(ref), f"rank {rank}: state for parameters torch.optim has none for"


def _check_ranks_agree(model, step):
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    for r, other in enumerate(gathered):
        assert torch.equal(other, gathered[0]), f"step {step}: rank {r} parameters differ from rank 0's"


def run_cases(rank: int, world: int, cases: list[Case]) -> list[tuple[str, dict]]:
    return [(c.name(), run_case(c, rank, world)) for c in cases]


__all__ = ["Case", "OddNet", "run_case", "run_cases"]
