"""torch.optim's hooks and torch.distributed.checkpoint's state-dict helpers (the contract suite:
conftest.py).

- Every hook torch.optim has, on a fused_zero optimizer as on torch.optim's: ``register_step_pre_hook`` /
  ``_post_hook`` and the global ``register_optimizer_step_pre_hook`` / ``_post_hook``;
  ``register_state_dict_pre_hook`` / ``_post_hook`` (a post-hook that edits the dict in place and one
  that returns a new dict); ``register_load_state_dict_pre_hook`` (returning the dict to load) /
  ``_post_hook``. Each fires as torch.optim's, with the same arguments, and what a hook changes or returns
  is what ``state_dict()`` returns and ``load_state_dict()`` loads: through ``opt.state_dict()``, the
  rank-0 route (``state_dict(to=0)``) and DCP's ``get_optimizer_state_dict`` /
  ``set_optimizer_state_dict``. Before: the state_dict and load_state_dict hooks never ran.
- DCP's helpers (``get_state_dict``, ``set_state_dict``, ``get_optimizer_state_dict``,
  ``set_optimizer_state_dict``, with their options) for every kind of optimizer, a stateless one
  (``SGD`` without momentum) included, before the first step and after, at 2 ranks: the resume continues
  bit for bit with the optimizer that saved it, and with DDP + torch.optim. Before: the stateless SGD
  raised "found no reduced gradients" (DCP steps an optimizer whose ``state`` is empty, at lr 0, to make
  its state).
"""

from __future__ import annotations

import tempfile

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed import run_ranks
from harness import Run, compare_state, models, optimizer, same
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook


def _step(ddp, opt, step: int, rank: int) -> None:
    Run(ddp, [opt], None, rank, dist.get_world_size(), True).loss(step).backward()
    opt.step()
    opt.zero_grad()


# ------------------------------------------------------------------------------------------------ hooks


def _hooked(opt, calls: list):
    """Every hook torch.optim has on ``opt``, each recording its call in ``calls``."""
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("step pre", o is opt, len(args))))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("step post", o is opt)))
    opt.register_state_dict_pre_hook(lambda o: calls.append(("sd pre", o is opt)))

    def edit_in_place(o, sd):
        calls.append(("sd post", o is opt))
        sd["param_groups"][0]["hooked"] = "in place"

    def replace(o, sd):
        return {**sd, "extra": [len(sd["state"])]}
    opt.register_state_dict_post_hook(edit_in_place)
    opt.register_state_dict_post_hook(replace)

    def load_pre(o, sd):
        calls.append(("load pre", o is opt, sorted(sd)))
        sd = dict(sd)
        sd.pop("extra", None)
        sd["param_groups"] = [{k: v for k, v in g.items() if k != "hooked"} | {"lr": 0.5 * g["lr"]}
                              for g in sd["param_groups"]]
        return sd
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load post", o is opt, o.param_groups[0]["lr"])))


def _hooks(rank, world):
    (model, ddp), (ref, ref_ddp) = models({"bucket_cap_mb": 0.0001})
    opt = optimizer("AdamW", list(ddp.parameters()), True, ddp=ddp)
    ref_opt = optimizer("AdamW", list(ref_ddp.parameters()), False)
    seen = {"ours": [], "torch": []}
    global_calls = []
    handles = [register_optimizer_step_pre_hook(
        lambda o, args, kwargs: global_calls.append(("global pre", type(o).__module__.split(".")[0]))),
        register_optimizer_step_post_hook(
        lambda o, args, kwargs: global_calls.append(("global post", type(o).__module__.split(".")[0])))]
    try:
        for o, key in ((opt, "ours"), (ref_opt, "torch")):
            _hooked(o, seen[key])
        for step in (1, 2):
            _step(ddp, opt, step, rank)
            _step(ref_ddp, ref_opt, step, rank)
        ours, theirs = opt.state_dict(), ref_opt.state_dict()
        assert ours["extra"] == theirs["extra"] and ours["param_groups"][0]["hooked"] == "in place", ours
        compare_state(ours, theirs, f"rank {rank}: state_dict() through its hooks")
        routed = opt.state_dict(to=0)  # the rank-0 route: rank 0 gets the dict, through the hooks
        if rank == 0:
            assert routed["extra"] == theirs["extra"] and routed["param_groups"][0]["hooked"] == "in place"
        opt.load_state_dict(ours)  # the load pre-hook halves lr and drops what the post-hooks added
        ref_opt.load_state_dict(theirs)
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.5e-2
        assert "hooked" not in opt.param_groups[0]
        # DCP's helpers: the same hooks, the same dict (in DCP's form: FQNs for parameter ids)
        mine = get_optimizer_state_dict(ddp, opt)  # DCP keeps the state and the param groups of the dict
        ref_sd = get_optimizer_state_dict(ref_ddp, ref_opt)
        assert [g.get("hooked") for g in mine["param_groups"]] == [g.get("hooked") for g in ref_sd["param_groups"]]
        assert mine["param_groups"][0]["hooked"] == "in place", mine["param_groups"]
        set_optimizer_state_dict(ddp, opt, mine)
        set_optimizer_state_dict(ref_ddp, ref_opt, ref_sd)
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.25e-2
        for step in (3, 4):
            _step(ddp, opt, step, rank)
            _step(ref_ddp, ref_opt, step, rank)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            same(p.detach(), q.detach(), f"rank {rank} {name} after the hooked loads")
    finally:
        for h in handles:
            h.remove()
        opt._engine.close()
    # rank 0's routed state_dict ran the hooks on every rank (its pre-hooks) and the post-hooks on rank 0
    return seen, global_calls


