"""Several optimizers over one DDP module, each torch.optim's own: it steps, scales, skips and zeroes on
its own, as torch.optim's independent optimizers do (the contract suite: conftest.py).

The patterns: a fused_zero optimizer over part of the module beside a torch.optim one over the rest (or
none, the rest updated by hand from DDP's averaged ``.grad``; also with gradients reduced in bf16, against
DDP's bf16_compress_hook); one GradScaler over two optimizers with torch's recipe (``unscale_`` of one, of
the other, of both, of neither, with a clip of the unscaled one's gradients); an overflow in one
optimizer's gradients only (it skips, the other steps), with a scaler and with on_nonfinite="raise";
``opt0.step(); opt0.zero_grad(set_to_none=False); opt1.step()``; an optimizer that does not step
every iteration; Muon built after AdamW; Muon groups that differ in momentum, nesterov and ns_steps.
Every overlap mode and reduction that honors the pattern, at 2 and 3 ranks; the modes that cannot honor
it refuse on every rank, naming the one that can.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from distributed import run_ranks
from harness import compare_state, exact, models, optimizer, ours_alone, refused, same, split, twin
from scenarios import compress_hook

MODES = [(o, r) for o in ("bucket", "backward", "step") for r in ("reduce_scatter", "all_reduce")]
SCALER_MODES = [m for m in MODES if m[0] != "bucket"]
HONORS_EDITS = ("step", "all_reduce")  # the mode whose update reads param.grad at step()
A = ("emb", "l1", "norm")  # the first optimizer's parameters (l1.weight's gradient overflows below)
MATRICES = ("l1.weight", "l2.weight", "branch.weight")  # Muon's, beside AdamW over the rest


def _two(kinds=("AdamW", "SGD"), names=A, **options):
    """``make`` for two optimizers of ``kinds`` over ``names`` and the rest, fused_zero's with ``options``
    (the GradScaler, where the loop has one, given to both)."""
    def make(model, ddp, fused, run):
        first, rest = split(model, names)
        opts = {}
        if fused and run.scaler is not None:
            opts["grad_scaler"] = run.scaler
        return [optimizer(kinds[0], first, fused, ddp=ddp, **options, **opts) if fused else
                optimizer(kinds[0], first, False),
                optimizer(kinds[1], rest, fused, ddp=ddp, **options, **opts) if fused else
                optimizer(kinds[1], rest, False)]
    return make


def _plain_loop(run, step):
    run.loss(step).backward()
    for o in run.opts:
        o.step()
    for o in run.opts:
        o.zero_grad()


# ---------------------------------------------------------------------- a fused_zero optimizer over part


def _part(rank, world, mode, rest, reduce_dtype=None):
    """fused_zero.AdamW over emb, l1 and norm; the rest: torch.optim.SGD's, or nobody's (updated by hand
    from DDP's averaged ``.grad``). ``reduce_dtype``: fused_zero's ``grad_reduce_dtype``, against DDP with
    its own compression hook (scenarios.compress_hook); the rest's ``.grad`` after every backward is
    compared too, bit for bit (the hook's very arithmetic on gloo's plan, at any W)."""
    overlap, reduce = mode

    def make(model, ddp, fused, run):
        mine, others = split(model, A)
        if fused:
            opt = optimizer("AdamW", mine, True, ddp=ddp, overlap=overlap, grad_reduce=reduce,
                            grad_reduce_dtype=reduce_dtype)
        else:
            opt = optimizer("AdamW", mine, False)
            if reduce_dtype is not None:
                ddp.register_comm_hook(None, compress_hook(reduce_dtype))
        run.keep["rest"] = others
        return [opt, optimizer("SGD", others, False)] if rest == "torch" else [opt]

    def loop(run, step):
        run.loss(step).backward()
        run.keep.setdefault("grads", []).append([p.grad.clone() for p in run.keep["rest"]])
        for o in run.opts:
            o.step()
        if rest == "by hand":
            with torch.no_grad():
                for p in run.keep["rest"]:
                    p.add_(p.grad, alpha=-0.05)
                    p.grad = None
        for o in run.opts:
            o.zero_grad()
    out = twin(rank, world, loop, make)
    for step, (ours, theirs) in enumerate(zip(out["keep"]["grads"], out["ref_keep"]["grads"]), start=1):
        for k, (g, h) in enumerate(zip(ours, theirs)):
            same(g, h, f"rank {rank} step {step}: .grad of the unowned parameter {k} after the backward",
                 exact() or reduce_dtype is not None)
    return "ok"


def _cases_part(rank, world):
    out = [(mode, rest, _part(rank, world, mode, rest)) for mode in MODES for rest in ("torch", "by hand")]
    # gradients reduced in bf16: the unowned parameters' .grad is still DDP's (compressed) average
    for overlap, rest in zip(("bucket", "backward", "step"), ("torch", "by hand", "torch")):
        mode = (overlap, "reduce_scatter")
        out.append((mode, f"{rest}, bf16 reduction", _part(rank, world, mode, rest, torch.bfloat16)))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_fused_optimizer_over_part_of_the_module(world):
    """Every mode, the rest torch.optim's or updated by hand; and with grad_reduce_dtype=torch.bfloat16
    (reduce_scatter) against DDP + its bf16_compress_hook: the rest's .grad is the hook's average."""
    for results in run_ranks(_cases_part, world):
        assert all(r == "ok" for *_, r in results), results


# ---------------------------------------------------------------------- one GradScaler, two optimizers


OVERFLOWS = {3: "l1.weight", 5: "l2.bias"}
"""Step -> the parameter whose gradient overflows then on the last rank: the first optimizer's (l1.weight,
in A and in MATRICES), then the second's (l2.bias, in neither)."""


