"""The fused kernels against torch.optim itself, through Triton's interpreter on the CPU.

Parameters of odd sizes are packed into one padded flat buffer and cut into W slices that begin and
end mid-parameter, exactly as the orchestrator shards a DDP bucket; every rank's slice is stepped by
its own launch and the union is compared with torch.optim on the unpacked parameters.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fused_zero.kernels import (
    BLOCK,
    SCALAR_BLOCK,
    VEC,
    Segments,
    adam_coefficients,
    adam_step,
    grad_sumsq,
    row_table,
    sgd_coefficients,
    sgd_step,
    vector_elements,
)
from fused_zero.pipeline.buckets.layout import BucketLayout, alignment

SIZES = (1, 7, 1000, 4099, 33, 2050)
GROUP_OF = (0, 1, 0, 1, 1, 0)
GROUPS = ({"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3, "weight_decay": 0.0})
STEPS = 20
PAD_SENTINEL = -4096.0  # exact in every float dtype


class Packed:
    """Parameters back to back in a padded flat buffer, cut into ``world`` equal slices."""

    def __init__(self, sizes, world, align=4):
        self.sizes = sizes
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.numel = sum(sizes)
        unit = world * align
        self.padded = -(-self.numel // unit) * unit
        self.slice = self.padded // world
        self.world = world

    def rows(self, rank, shifts=(0, 0, 0)):
        """Segments rows of ``rank``'s slice: shard offsets local to the slice, param/grad global.

        ``shifts`` moves each space's origin by that many elements: (shard, param, grad).
        """
        lo, hi = rank * self.slice, (rank + 1) * self.slice
        ds, dp, dg = shifts
        out = []
        for pid, (start, size) in enumerate(zip(self.starts, self.sizes)):
            a, b = max(start, lo), min(start + size, hi)
            if a < b:
                out.append((a - lo + ds, b - a, a + dp, a + dg, pid))
        return out

    def flat(self, tensors, dtype, pad=0.0, shift=0):
        buf = torch.full((shift + self.padded,), pad, dtype=dtype)
        for t, s in zip(tensors, self.starts):
            buf[shift + s:shift + s + t.numel()] = t.reshape(-1).to(dtype)
        return buf

    def unflat(self, buf, like):
        return [buf[s:s + t.numel()].view_as(t) for t, s in zip(like, self.starts)]


def make_params():
    return [torch.randn(n) * 0.5 for n in SIZES]


def reference(cls, params, kwargs):
    ref = [p.clone().requires_grad_(True) for p in params]
    groups = [{"params": [p for p, g in zip(ref, GROUP_OF) if g == gi], **GROUPS[gi]}
              for gi in range(len(GROUPS))]
    return ref, cls(groups, foreach=False, **kwargs)


def lr_at(group, step):
    return GROUPS[group]["lr"] * (1.0 + 0.5 * math.cos(step))


def run_parity(cls, kwargs, *, world, param_dtype, grad_dtype, master, steps=STEPS, scale=None,
               clip=None, align=4, shifts=(0, 0, 0)):
    """Step the kernel and torch.optim side by side; return (ours fp32, reference fp32) lists.

    Slices start at multiples of ``align``; ``shifts`` moves the origin of the shard, parameter and
    gradient spaces (see ``Packed.rows``): offsets that agree modulo the vector width give rows with
    aligned middles and ragged ends, offsets that disagree give scalar rows only.
    """
    params = make_params()
    pk = Packed(SIZES, world, align=align)
    ds, dp, dg = shifts
    param_buf = pk.flat(params, param_dtype, pad=PAD_SENTINEL, shift=dp)
    master_buf = pk.flat(params, torch.float32, pad=PAD_SENTINEL, shift=ds) if master else None
    shard = lambda: torch.full((ds + pk.padded,), PAD_SENTINEL)  # noqa: E731 -- every rank's, side by side
    is_adam = cls is not torch.optim.SGD
    state = {"exp_avg": shard(), "exp_avg_sq": shard()} if is_adam else {}
    if is_adam and kwargs.get("amsgrad"):
        state["max_exp_avg_sq"] = shard()
    if not is_adam and kwargs.get("momentum", 0):
        state["momentum_buffer"] = shard()
    # state starts at zero on real elements (padding keeps the sentinel)
    real = pk.flat([torch.zeros(n) for n in SIZES], torch.float32, pad=1.0) == 0
    real_at = lambda shift: torch.cat([torch.zeros(shift, dtype=torch.bool), real])  # noqa: E731
    for t in state.values():
        t[real_at(ds)] = 0.0

    # bf16/fp16 parameters: the reference runs on fp32 copies of the initial low-precision values
    start = [p.to(param_dtype).float() for p in params]
    if master_buf is not None:
        master_buf[real_at(ds)] = pk.flat(start, torch.float32)[real]
    ref, opt = reference(cls, start, kwargs)
    segs = [Segments.build(pk.rows(r, shifts)) for r in range(world)]

    for step in range(1, steps + 1):
        grads = [torch.randn(n) for n in SIZES]
        grads_q = [g.to(grad_dtype) for g in grads]
        for p, g in zip(ref, grads_q):
            gg = g.float()
            if scale is not None:
                gg = gg / scale
            if clip is not None:
                gg = gg * clip
            p.grad = gg
        for gi, group in enumerate(opt.param_groups):
            group["lr"] = lr_at(gi, step)
        opt.step()

        grad_buf = pk.flat(grads_q, grad_dtype, pad=float("nan"), shift=dg)
        lrs = [lr_at(GROUP_OF[i], step) for i in range(len(SIZES))]
        wds = [GROUPS[GROUP_OF[i]]["weight_decay"] for i in range(len(SIZES))]
        extra = dict(
            grad_scale=None if scale is None else torch.tensor([scale]),
            clip_coef=None if clip is None else torch.tensor([clip]),
        )
        for r in range(world):
            lo = r * pk.slice
            view = {k: v[lo:lo + ds + pk.slice] for k, v in state.items()}
            m = None if master_buf is None else master_buf[lo:lo + ds + pk.slice]
            if is_adam:
                betas = kwargs.get("betas", (0.9, 0.999))
                coefs = adam_coefficients(
                    lr=lrs, beta1=betas[0], beta2=betas[1], eps=kwargs.get("eps", 1e-8),
                    weight_decay=wds, step=step, decoupled=cls is torch.optim.AdamW)
                adam_step(segs[r], coefs, grad=grad_buf, param=param_buf, master=m,
                          exp_avg=view["exp_avg"], exp_avg_sq=view["exp_avg_sq"],
                          max_exp_avg_sq=view.get("max_exp_avg_sq"),
                          maximize=kwargs.get("maximize", False), **extra)
            else:
                coefs = sgd_coefficients(
                    lr=lrs, momentum=kwargs.get("momentum", 0.0), dampening=kwargs.get("dampening", 0.0),
                    weight_decay=wds, first=step == 1)
                sgd_step(segs[r], coefs, grad=grad_buf, param=param_buf, master=m,
                         momentum_buffer=view.get("momentum_buffer"),
                         nesterov=kwargs.get("nesterov", False), maximize=kwargs.get("maximize", False),
                         **extra)

    # padding never written, in any buffer
    for name, buf, shift in [("param", param_buf, dp), ("master", master_buf, ds),
                             *((k, v, ds) for k, v in state.items())]:
        if buf is not None:
            assert bool((buf[~real_at(shift)].float() == PAD_SENTINEL).all()), f"padding of {name} was written"
    ours_state = {k: pk.unflat(v[ds:], ref) for k, v in state.items()}
    for k, per_param in ours_state.items():
        for p, mine in zip(ref, per_param):
            assert_close_fp32(mine, opt.state[p][k], what=f"state {k}")
    ours = pk.unflat(param_buf[dp:], ref)
    if master_buf is not None:
        masters = pk.unflat(master_buf[ds:], ref)
        for mine, low in zip(masters, ours):
            assert torch.equal(mine.to(param_dtype), low), "param is not master rounded to its dtype"
        return masters, [p.detach() for p in ref], ours
    return [t.float() for t in ours], [p.detach() for p in ref], ours


ADAM_OPTIONS = [
    {},
    {"amsgrad": True},
    {"maximize": True},
    {"amsgrad": True, "maximize": True, "betas": (0.8, 0.99), "eps": 1e-6},
    {"betas": (0.6, 0.95)},  # lerp weight 0.4 (< 0.5) and beta1 < 0.5 path below
    {"betas": (0.3, 0.9)},   # lerp weight 0.7: torch's other lerp branch
]
SGD_OPTIONS = [
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "dampening": 0.3},
    {"momentum": 0.9, "nesterov": True},
    {"momentum": 0.5, "maximize": True},
    {"maximize": True},
]


def assert_close_fp32(mine, theirs, what="parameter"):
    """Equal to 1e-6 relative, measured against the tensor's scale.

    Where bits differ, it is by an ulp of an intermediate: torch's vectorised CPU lerp uses a fused
    multiply-add (its scalar tail does not), and its float32 sqrt is not correctly rounded, and
    elements whose moments nearly cancel then differ in the last bit of a small number. The exact
    check is against the kernels' own reference (test_kernel_exact.py).
    """
    scale = float(theirs.abs().max()) if theirs.numel() else 0.0
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6 * scale + 1e-12,
                               msg=lambda m: f"{what}: {m}")


def assert_fp32_parity(ours, ref):
    for mine, theirs in zip(ours, ref):
        assert_close_fp32(mine, theirs)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("options", ADAM_OPTIONS, ids=str)
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam], ids=lambda c: c.__name__)
def test_adam_fp32_parity(cls, options, world):
    ours, ref, _ = run_parity(cls, options, world=world, param_dtype=torch.float32,
                              grad_dtype=torch.float32, master=False)
    assert_fp32_parity(ours, ref)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("options", SGD_OPTIONS, ids=str)
def test_sgd_fp32_parity(options, world):
    ours, ref, _ = run_parity(torch.optim.SGD, options, world=world, param_dtype=torch.float32,
                              grad_dtype=torch.float32, master=False)
    assert_fp32_parity(ours, ref)


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cls,options", [
    (torch.optim.AdamW, {"amsgrad": True}), (torch.optim.Adam, {}),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
], ids=["adamw", "adam", "sgd"])
def test_low_precision_params_with_master(cls, options, grad_dtype, param_dtype):
    masters, ref, lows = run_parity(cls, options, world=2, param_dtype=param_dtype,
                                    grad_dtype=grad_dtype, master=True)
    assert_fp32_parity(masters, ref)
    for low, theirs in zip(lows, ref):
        # the master equals torch.optim's fp32 result to 1e-6; the cast of both differs by <= 1 ulp
        torch.testing.assert_close(low.float(), theirs.to(param_dtype).float(), rtol=0, atol=0) \
            if torch.equal(low, theirs.to(param_dtype)) else \
            torch.testing.assert_close(low.float(), theirs.float(), rtol=2 ** -7, atol=1e-6)


# (shard, param, grad) origins: agreeing modulo VEC but each misaligned differently in bytes (fp32 state
# 4 bytes in, 16-bit parameters 10 bytes, gradients 18 or 36), and disagreeing (scalar rows only)
SHIFTS = [(1, 5, 9), (3, 7, 3), (0, 1, 2)]


@pytest.mark.parametrize("shifts", SHIFTS, ids=str)
@pytest.mark.parametrize("cls,options,param_dtype,grad_dtype", [
    (torch.optim.AdamW, {"amsgrad": True}, torch.float32, torch.float32),
    (torch.optim.Adam, {}, torch.bfloat16, torch.float16),
    (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, torch.float16, torch.bfloat16),
], ids=["adamw-fp32", "adam-bf16", "sgd-fp16"])
def test_rows_with_ragged_ends_in_every_space(cls, options, param_dtype, grad_dtype, shifts):
    pk = Packed(SIZES, 3)
    kinds = {int(v) for r in range(3) for v in Segments.build(pk.rows(r, shifts)).rows[:, 6]}
    congruent = (shifts[0] - shifts[1]) % VEC == 0 and (shifts[0] - shifts[2]) % VEC == 0
    assert kinds == ({0, 1} if congruent else {0})
    ours, ref, lows = run_parity(cls, options, world=3, param_dtype=param_dtype, grad_dtype=grad_dtype,
                                 master=param_dtype != torch.float32, steps=6, shifts=shifts)
    assert_fp32_parity(ours, ref)


def test_layout_at_alignment_one_through_the_kernels():
    """A bucket at a world size where its alignment is 1: slices of odd length at odd bucket offsets.
    Every rank's region is congruent to the bucket modulo VEC, so most rows are still on the vector
    path. Each rank updates its slice and the replicated tail in its own parameter buffer; the slices
    are then gathered, as the all-gather does."""
    world, steps = 24, 3
    numels = list(SIZES)
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    assert alignment(sum(numels), world) == 1
    layouts = [BucketLayout.build(range(len(numels)), numels, offsets, world, r) for r in range(world)]
    assert any(lay.region_slice(r)[0] for r, lay in enumerate(layouts))  # some regions start padded
    params = make_params()
    ref, opt = reference(torch.optim.AdamW, params, {})
    param_bufs = [torch.cat([p.reshape(-1) for p in params]) for _ in range(world)]
    states = [{k: torch.zeros(lay.region_size) for k in ("exp_avg", "exp_avg_sq")} for lay in layouts]
    segs = [Segments.build(lay.rows()) for lay in layouts]
    vector = sum(int(s.rows[s.rows[:, 6] == 1, 1].sum()) for s in segs)
    total = sum(int(s.rows[:, 1].sum()) for s in segs)
    assert vector / total > 0.9
    for step in range(1, steps + 1):
        grads = [torch.randn(n) for n in SIZES]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        opt.step()
        bucket_grad = torch.cat(grads)
        lrs = [GROUPS[GROUP_OF[i]]["lr"] for i in range(len(SIZES))]
        wds = [GROUPS[GROUP_OF[i]]["weight_decay"] for i in range(len(SIZES))]
        coefs = adam_coefficients(lr=lrs, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wds, step=step,
                                  decoupled=True)
        for r in range(world):  # the gradient read in place in the (reduced) bucket buffer
            adam_step(segs[r], coefs, grad=bucket_grad, param=param_bufs[r], **states[r])
        gathered = param_bufs[0].clone()
        for r, lay in enumerate(layouts):
            lo, hi = lay.slice_of(r)
            gathered[lo:hi] = param_bufs[r][lo:hi]
            assert torch.equal(param_bufs[r][lay.head:], param_bufs[0][lay.head:])  # the tail agrees
        for buf in param_bufs:
            buf.copy_(gathered)
    for mine, theirs in zip(param_bufs[0].split(numels), ref):
        assert_close_fp32(mine, theirs.detach().reshape(-1))


def test_grad_scale_and_clip_match_scaled_reference():
    ours, ref, _ = run_parity(torch.optim.AdamW, {}, world=2, param_dtype=torch.float32,
                              grad_dtype=torch.float32, master=False, steps=5, scale=1024.0, clip=0.25)
    assert_fp32_parity(ours, ref)


def test_bf16_rounding_is_round_to_nearest_even():
    """The kernel's bf16 store rounds exactly as torch does, including ties, inf and NaN."""
    n = 4096
    values = torch.cat([torch.randn(n - 8) * 100, torch.tensor(
        [float("inf"), -float("inf"), float("nan"), 3.4e38, 1.00390625, 1.01171875, 0.0, -0.0])])
    pk = Packed([n], 1)
    param = torch.zeros(pk.padded, dtype=torch.bfloat16)
    master = pk.flat([values], torch.float32)
    coefs = sgd_coefficients(lr=0.0, momentum=0.0, dampening=0.0, weight_decay=0.0, first=True)
    sgd_step(Segments.build(pk.rows(0)), coefs, grad=torch.zeros(pk.padded), param=param, master=master)
    expected = values.to(torch.bfloat16)
    got = param[:n]
    assert torch.equal(got.view(torch.int16)[~values.isnan()], expected.view(torch.int16)[~values.isnan()])
    assert bool(got[values.isnan()].isnan().all())


