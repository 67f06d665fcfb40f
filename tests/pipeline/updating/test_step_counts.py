"""The step columns written on the device (algorithms/step_columns.py) against the host's formulas they
replace: Adam's with kernels.adam_coefficients at the same step counts (torch.optim's float64 bias
corrections rounded to float32), SGD's first-step flag, and the stochastic-rounding key against
kernels.sr_key, bit for bit, at counts around each table's growth and saturation and far past them."""

import numpy as np
import torch

from fused_zero.algorithms.adam import AdamFamily
from fused_zero.algorithms.sgd import SGDAlgorithm
from fused_zero.algorithms.step_columns import saturation
from fused_zero.kernels import adam_coefficients, sgd_coefficients, sr_key
from fused_zero.pipeline.comm.scratch import Scratch


class _Counts:
    """StepCounts' interface over given counts (the columns read ``after()`` and ``bound``)."""

    def __init__(self, counts):
        self.counts = torch.tensor(counts, dtype=torch.int64)
        self.bound = int(self.counts.max()) + 1

    def after(self, scratch):
        return self.counts + 1


def _groups_adam():
    return [dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False),
            dict(lr=1.7e-3, betas=(0.95, 0.98), eps=1e-6, weight_decay=0.0, amsgrad=False, maximize=False),
            dict(lr=1e-2, betas=(0.0, 0.5), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False)]


COUNTS = [0, 1, 2, 31, 32, 33, 64, 355, 356, 357, 1852, 1853, 37411, 37412, 37413, 10 ** 6]


def _upload(t, out=None):
    """SideStream.upload on the CPU: the table itself, or copied into ``out``."""
    return t if out is None else out.copy_(t)


def _table(algo, groups, group_of, counts, seed=None):
    table = algo.coefficients(groups, group_of, np.ones(len(counts)), 1.0).clone()
    counts, scratch = _Counts(counts), Scratch(torch.device("cpu"))
    inputs = algo.step_inputs(groups, group_of, counts.bound, torch.from_numpy(group_of),
                              _upload, scratch)
    algo.fill_steps(table, inputs, counts, seed, scratch)
    return table


def test_saturation_is_where_the_correction_becomes_one():
    for beta in (0.5, 0.9, 0.95, 0.98, 0.999, 0.9999):
        t = saturation(beta)
        assert 1 - np.power(beta, float(t)) == 1.0 and 1 - np.power(beta, float(t - 1)) != 1.0, beta
    assert (saturation(0.9), saturation(0.999)) == (356, 37412)


def test_adam_columns_are_the_host_formulas_at_every_count():
    groups = _groups_adam()
    n = len(COUNTS)
    group_of = np.arange(n, dtype=np.int64) % len(groups)
    algo = AdamFamily(groups, {"decoupled_weight_decay": True})
    for grow in (False, True):  # a table sized for the bound at once, or grown step by step up to it
        if grow:
            for bound in (1, 40, 100, 2000):
                _table(algo, groups, group_of, [min(c, bound - 1) for c in COUNTS])
        got = _table(algo, groups, group_of, COUNTS)
        pick = lambda f: np.array([f(groups[g]) for g in group_of], dtype=np.float64)  # noqa: E731
        want = adam_coefficients(lr=pick(lambda g: g["lr"]), beta1=pick(lambda g: g["betas"][0]),
                                 beta2=pick(lambda g: g["betas"][1]), eps=pick(lambda g: g["eps"]),
                                 weight_decay=pick(lambda g: g["weight_decay"]), step=np.array(COUNTS) + 1.0,
                                 decoupled=True)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (got - want).abs().max(0)


def test_sgd_first_step_column():
    groups = [dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False),
              dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)]
    counts = [0, 1, 5, 0, 1, 5]
    group_of = np.array([0, 0, 0, 1, 1, 1], dtype=np.int64)
    got = _table(SGDAlgorithm(groups, {}), groups, group_of, counts)
    want = sgd_coefficients(lr=0.1, momentum=np.array([0.9] * 3 + [0.0] * 3), dampening=0.0, weight_decay=0.0,
                            first=np.array([1, 0, 0, 1, 1, 1]))
    assert torch.equal(got, want)


def test_stochastic_rounding_keys_are_the_host_hash():
    groups = _groups_adam()[:1]
    counts = [0, 1, 2 ** 31 - 2, 2 ** 32 + 5, 12345]
    group_of = np.zeros(len(counts), dtype=np.int64)
    for seed in (0, 7, 2 ** 32 - 1):
        got = _table(AdamFamily(groups, {"decoupled_weight_decay": True}), groups, group_of, counts, seed=seed)
        want = [sr_key(seed, c + 1, pid) for pid, c in enumerate(counts)]
        assert got[:, -1].contiguous().view(torch.int32).tolist() == \
            [k - (1 << 32) if k >= 1 << 31 else k for k in want]


def test_a_graph_s_bias_table_holds_beta2_0999_to_saturation_at_once():
    """Where a CUDA graph reads the tables (kept scratch, capturable=True), a table's growth is a recapture:
    the first table covers 65,536 steps, all of 0.999's; made step by step otherwise."""
    groups = _groups_adam()[:1]
    group_of = np.zeros(3, dtype=np.int64)
    for kept, length in ((True, saturation(0.999)), (False, 32)):
        algo, scratch = AdamFamily(groups, {"decoupled_weight_decay": True}), Scratch(torch.device("cpu"), kept=kept)
        inputs = algo.step_inputs(groups, group_of, 1, torch.from_numpy(group_of),
                                  _upload, scratch)
        assert inputs[3] == length, (kept, inputs[3])