def _scaler_loop(unscale: tuple[int, ...], clip: bool, overflows: dict[int, str] = OVERFLOWS):
    """torch's recipe for several optimizers and one scaler: ``unscale_`` of the optimizers in ``unscale``
    (a clip of their gradients after it), ``scaler.step`` of each, one ``update``. At each step of
    ``overflows`` the last rank's gradient of that parameter is an inf: its optimizer skips, the other
    steps, the scale halves. Kept: the scale before each ``update()`` and after it, and each optimizer's
    skipped steps so far (fused_zero's ``skipped_steps``; torch.optim's: the steps that left its
    parameters as they were)."""
    def loop(run, step):
        loss = run.loss(step)
        if step in overflows and run.rank == run.world - 1:
            weight = dict(run.ddp.module.named_parameters())[overflows[step]]
            handle = weight.register_hook(lambda g: g * float("inf"))
            run.scaler.scale(loss).backward()
            handle.remove()
        else:
            run.scaler.scale(loss).backward()
        for i in unscale:
            run.scaler.unscale_(run.opts[i])
            if clip:
                torch.nn.utils.clip_grad_norm_(run.params_of(i), 0.5)
        counts = run.keep.setdefault("skip_counts", [0] * len(run.opts))
        for i, o in enumerate(run.opts):
            before = None if run.fused else [p.detach().clone() for p in run.params_of(i)]
            run.scaler.step(o)
            if before is not None:
                counts[i] += all(torch.equal(a, p) for a, p in zip(before, run.params_of(i)))
        if run.fused:
            counts[:] = [o.skipped_steps for o in run.opts]
        run.keep.setdefault("skips", []).append(list(counts))
        run.keep.setdefault("scales", []).append(float(run.scaler.get_scale()))
        run.scaler.update()
        run.keep["scales"].append(float(run.scaler.get_scale()))
        for o in run.opts:
            o.zero_grad()
    return loop


RECIPES = {"unscale the first, clip it": ((0,), True), "unscale the second": ((1,), False),
           "unscale both": ((0, 1), False), "unscale neither": ((), False)}


def _scaler_case(rank, world, mode, recipe, kinds, names):
    overlap, reduce = mode
    unscale, clip = RECIPES[recipe]
    out = twin(rank, world, _scaler_loop(unscale, clip), _two(kinds, names, overlap=overlap, grad_reduce=reduce),
               scaler=True)
    assert out["keep"]["scales"] == out["ref_keep"]["scales"], \
        f"rank {rank}: the scale before and after each update(): {out['keep']['scales']}, torch's " \
        f"{out['ref_keep']['scales']}"
    # each optimizer skipped the steps torch's scaler skipped for it: its own overflow only
    assert out["keep"]["skips"] == out["ref_keep"]["skips"], \
        f"rank {rank}: each optimizer's skipped steps after each step: {out['keep']['skips']}, torch's " \
        f"{out['ref_keep']['skips']}"
    assert out["ref_keep"]["skips"][-1] == [1, 1], out["ref_keep"]["skips"]
    return "ok"


def _honors(mode, recipe) -> bool:
    """Whether ``mode`` honors the recipe: an unscale_ is an edit of ``.grad`` that only step +
    all_reduce reads (in overlap="backward" the update ran with the scale already, and the in-place
    unscale changes nothing it reads: only a clip after it is an edit)."""
    unscale, clip = RECIPES[recipe]
    if mode == HONORS_EDITS or not unscale:
        return True
    return mode[0] == "backward" and not clip