def test_found_inf_leaves_every_byte():
    pk = Packed(SIZES, 2)
    param = pk.flat(make_params(), torch.bfloat16)
    master = pk.flat(make_params(), torch.float32)
    m, v, vmax = (torch.rand(pk.slice) for _ in range(3))
    before = [t.clone() for t in (param, master, m, v, vmax)]
    coefs = adam_coefficients(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                              step=[3] * len(SIZES), decoupled=True)
    adam_step(Segments.build(pk.rows(1)), coefs, grad=pk.flat([torch.randn(n) for n in SIZES], torch.float32),
              param=param, master=master[pk.slice:], exp_avg=m, exp_avg_sq=v, max_exp_avg_sq=vmax,
              found_inf=torch.tensor([1.0]))
    for b, a in zip(before, (param, master, m, v, vmax)):
        assert torch.equal(b.view(torch.uint8) if b.dtype != torch.bfloat16 else b.view(torch.int16),
                           a.view(torch.uint8) if a.dtype != torch.bfloat16 else a.view(torch.int16))


def test_inactive_parameters_are_untouched():
    pk = Packed(SIZES, 1)
    param = pk.flat(make_params(), torch.float32)
    before = param.clone()
    active = [i % 2 for i in range(len(SIZES))]
    coefs = sgd_coefficients(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, first=True,
                             active=active)
    sgd_step(Segments.build(pk.rows(0)), coefs, grad=torch.ones(pk.padded), param=param)
    for i, (a, b) in enumerate(zip(pk.unflat(param, make_params()), pk.unflat(before, make_params()))):
        assert torch.equal(a, b) != bool(active[i])