def test_torch_optims_hooks_fire_and_shape_the_state_dict_as_torch_optims():
    for seen, global_calls in run_ranks(_hooks, 2):
        ours, theirs = seen["ours"], seen["torch"]
        step_calls = [c for c in ours if c[0].startswith("step")]
        assert step_calls == [c for c in theirs if c[0].startswith("step")], (ours, theirs)
        for kind in ("sd pre", "sd post", "load pre", "load post"):
            assert [c for c in ours if c[0] == kind][:2] == [c for c in theirs if c[0] == kind][:2], (kind, ours,
                                                                                                       theirs)
        assert [c for c in global_calls if c[1] == "fused_zero"] == \
            [(c[0], "fused_zero") for c in global_calls if c[1] == "torch"], global_calls


# ----------------------------------------------------------------------------------------- DCP helpers

KINDS = {"SGD": dict(hp={"momentum": 0.0}), "SGD-momentum": dict(kind="SGD"), "AdamW": {}, "RMSprop": {},
         "Adafactor": {}}


def _dcp_helpers(rank, world, name, where, when):
    """Train ``when`` steps (0: before the first step), save with DCP's helpers (model and optimizer in
    one dict, ``get_state_dict``, and the optimizer's alone, full and sharded), load into a fresh module and
    optimizer (``set_state_dict`` / ``set_optimizer_state_dict``), train on: the resumed run against the
    one that saved it and against DDP + torch.optim."""
    spec = dict(KINDS[name])
    kind = spec.pop("kind", name)
    kw = {"bucket_cap_mb": 0.0001}
    (model, ddp), (ref, ref_ddp) = models(kw)
    opt = optimizer(kind, list(ddp.parameters()), True, ddp=ddp, **spec)
    ref_opt = optimizer(kind, list(ref_ddp.parameters()), False, **spec)
    for step in range(1, when + 1):
        _step(ddp, opt, step, rank)
        _step(ref_ddp, ref_opt, step, rank)
    out = []
    ways = [("one dict", StateDictOptions()), ("optimizer, cpu offload", StateDictOptions(cpu_offload=True))]
    if name != "SGD":  # set_optimizer_state_dict(full_state_dict=True) finds the device from the optimizer's
        # state tensors: with none (SGD without momentum) it fails for torch.optim.SGD too
        ways.append(("optimizer, full", StateDictOptions(full_state_dict=True)))
    for how, options in ways:
        get_optimizer_state_dict(ref_ddp, ref_opt, options=options)  # DCP makes torch.optim's state too
        if how == "one dict":
            model_sd, optim_sd = get_state_dict(ddp, opt, options=options)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{where}/{how}")
        else:
            optim_sd = get_optimizer_state_dict(ddp, opt, options=options)
            dcp.save({"optim": optim_sd}, checkpoint_id=f"{where}/{how}")
        (fresh, fresh_ddp), _ = models(kw)
        fresh.load_state_dict(model.state_dict())
        resumed = optimizer(kind, list(fresh_ddp.parameters()), True, ddp=fresh_ddp, **spec)
        if how == "one dict":
            model_sd, optim_sd = get_state_dict(fresh_ddp, resumed, options=options)
            target = {"model": model_sd, "optim": optim_sd}
            dcp.load(target, checkpoint_id=f"{where}/{how}")
            set_state_dict(fresh_ddp, resumed, model_state_dict=target["model"], optim_state_dict=target["optim"],
                           options=options)
        else:
            target = {"optim": get_optimizer_state_dict(fresh_ddp, resumed, options=options)}
            dcp.load(target, checkpoint_id=f"{where}/{how}")
            set_optimizer_state_dict(fresh_ddp, resumed, target["optim"], options=options)
        compare_state(resumed.state_dict(), opt.state_dict(), f"rank {rank} {name} {how}: the loaded state")
        out.append((fresh, fresh_ddp, resumed))
    for step in range(when + 1, when + 3):
        for d, o in [(ddp, opt), (ref_ddp, ref_opt)] + [(d, o) for _, d, o in out]:
            _step(d, o, step, rank)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            same(p.detach(), q.detach(), f"rank {rank} {name} step {step} {n}: against torch.optim")
        for fresh, _, _ in out:
            for (n, p), q in zip(model.named_parameters(), fresh.parameters()):
                same(p.detach(), q.detach(), f"rank {rank} {name} step {step} {n}: resumed against the saver")
    for o in [opt] + [o for *_, o in out]:
        o._engine.close()
    return "ok"


def _every_kind(rank, world, where):
    return [(name, when, _dcp_helpers(rank, world, name, f"{where}/{name}-{when}", when))
            for name in KINDS for when in (0, 2)]


def test_dcp_state_dict_helpers_for_every_kind_stateless_included():
    with tempfile.TemporaryDirectory() as where:
        for results in run_ranks(_every_kind, 2, where):
            assert all(r == "ok" for *_, r in results), results
