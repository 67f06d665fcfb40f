"""The layout module alone: no process group, no device."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fused_zero.kernels import VEC
from fused_zero.pipeline.buckets.layout import ALIGN, REPLICATED, BucketLayout, alignment, reshard_plan, vector_share


def layout(numels, world, rank=0, order=None):
    order = order or list(range(len(numels)))
    offsets, pos = [0] * len(numels), 0
    for i in order:
        offsets[i] = pos
        pos += numels[i]
    return BucketLayout.build(range(len(numels)), numels, offsets, world, rank)


def test_head_tail_and_regions():
    lay = layout([7, 1000, 4099], world=3, rank=1)
    assert lay.numel == 5106
    align = alignment(5106, 3)
    assert align == ALIGN  # 8 * 3 * 32 * 3 <= 5106
    assert lay.shard == 5106 // (3 * align) * align == 1696
    assert (lay.head, lay.tail, lay.region_size) == (5088, 18, 1714)
    assert lay.shard % align == 0 and lay.tail < 3 * align


@pytest.mark.parametrize("numel,world,align", [
    (12_500_000, 8, 32), (12_500_000, 256, 16), (12_500_000, 1024, 1), (100, 2, 2), (5, 4, 1),
    (5106, 3, 32)])
def test_alignment_keeps_the_tail_under_an_eighth_of_a_slice(numel, world, align):
    assert alignment(numel, world) == align
    lay = BucketLayout.build([0], [numel], [0], world, 0)
    assert lay.tail < world * align
    if align < ALIGN:
        assert 8 * world * align * world <= numel or align == 1


def test_tiny_bucket_is_all_tail():
    lay = layout([1, 2], world=4)  # fewer elements than ranks
    assert lay.shard == 0 and lay.tail == 3 and lay.region_size == 3
    assert [(p.local, p.length, p.region_off) for p in lay.pieces(2)] == [(0, 1, 0), (1, 2, 1)]


@settings(max_examples=60, deadline=None)
@given(numels=st.lists(st.integers(1, 300), min_size=1, max_size=6), world=st.integers(1, 5),
       shuffle=st.randoms())
def test_pieces_cover_every_element_once(numels, world, shuffle):
    order = list(range(len(numels)))
    shuffle.shuffle(order)
    lay = layout(numels, world, order=order)
    head_owner = {}
    for r in range(world):
        pieces = lay.pieces(r)
        # pieces do not overlap, hold exactly the slice and the tail, and sit in the rank's region
        spans = sorted((p.region_off, p.region_off + p.length) for p in pieces)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert sum(p.length for p in pieces) == lay.shard + lay.tail
        assert not spans or spans[-1][1] <= lay.region_tail(r)[1]
        assert lay.region_tail(r)[1] - lay.shard - lay.tail < 2 * VEC
        for p in pieces:
            # same place within a vector in the region and in the bucket (the kernels' vector path)
            assert (p.region_off - p.bucket_off) % VEC == 0
            for k in range(p.length):
                pos = p.bucket_off + k
                assert pos == lay.offsets[p.local] + p.elem + k
                if pos < lay.head:
                    assert pos not in head_owner
                    head_owner[pos] = r
    assert sorted(head_owner) == list(range(lay.head))
    for local in range(len(numels)):
        runs = lay.owners(local, 0)
        assert runs[0][0] == 0 and runs[-1][1] == numels[local]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(runs))


@settings(max_examples=40, deadline=None)
@given(numels=st.lists(st.integers(1, 200), min_size=1, max_size=5), world=st.integers(1, 4),
       split=st.integers(0, 4), shuffle=st.randoms())
def test_reshard_plan_moves_every_value_to_its_new_place(numels, world, split, shuffle):
    """Simulate the state of every rank as {(pid, element): value} and apply the plan."""
    old = layout(numels, world)
    pids = list(range(len(numels)))
    shuffle.shuffle(pids)
    cut = min(split, len(pids) - 1) + 1
    new_buckets = [pids[:cut], pids[cut:]] if cut < len(pids) else [pids]
    regions_old = {}
    for r in range(world):
        for p in old.pieces(r):
            for k in range(p.length):
                regions_old[(r, p.region_off + k)] = (old.pids[p.local], p.elem + k)
    for bucket in new_buckets:
        offsets, pos = [], 0
        for pid in bucket:
            offsets.append(pos)
            pos += numels[pid]
        new = BucketLayout.build(bucket, [numels[p] for p in bucket], offsets, world, 0)
        plan = reshard_plan(new, {pid: (old, pid) for pid in bucket})
        filled = {}
        for t in plan:
            for k in range(t.length):
                filled[(t.dst, t.dst_off + k)] = regions_old[(t.src, t.src_off + k)]
        for r in range(world):
            for p in new.pieces(r):
                for k in range(p.length):
                    assert filled[(r, p.region_off + k)] == (new.pids[p.local], p.elem + k)


def test_tail_transfers_come_from_the_receiver_itself():
    old = layout([3], world=4)  # all tail: replicated
    new = BucketLayout.build([0], [3], [0], 4, 0)
    assert all(t.src == t.dst for t in reshard_plan(new, {0: (old, 0)}))
    assert old.owners(0, 2) == [(0, 3, REPLICATED, 0)]


@pytest.mark.parametrize("bad,match", [
    (dict(pids=[0, 1], numels=[4, 4], offsets=[0, 2]), "overlaps"),
    (dict(pids=[0], numels=[4, 4], offsets=[0]), "one offset"),
])
def test_bad_buckets_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        BucketLayout.build(bad["pids"], bad["numels"], bad["offsets"], 2, 0)


def gpt2_small_shapes():
    """Parameter shapes of GPT-2 small (124M) in registration order, embedding tied with the head."""
    d, layers = 768, 12
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return [(50257, d), (1024, d)] + block * layers + [(d,), (d,)]


def demo_model_shapes():
    from fused_zero.demo.model import GPT, CharTokenizer, GPTConfig, load_corpus
    model = GPT(GPTConfig(vocab_size=CharTokenizer(load_corpus()).vocab_size))
    return [tuple(p.shape) for p in model.parameters()]


def ddp_layouts(shapes, world, rank, cap_mb=25):
    """The layouts of the buckets DDP rebuilds after its first iteration, modelled as torch does it with
    gradients ready in reverse registration order: torch's own bucket assignment (1 MB first bucket,
    then ``cap_mb``), each bucket's parameters back to back in bucket order."""
    import torch
    import torch.distributed as dist
    order = list(reversed(range(len(shapes))))
    tensors = [torch.empty(shapes[i], device="meta") for i in order]
    buckets, _ = dist._compute_bucket_assignment_by_size(
        tensors, [dist._DEFAULT_FIRST_BUCKET_BYTES, cap_mb * 2 ** 20])
    layouts = []
    for bucket in buckets:
        pids = [order[i] for i in bucket]
        numels = [math.prod(shapes[p]) for p in pids]
        offsets = [sum(numels[:k]) for k in range(len(numels))]
        layouts.append(BucketLayout.build(pids, numels, offsets, world, rank))
    return layouts


@pytest.mark.parametrize("world", [1, 2, 8, 64])
@pytest.mark.parametrize("model", ["gpt2_small", "demo"])
def test_vector_path_covers_at_least_99_percent(model, world):
    shapes = gpt2_small_shapes() if model == "gpt2_small" else demo_model_shapes()
    if model == "gpt2_small":
        assert sum(math.prod(s) for s in shapes) == 124_439_808
    layouts = [lay for rank in range(world) for lay in ddp_layouts(shapes, world, rank)]
    share = vector_share(layouts)
    print(f"{model} W={world}: {share:.6f} of the elements on the vector path")
    assert share >= 0.99


def test_vector_share_counts_only_aligned_runs():
    # 10 elements at bucket offsets 0..9: with W=1 the region is the bucket; rows [0,4) and [4,8) vector
    lay = BucketLayout.build([0, 1], [3, 7], [0, 3], 1, 0)
    assert vector_share([lay]) == pytest.approx(4 / 10)  # [4, 8); [0,3),[3,4),[8,10) not
    odd = BucketLayout.build([0], [1000], [0], 1, 0)
    assert vector_share([odd]) == 1000 / 1000