def test_empty_and_padding_only_slices_launch_nothing():
    # 3 real elements, W=4 with alignment 4: ranks 1..3 own only padding
    pk = Packed([3], 4)
    assert pk.rows(1) == [] and pk.rows(3) == []
    param = pk.flat([torch.ones(3)], torch.float32, pad=PAD_SENTINEL)
    before = param.clone()
    segs = Segments.build(pk.rows(2))
    assert segs.n_rows == 0
    coefs = adam_coefficients(lr=1.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
                              decoupled=True)
    empty = torch.empty(0)
    adam_step(segs, coefs, grad=torch.ones(pk.padded), param=param, exp_avg=empty, exp_avg_sq=empty)
    assert torch.equal(param, before)


def test_segments_split_rows_longer_than_block():
    # offsets 0, 10, 20 disagree modulo VEC: one scalar piece, split at SCALAR_BLOCK (a scalar program
    # covers its row in one block: no loop bound loaded at run time)
    assert SCALAR_BLOCK == 256
    segs = Segments.build([(0, 1000, 10, 20, 0), (5000, 3, 7000, 7000, 1)])
    rows = segs.rows.tolist()
    assert rows == [[0, 256, 10, 20, 0, 0, 0, 0], [256, 256, 266, 276, 0, 256, 0, 1],
                    [512, 256, 522, 532, 0, 512, 0, 2], [768, 232, 778, 788, 0, 768, 0, 3],
                    [5000, 3, 7000, 7000, 1, 0, 0, 4]]
    assert (segs.shard_extent, segs.param_extent, segs.grad_extent, segs.n_params) == (5003, 7003, 7003, 2)


