"""The option names a user guesses (issue 24, item 9): one option for how low-precision parameters are
updated, the test knob out of the public options, an honest name for the 8-bit state, every option
through FusedZeroStrategy, and a typo answered with the optimizer's name and the closest option. The
0.x spellings a user could already have are accepted with the new meaning and one DeprecationWarning.

Construction only (no DDP, no ranks): an unattached optimizer checks and records its options."""

import warnings

import pytest
import torch

import fused_zero
from fused_zero.options import OPTIONS, ShardingOptions, option_table


def _params():
    return list(torch.nn.Linear(4, 2).parameters())


def _built(cls=fused_zero.AdamW, params=None, **options):
    """The optimizer and the warnings its construction raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = cls(params if params is not None else _params(), **options)
    return opt, [w for w in caught if issubclass(w.category, DeprecationWarning)]


def test_master_weights_holds_the_three_ways_to_update_low_precision_parameters():
    for value, keeps in ((None, True), (True, True), (False, False), ("stochastic", False)):
        options = ShardingOptions(master_weights=value)
        assert options.keeps_master(torch.bfloat16) is keeps
        assert options.stochastic_rounding is (value == "stochastic")
    assert ShardingOptions(master_weights="stochastic").seed == 0  # the default seed, where it means something
    with pytest.raises(ValueError, match="master_weights='nearest' is not one of None"):
        fused_zero.AdamW(_params(), master_weights="nearest")
    # seed only where stochastic rounding is chosen, naming the fix
    with pytest.raises(ValueError, match=r"seed=3 seeds stochastic rounding, which is off .*pass "
                                         r"master_weights='stochastic' with it, or drop seed"):
        fused_zero.AdamW(_params(), seed=3)
    opt, warned = _built(master_weights="stochastic", seed=3)
    assert not warned and opt._options == {"master_weights": "stochastic", "seed": 3}


def test_the_old_spellings_keep_working_with_one_warning():
    opt, warned = _built(fused_zero.SGD, stochastic_rounding=True, seed=5, backend="torch", state_format="int8")
    assert opt._options == {"master_weights": "stochastic", "seed": 5, "_backend": "torch", "state_format": "8bit"}
    assert len(warned) == 1, [str(w.message) for w in warned]
    message = str(warned[0].message)
    assert "master_weights='stochastic'" in message and "'8bit'" in message and "decided by the device" in message
    assert _built(stochastic_rounding=False)[0]._options == {}
    with pytest.raises(ValueError, match="give master_weights only"):
        fused_zero.AdamW(_params(), stochastic_rounding=True, master_weights=True)


def test_backend_is_not_a_public_option():
    assert "backend" not in [name for name, _, _ in OPTIONS] and "backend" not in option_table()
    opt, warned = _built(_backend="torch")  # the tests' knob (docs/testing.md): no warning
    assert not warned and opt._options == {"_backend": "torch"}


def test_8bit_is_the_state_formats_name_and_int8_its_alias():
    params = _params()
    opt, warned = _built(params=[{"params": params[:1], "state_format": "int8"}, {"params": params[1:]}],
                         state_format="8bit")
    assert not warned and opt.param_groups[0]["state_format"] == "8bit"
    # a 0.x checkpoint records "int8" (its metadata and, per group, the group's key): it still loads, and
    # the groups keep the optimizer's own format (checkpoint/checks.merged_groups)
    sd = opt.state_dict()
    sd["param_groups"][0]["state_format"] = "int8"
    sd["fused_zero"] = {"state_format": "int8"}
    opt.load_state_dict(sd)
    assert [g.get("state_format") for g in opt.param_groups] == ["8bit", None]


@pytest.mark.parametrize("cls", [fused_zero.AdamW, fused_zero.SGD])
def test_a_typo_names_the_optimizer_and_the_closest_option(cls):
    with pytest.raises(TypeError, match=rf"^{cls.__name__} got an unknown keyword argument 'overlaps'; did you "
                                        r"mean overlap=\? Its options are grad_reduce, overlap, "):
        cls(_params(), overlaps="step")
    opt = cls(_params())
    with pytest.raises(TypeError, match=rf"^{cls.__name__}.attach\(\) got an unknown keyword argument "
                                        "'state_fromat'; did you mean state_format="):
        opt.attach(torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel),
                   state_fromat="8bit")


def test_lightning_strategy_takes_every_option_it_can():
    lightning = pytest.importorskip("fused_zero.lightning")
    owned = set(lightning.LIGHTNING_OWNS)
    assert owned == {"ddp", "max_grad_norm", "grad_scaler"}
    assert set(lightning.SHARDING_OPTIONS) == {name for name, _, _ in OPTIONS} - owned
    given = dict(grad_reduce="all_reduce", overlap="step", master_weights="stochastic", on_nonfinite="raise",
                 param_sync="forward", state_format="int8", seed=7, shard_group=2, grad_reduce_dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = lightning.FusedZeroStrategy(find_unused_parameters=True, **given)
    assert strategy._sharding == {**given, "state_format": "8bit"}
    assert len([w for w in caught if issubclass(w.category, DeprecationWarning)]) == 1
    assert strategy._ddp_kwargs.get("find_unused_parameters") is True  # the rest goes to DDPStrategy
    for name, fix in (("ddp", "wraps the module in DDP itself"), ("max_grad_norm", "gradient_clip_val"),
                      ("grad_scaler", "precision='16-mixed'")):
        with pytest.raises(ValueError, match=f"FusedZeroStrategy does not take {name}: .*{fix}"):
            lightning.FusedZeroStrategy(**{name: object()})