def _cases_scaler(rank, world, kinds, names):
    out = []
    for mode, recipe in itertools.product(SCALER_MODES, RECIPES):
        if _honors(mode, recipe):
            out.append((mode, recipe, _scaler_case(rank, world, mode, recipe, kinds, names)))
        else:
            out.append((mode, recipe, refused(lambda mode=mode, recipe=recipe: _scaler_case(
                rank, world, mode, recipe, kinds, names), "param.grad was changed .*overlap='step' with "
                "grad_reduce='all_reduce'")))
    return out


@pytest.mark.parametrize("world,kinds", [(2, ("AdamW", "SGD")), (3, ("Adam", "AdamW")), (2, ("Muon", "AdamW")),
                                         (2, ("Muon", "RMSprop")), (2, ("NAdam", "Adagrad")),
                                         (2, ("Adafactor", "AdamW"))])
def test_one_grad_scaler_two_optimizers_each_skips_its_own_overflow(world, kinds):
    """Each recipe in every mode with a scaler; an overflow in the first optimizer's gradients at step 3
    on one rank, in the second's at step 5: the one overflowed skips (on every rank), the other steps,
    the scale halves, as torch's docs say (the scale after every update(), each optimizer's skipped
    steps against the steps torch's scaler skipped for it)."""
    names = A if kinds[0] != "Muon" else MATRICES
    for results in run_ranks(_cases_scaler, world, kinds, names):
        bad = [r for r in results if r[2] != "ok" and "param.grad was changed" not in r[2]]
        assert not bad, bad


# ---------------------------------------------------------------------- on_nonfinite="raise", two optimizers


def _raise_loop(run, step):
    """At each step of OVERFLOWS one optimizer's gradient overflows on the last rank. fused_zero's with
    on_nonfinite="raise": that one raises in its ``step()`` (its step skipped, on every rank), the other
    steps. torch.optim's as a user guards them: an optimizer whose (DDP-averaged) gradients are not all
    finite is not stepped, and that is recorded as its raise. Kept: (step, optimizer) of every raise."""
    loss = run.loss(step)
    if step in OVERFLOWS and run.rank == run.world - 1:
        handle = dict(run.ddp.module.named_parameters())[OVERFLOWS[step]].register_hook(lambda g: g * float("inf"))
        loss.backward()
        handle.remove()
    else:
        loss.backward()
    raised = run.keep.setdefault("raised", [])
    for i, o in enumerate(run.opts):
        if run.fused:
            try:
                o.step()
            except FloatingPointError:
                raised.append((step, i))
        elif all(bool(torch.isfinite(p.grad).all()) for p in run.params_of(i) if p.grad is not None):
            o.step()
        else:
            raised.append((step, i))
    for o in run.opts:
        o.zero_grad()


def _cases_raise(rank, world, kinds):
    out = []
    for overlap, reduce in SCALER_MODES:  # a skip of the whole step (overlap="bucket" skips bucket by bucket)
        got = twin(rank, world, _raise_loop, _two(kinds, overlap=overlap, grad_reduce=reduce, on_nonfinite="raise"))
        assert got["keep"]["raised"] == got["ref_keep"]["raised"] == [(3, 0), (5, 1)], \
            f"rank {rank} {overlap}/{reduce}: raised at (step, optimizer) {got['keep']['raised']}, torch.optim's " \
            f"skips {got['ref_keep']['raised']}"
        out.append(((overlap, reduce), "ok"))
    return out


@pytest.mark.parametrize("world,kinds", [(2, ("AdamW", "SGD")), (3, ("Adagrad", "Adam"))])
def test_on_nonfinite_raise_raises_for_the_overflowed_optimizer_only(world, kinds):
    """on_nonfinite="raise" with two optimizers over one module: an overflow in the first optimizer's
    gradients at step 3 (on one rank), in the second's at step 5: the one overflowed raises, on every
    rank, and its step is skipped; the other steps as torch.optim's does (every parameter compared)."""
    for results in run_ranks(_cases_raise, world, kinds):
        assert all(r == "ok" for _, r in results), results


# ---------------------------------------------------------------------- zeroing between the steps


def _zero_between(rank, world, mode, kinds, as_view):
    overlap, reduce = mode

    def loop(run, step):
        run.loss(step).backward()
        run.opts[0].step()
        run.opts[0].zero_grad(set_to_none=False)
        run.opts[1].step()
        run.opts[1].zero_grad(set_to_none=False)
    twin(rank, world, loop, _two(kinds, A if kinds[0] != "Muon" else MATRICES, overlap=overlap, grad_reduce=reduce),
         ddp_kw={"gradient_as_bucket_view": as_view})
    return "ok"


@pytest.mark.parametrize("world,kinds", [(2, ("AdamW", "SGD")), (3, ("SGD", "Adam")), (2, ("Muon", "AdamW")),
                                         (2, ("ASGD", "Rprop"))])