def test_segments_cut_aligned_middles_and_ragged_ends():
    assert VEC == 4
    # offsets 1, 5, 9 agree modulo 4 (4, 20 and 36 bytes into a 16-byte vector of fp32): a 3-element
    # head, an aligned middle split at BLOCK, a 1-element tail
    # (columns: shard, length, param, grad, pid, elem: the index in the parameter, vector, block: the
    # row's number); the piece starts at element 10 of its parameter, whose vector phase is 1 (element
    # 13 is aligned), so the middle is cut at the parameter's elements 2049 and 4097 (BLOCK + the phase)
    rows = Segments.build([(1, 5000, 5, 9, 0, 10)]).rows.tolist()
    assert rows == [[1, 3, 5, 9, 0, 10, 0, 0], [4, 2036, 8, 12, 0, 13, 1, 1], [2040, 2048, 2044, 2048, 0, 2049, 1, 2],
                    [4088, 912, 4092, 4096, 0, 4097, 1, 3], [5000, 1, 5004, 5008, 0, 5009, 0, 4]]
    # a piece shorter than its head, and one that is all middle (five columns: elem 0)
    assert Segments.build([(2, 1, 6, 2, 3), (8, 8, 0, 4, 1)]).rows.tolist() == [
        [2, 1, 6, 2, 3, 0, 0, 0], [8, 8, 0, 4, 1, 0, 1, 1]]
    assert vector_elements([(1, 5000, 5, 9, 0), (0, 10, 1, 0, 1)]) == (4996, 5010)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9000), st.integers(0, 9000), st.integers(0, 3), st.integers(0, 3))
