"""The layout module alone: no process group, no device."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fused_zero.layout import ALIGN, REPLICATED, BucketLayout, alignment, reshard_plan


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
        # regions are dense: pieces tile [0, region_size)
        assert sorted((p.region_off, p.length) for p in pieces) == \
            [(p.region_off, p.length) for p in sorted(pieces, key=lambda p: p.region_off)]
        assert sum(p.length for p in pieces) == lay.region_size
        for p in pieces:
            for k in range(p.length):
                pos = p.bucket_off + k
                assert pos == lay.offsets[p.local] + p.elem + k
                if pos < lay.head:
                    assert pos not in head_owner
                    head_owner[pos] = r
    assert sorted(head_owner) == list(range(lay.head))
    for local in range(len(numels)):
        runs = lay.owners(local)
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
    assert old.owners(0) == [(0, 3, REPLICATED, 0)]


@pytest.mark.parametrize("bad,match", [
    (dict(pids=[0, 1], numels=[4, 4], offsets=[0, 2]), "overlaps"),
    (dict(pids=[0], numels=[4, 4], offsets=[0]), "one offset"),
])
def test_bad_buckets_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        BucketLayout.build(bad["pids"], bad["numels"], bad["offsets"], 2, 0)