def test_zeroing_one_optimizers_gradients_before_the_others_step(world, kinds):
    """``opt0.step(); opt0.zero_grad(set_to_none=False); opt1.step()``: each steps on its own gradients,
    in every mode, whether the gradients view DDP's buckets (then they share a version counter) or not."""
    for results in run_ranks(_cases_zero_between, world, kinds):
        assert all(r == "ok" for *_, r in results), results


def _cases_zero_between(rank, world, kinds):
    return [(mode, as_view, _zero_between(rank, world, mode, kinds, as_view)) for mode in MODES
            for as_view in (True, False)]


# ---------------------------------------------------------------------- an optimizer that skips iterations


def _every_other_loop(run, step):
    run.loss(step).backward()
    run.opts[0].step()
    run.opts[0].zero_grad()
    if run.rank == 0:  # a checkpoint of the first, on rank 0 alone, the second still holding its gradients
        run.keep.setdefault("first", []).append(copy.deepcopy(run.opts[0].state_dict()))  # torch's: live
    if step % 2 == 0:  # the second optimizer steps every other iteration, on two backwards' gradients
        run.opts[1].step()
        run.opts[1].zero_grad()


def _every_other(rank, world, mode):
    overlap, reduce = mode
    if mode != HONORS_EDITS:  # the update ran in the backward: the next backward refuses
        return refused(lambda: ours_alone(rank, world, _every_other_loop, _two(overlap=overlap, grad_reduce=reduce)),
                       "a backward started before .*overlap='step' with grad_reduce='all_reduce'")
    out = twin(rank, world, _every_other_loop, _two(overlap=overlap, grad_reduce=reduce))
    for ours, theirs in zip(out["keep"].get("first", []), out["ref_keep"].get("first", []), strict=True):
        compare_state(ours, theirs, f"rank {rank}: the first optimizer's state_dict() between the steps")
    return "ok"


def test_an_optimizer_that_steps_every_other_iteration():
    """The second optimizer steps on the gradients of two backwards: honored by step + all_reduce (the
    update reads param.grad at step()); the other modes refuse at the next backward, on every rank,
    naming it."""
    for results in run_ranks(_cases_every_other, 2):
        assert all(r == "ok" or "a backward started before" in r for _, r in results), results


def _cases_every_other(rank, world):
    return [(mode, _every_other(rank, world, mode)) for mode in MODES]


# ---------------------------------------------------------------------- Muon's orders and groups


def _muon(rank, world, mode, order, groups):
    overlap, reduce = mode

    def make(model, ddp, fused, run):
        muon, rest = split(model, MATRICES)
        opts = {"ddp": ddp, "overlap": overlap, "grad_reduce": reduce} if fused else {}
        muon_groups = [{"params": muon[:1]}, {"params": muon[1:], **groups}] if groups else muon
        made = {"Muon": lambda: optimizer("Muon", muon_groups, fused, **opts),
                "AdamW": lambda: optimizer("AdamW", rest, fused, **opts)}
        built = {kind: made[kind]() for kind in order}  # the order the user builds them in
        return [built["AdamW"], built["Muon"]]
    twin(rank, world, _plain_loop, make)
    return "ok"


def test_muon_built_after_adamw_and_groups_that_differ_in_more_than_lr():
    """Muon built after AdamW (so that AdamW is the module's first optimizer), and two Muon groups that
    differ in momentum, nesterov and ns_steps: every mode."""
    for results in run_ranks(_cases_muon, 2):
        assert all(r == "ok" for *_, r in results), results


def _cases_muon(rank, world):
    differ = {"momentum": 0.8, "nesterov": False, "ns_steps": 3}
    return [(mode, order, _muon(rank, world, mode, order, groups))
            for mode, (order, groups) in zip(MODES, itertools.cycle(
                [(("AdamW", "Muon"), None), (("Muon", "AdamW"), differ), (("AdamW", "Muon"), differ)]))]


# ---------------------------------------------------------------------- the module's options, given twice


def _differing_options(rank, world):
    (model, ddp), _ = models({})
    first, rest = split(model, A)
    optimizer("AdamW", first, True, ddp=ddp, overlap="step", max_grad_norm=1.0)
    return refused(lambda: optimizer("SGD", rest, True, ddp=ddp, overlap="step", max_grad_norm=0.5),
                   "max_grad_norm=0.5 given to this SGD but max_grad_norm=1.0 to another")


def test_a_module_option_given_two_values_is_refused_at_the_second_attach():
    """``max_grad_norm`` clips by the module's global norm, one value for every optimizer over it."""
    results = run_ranks(_differing_options, 2)
    assert results[0] == results[1]