def test_rows_are_cut_at_the_parameters_grid_so_a_shard_edge_changes_only_its_own_rows(numel, edge, phase, shift):
    """A parameter of ``numel`` elements at offset ``phase`` of its buffers, whole in one shard, and cut
    by a shard edge at element ``edge`` (the second shard's state shifted by ``shift``): every row of
    the cut layout that holds neither side of the edge is a row of the whole one, with the same
    elements (what lets a reshard keep an 8-bit block's codes, registry.py)."""
    edge = min(edge, numel)
    whole = row_table([(phase, numel, phase, phase, 0, 0)])
    cut = row_table([(phase, edge, phase, phase, 0, 0),
                     (4096 + shift, numel - edge, phase + edge, phase + edge, 0, edge)])

    def runs(table):
        return {(e, n) for e, n in table[:, [5, 1]].tolist()}

    whole_runs, cut_runs = runs(whole), runs(cut)
    # rows of the whole layout away from the edge (and its vector head, tail: VEC elements each side)
    far = {(e, n) for e, n in whole_runs if e + n < edge - 2 * VEC or e > edge + 2 * VEC}
    assert {r for r in far if r[0] + r[1] <= edge} <= cut_runs  # before the edge: never moved
    if (phase + edge - (4096 + shift)) % VEC == 0:  # the second shard keeps the vector phase
        assert far <= cut_runs
    assert sum(n for _, n in cut_runs) == numel and sum(n for _, n in whole_runs) == numel


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(*(st.integers(0, 5000),) * 4, st.integers(0, 9)), max_size=8))
def test_vector_rows_are_aligned_in_every_space_and_cover_each_piece_once(pieces):
    """The interpreter ignores alignment hints, so a wrong vector flag would pass every parity test here
    and fault (or corrupt) on a GPU: check the promise the flag makes on the table itself."""
    rows = Segments.build(pieces).rows.tolist()
    for so, n, po, go, _, _, vector, _ in rows:
        assert 0 < n <= (BLOCK if vector else SCALAR_BLOCK)  # what one program covers without a loop
        if vector:
            assert so % VEC == po % VEC == go % VEC == n % VEC == 0
    covered = sorted((so, po, go, pid) for so, n, po, go, pid, *_ in rows for so, po, go in
                     zip(range(so, so + n), range(po, po + n), range(go, go + n)))
    expected = sorted((so, po, go, pid) for so, n, po, go, pid in pieces for so, po, go in
                      zip(range(so, so + n), range(po, po + n), range(go, go + n)))
    assert covered == expected
    assert vector_elements(pieces) == (sum(r[1] for r in rows if r[6]), sum(p[1] for p in pieces))
    assert [r[7] for r in rows] == list(range(len(rows)))  # every row numbered: the 8-bit blocks


