"""What ``fused_zero.transformers.attach`` adds to the optimizer's options from the Trainer's
``TrainingArguments``, per overlap mode, without training: ``overlap="backward"`` runs the update in the
backward, before the Trainer's clip, so it must get ``max_grad_norm`` from the arguments; ``"step"`` is
clipped through the Trainer's own ``clip_grad_norm_`` and gets nothing; ``"bucket"`` cannot clip and is
refused; the default, ``"auto"``, resolves from the arguments. The Trainer runs in each mode in test_transformers.py."""

import importlib.util
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="the transformers extra is not installed: pip install 'fused-zero[transformers]'")


def args(max_grad_norm=0.3, fp16=False):
    return SimpleNamespace(max_grad_norm=max_grad_norm, fp16=fp16, deepspeed=None, fsdp=None)


@pytest.mark.parametrize("given, passed", [
    ({"overlap": "backward"}, {"max_grad_norm": 0.3}),
    ({"overlap": "backward", "grad_reduce": "all_reduce"}, {"max_grad_norm": 0.3}),
    ({"overlap": "backward", "max_grad_norm": 0.3}, {"max_grad_norm": 0.3}),
    ({"overlap": "step"}, {}),
    ({"overlap": "step", "grad_reduce": "all_reduce"}, {}),
])
def test_attach_passes_the_trainers_clip_on_where_the_update_needs_it(given, passed):
    from fused_zero.transformers import _settings

    assert _settings(args(), given) == passed


@pytest.mark.parametrize("overlap", ["bucket", "backward", "step"])
def test_no_clip_passes_nothing_on(overlap):
    from fused_zero.transformers import _settings

    assert _settings(args(max_grad_norm=0.0), {"overlap": overlap}) == {}


def test_bucket_mode_with_a_clip_is_refused():
    from fused_zero.transformers import _settings

    with pytest.raises(ValueError, match=r"max_grad_norm=0.3\) \(a clip every step.*needs overlap='backward' or "
                                         r"overlap='step' \(got overlap='bucket'\)"):
        _settings(args(), {"overlap": "bucket"})


def test_the_default_resolves_to_backward_with_the_clip():
    from fused_zero.transformers import _settings

    assert _settings(args(), {}) == {"overlap": "backward", "max_grad_norm": 0.3}
    assert _settings(args(max_grad_norm=0.0), {}) == {"overlap": "bucket"}
