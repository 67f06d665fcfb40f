"""What torch.optim's Optimizer does around fused_zero's own code: its state_dict and load_state_dict
hooks, run as torch.optim runs them, and ``add_param_group``'s checks of fused_zero's options and the
joining of an attached optimizer's new group (pipeline/added_groups.py)."""

from __future__ import annotations

from types import SimpleNamespace

from ..options import STATE_FORMATS, canonical_state_format, group_state_formats

PER_OPTIMIZER = ("master_weights", "stochastic_rounding", "seed")
"""Sharding options a param group may not set (``state_format`` it may: shard.py keeps one part per format)."""


def through_state_dict_hooks(opt, build):
    """``build()``'s dict between torch.optim's state_dict hooks, as ``torch.optim.Optimizer.state_dict``
    calls them: every pre-hook with the optimizer first, then every post-hook with the dict, a hook's
    returned dict taking its place (on a rank that gets no dict, the pre-hooks only)."""
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    state_dict = build()
    if state_dict is None or (isinstance(state_dict, dict) and not state_dict and opt._engine is not None):
        return state_dict  # another rank's dict (``to=``, written_by)
    for hook in opt._optimizer_state_dict_post_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    return state_dict


def through_load_hooks(opt, state_dict, load) -> None:
    """``load(state_dict)`` between torch.optim's load_state_dict hooks, as ``load_state_dict`` calls them:
    the pre-hooks on a shallow copy of the dict (a returned dict takes its place), the post-hooks once it
    is loaded."""
    state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    load(state_dict)
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)


def check_group_options(param_group, index: int) -> None:
    """The sharding options a new param group (the optimizer's ``index``-th) may set, checked; a group's
    ``state_format`` by its old name gets today's."""
    per_optimizer = [k for k in PER_OPTIMIZER if isinstance(param_group, dict) and k in param_group]
    if per_optimizer:
        raise ValueError(
            f"param group {index} sets {', '.join(per_optimizer)}: fused_zero keeps one "
            f"rounding for every param group; pass {', '.join(f'{k}=...' for k in per_optimizer)} to the "
            "optimizer itself instead")
    fmt = param_group.get("state_format", "fp32") if isinstance(param_group, dict) else "fp32"
    if canonical_state_format(fmt) != fmt:  # the 0.x name: the group keeps today's
        param_group["state_format"] = fmt = canonical_state_format(fmt)
    if fmt not in STATE_FORMATS:
        raise ValueError(f"param group {index} sets state_format={fmt!r}: choose one of "
                         f"{', '.join(map(repr, STATE_FORMATS))}")


def join_group(opt) -> None:
    """The attached optimizer's last param group (just added by torch.optim's ``add_param_group``) joins
    its engine: checked first (its parameters, its hyperparameters against the algorithm, its format),
    and removed again where that refuses; then laid out, and the optimizer's view of its share renewed."""
    engine, member = opt._engine, opt._member
    default = opt._options.get("state_format", "fp32")
    try:
        pids = engine.check_joining(member, opt.param_groups[-1]["params"])
        opt._algorithm.refresh(opt.param_groups)
        opt._algorithm.check_engine(engine, SimpleNamespace(
            name=member.name, group_formats=group_state_formats(opt.param_groups, default)))
    except BaseException:
        opt.param_groups.pop()
        opt._algorithm.refresh(opt.param_groups)
        raise
    engine.join_group(member, pids, default)
    opt._view = engine.view(member)  # its parameter table, with the group's
    opt._peers.view = opt._view
    opt.state = type(opt.state)(opt._view)


__all__ = ["PER_OPTIMIZER", "check_group_options", "join_group", "through_load_hooks", "through_state_dict_hooks"]