def test_grad_sumsq_matches_torch_and_counts_non_finite():
    pk = Packed(SIZES, 3)
    grads = [torch.randn(n) for n in SIZES]
    grads[2][5] = float("inf")
    grads[3][7] = float("nan")
    buf = pk.flat(grads, torch.bfloat16, pad=float("nan"))
    coefs = adam_coefficients(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                              step=[1] * len(SIZES), decoupled=True, grad_div=2.0)
    total_sq, total_bad = torch.zeros(()), torch.zeros(())
    for r in range(3):
        sq, bad = grad_sumsq(Segments.build(pk.rows(r)), coefs, grad=buf, grad_scale=torch.tensor([4.0]))
        total_sq += sq
        total_bad += bad
    flat = torch.cat([g.to(torch.bfloat16).float() / 2.0 / 4.0 for g in grads])
    finite = flat[flat.isfinite()]
    torch.testing.assert_close(total_sq, (finite * finite).sum(), rtol=1e-5, atol=0)
    assert total_bad.item() == 2


def _adam_buffers(n=64):
    return dict(grad=torch.zeros(n), param=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))


COEFS = adam_coefficients(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, decoupled=True)


@pytest.mark.parametrize("change,match", [
    ({"exp_avg": torch.zeros(64, dtype=torch.int32)}, "exp_avg has dtype"),
    ({"exp_avg": torch.zeros(64, dtype=torch.bfloat16)}, "share one storage format"),
    ({"exp_avg": torch.zeros(64, dtype=torch.uint8), "exp_avg_sq": torch.zeros(64, dtype=torch.uint8)},
     "needs its scales"),
    ({"scales": {"exp_avg": torch.zeros(1)}}, "scales are for 8-bit"),
    ({"stochastic": True}, "stochastic rounding writes bf16"),
    ({"grad": torch.zeros(64, dtype=torch.int32)}, "grad has dtype"),
    ({"param": torch.zeros(8, 8)}, "param must be a contiguous 1-D"),
    ({"exp_avg_sq": torch.zeros(10)}, "state/master shard"),
    ({"param": torch.zeros(10)}, "parameter buffer"),
    ({"grad": torch.zeros(10)}, "gradient buffer"),
    ({"master": torch.zeros(64, dtype=torch.float16)}, "master has dtype"),
    ({"found_inf": torch.zeros(2)}, "found_inf must be a one-element"),
    ({"grad": [0.0] * 64}, "grad must be a torch.Tensor"),
])
def test_bad_arguments_raise_clearly(change, match):
    args = {**_adam_buffers(), **change}
    with pytest.raises((TypeError, ValueError), match=match):
        adam_step(Segments.build([(0, 64, 0, 0, 0)]), COEFS, **args)


def test_bad_tables_raise_clearly():
    with pytest.raises(ValueError, match="negative"):
        Segments.build([(0, -1, 0, 0, 0)])
    with pytest.raises(ValueError, match="coefficient table"):
        adam_step(Segments.build([(0, 8, 0, 0, 3)]), COEFS, **_adam_buffers())
    with pytest.raises(ValueError, match="coefs must be"):
        adam_step(Segments.build([(0, 8, 0, 0, 0)]), COEFS.double(), **_adam_buffers())
    with pytest.raises(ValueError, match="step must be >= 1"):
        adam_coefficients(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=0, decoupled=True)
    with pytest.raises(ValueError, match="nesterov"):
        sgd_step(Segments.build([(0, 8, 0, 0, 0)]), sgd_coefficients(lr=1, momentum=0, dampening=0,
                 weight_decay=0, first=True), grad=torch.zeros(8), param=torch.zeros(8), nesterov=True)


def test_cpu_tensors_without_the_interpreter_raise_clearly():
    import subprocess
    import sys
    code = ("import torch; from fused_zero.kernels import Segments, adam_coefficients, adam_step\n"
            "c = adam_coefficients(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, "
            "decoupled=True)\n"
            "z = torch.zeros(8)\n"
            "adam_step(Segments.build([(0, 8, 0, 0, 0)]), c, grad=z, param=z.clone(), exp_avg=z.clone(), "
            "exp_avg_sq=z.clone())")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                          cwd="/")
    assert proc.returncode != 0 and "TRITON_INTERPRET=1" in proc.stderr, proc.stderr[-2000:]
