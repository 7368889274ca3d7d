"""Layout model: RaggedShard semantics, constructors, buffer layouts and the interval algebra."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragckpt import LayoutError, RaggedShard, copy_plan, element_layout, flat_range_to_boxes, row_layout
from ragckpt.format.layout import FlatLayout, PerTensorLayout
from ragckpt.planner.planner import plan_layout

# -- RaggedShard -------------------------------------------------------------------------------------


def test_reference_example_row_chunks():
    # REFERENCE.md: torch.chunk of 10 rows on 4 ranks is dims=(0,), units (3,3,3,1)
    p = RaggedShard.row_chunks((10, 5), 4)
    assert p == RaggedShard((0,), (3, 3, 3, 1))
    assert p.ranges((10, 5)).tolist() == [[0, 15], [15, 30], [30, 45], [45, 50]]
    # and it agrees with torch.chunk itself
    x = torch.arange(50).reshape(10, 5)
    for r, piece in enumerate(torch.chunk(x, 4)):
        a, b = p.ranges((10, 5))[r]
        assert torch.equal(piece.reshape(-1), x.reshape(-1)[a:b])


def test_rows_fewer_than_ranks_leave_trailing_ranks_empty():
    p = RaggedShard.row_chunks((3, 2), 8)
    assert p.local_units == (1, 1, 1, 0, 0, 0, 0, 0)
    assert [p.local_shape((3, 2), r) for r in (0, 3)] == [(1, 2), (0, 2)]
    assert RaggedShard.whole(2, owner=1).local_shape((3, 2), 1) == (3, 2)
    with pytest.raises(LayoutError, match="cuts a dim-0 row"):
        RaggedShard((0, 1), (1, 5)).local_shape((3, 2), 0)


def test_units_are_scale_free():
    a = RaggedShard((0,), (2, 2, 0, 1)).ranges((10, 3))
    b = RaggedShard((0,), (4, 4, 0, 2)).ranges((10, 3))
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize(
    "placement, shape, message",
    [
        (RaggedShard((0,), (3, 3)), (10, 2), "not divisible"),
        (RaggedShard((0,), (0, 0)), (4, 2), "all zero"),
        (RaggedShard((), (1, 1)), (4,), "one owner"),
        (RaggedShard((0, 1), (1, 1, 1)), (3,), "more dims"),
    ],
)
def test_invalid_placements_name_the_problem(placement, shape, message):
    with pytest.raises(LayoutError, match=message):
        placement.ranges(shape)


def test_boundary_cutting_a_row_is_rejected():
    # 12 elements in rows of 4, units (1, 2) -> boundary at element 4 is fine; (1, 5) -> at 2: bad
    RaggedShard((0,), (1, 2)).ranges((3, 4))
    with pytest.raises(LayoutError, match="cuts a row"):
        RaggedShard((0,), (1, 5)).ranges((3, 4))


def test_bad_dims_and_units():
    with pytest.raises(LayoutError, match="prefix"):
        RaggedShard((1,), (1,))
    with pytest.raises(LayoutError, match="non-negative"):
        RaggedShard((0,), (1, -1))
    with pytest.raises(LayoutError, match="empty"):
        RaggedShard((0,), ())


def test_whole_and_zero_size():
    p = RaggedShard.whole(4, owner=2)
    assert p.ranges((3, 3)).tolist() == [[0, 0], [0, 0], [0, 9], [9, 9]]
    z = RaggedShard((0,), (0, 0, 0))
    assert z.ranges((0, 5)).tolist() == [[0, 0]] * 3


def test_flat_partition_matches_fsdp1_style_split():
    shapes = [(3, 4), (5,), (2, 2, 2)]
    W = 4
    parts = RaggedShard.flat_partition(shapes, W)
    flat = torch.arange(12 + 5 + 8)
    padded = torch.cat([flat, torch.full((28 - 25,), -1)])  # end padding to a multiple of W
    per_rank = padded.chunk(W)
    # rebuild each rank's flat shard from the placements and compare with the equal split
    bases = [0, 12, 17]
    for r in range(W):
        got = []
        for shape, p, base in zip(shapes, parts, bases, strict=True):
            a, b = p.ranges(shape)[r]
            got.append(flat[base + a : base + b])
        got = torch.cat(got)
        assert torch.equal(got, per_rank[r][: len(got)])
        assert (per_rank[r][len(got):] == -1).all()


# -- buffer layouts ------------------------------------------------------------------------------------

def _check_tiling(lay):
    """Every tensor covered exactly once; rank buffers never overlap."""
    seg = lay.segments()
    for t, n in enumerate(lay.numels):
        s = seg.for_slot(t)
        assert int(s.length.sum()) == int(n)
        if len(s):
            assert s.flat_start[0] == 0
            assert np.all(s.flat_start[1:] == s.flat_start[:-1] + s.length[:-1])
    sizes = lay.rank_sizes()
    for r in range(lay.world_size):
        s = lay.rank_segments(r)
        if len(s):
            assert np.all(s.offset[1:] >= s.offset[:-1] + s.length[:-1])
            assert int((s.offset + s.length).max()) <= int(sizes[r])


def test_row_layout_buffers_concatenate_local_pieces():
    shapes = [(5, 2), (3,), ()]
    lay = row_layout(shapes, 2)
    assert lay.rank_sizes().tolist() == [3 * 2 + 2 + 1, 2 * 2 + 1]
    _check_tiling(lay)
    assert lay.placement(0) == RaggedShard((0,), (3, 2))


def test_per_tensor_layout_from_arbitrary_placements():
    shapes = [(6, 2), (4,)]
    placements = [RaggedShard((0,), (2, 0, 4)), RaggedShard((0,), (1, 1, 2))]
    lay = PerTensorLayout.from_placements(shapes, placements)
    _check_tiling(lay)
    for t in range(2):
        assert lay.placement(t).ranges(shapes[t]).tolist() == placements[t].ranges(shapes[t]).tolist()


def test_per_tensor_layout_from_placements_of_empty_tensors_warns_nothing():
    """A (3, 0) tensor's unit holds no element: counting its rows divided by zero, and numpy printed
    a RuntimeWarning into the user's output (the result was right)."""
    import warnings

    shapes = [(3, 0), (0,), (4, 2)]
    placements = [RaggedShard((0,), (1, 2)), RaggedShard((0,), (1, 0)), RaggedShard((0,), (1, 1))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lay = PerTensorLayout.from_placements(shapes, placements)
    assert lay.units.tolist() == [[0, 0], [0, 0], [2, 2]]
    _check_tiling(lay)


def test_flat_layout_rejects_overlap_and_split_blocks():
    with pytest.raises(LayoutError, match="overlap"):
        FlatLayout(2, 4, ((4,), (4,)), (1, 1), (0, 2))
    with pytest.raises(LayoutError, match="cuts a unit"):
        FlatLayout(2, 4, ((3, 2),), (1,), (1,))  # rows of 2 from offset 1: boundary 4 cuts a row
    with pytest.raises(LayoutError, match="whole-owned"):
        FlatLayout(2, 4, ((6,),), (0,), (0,))
    with pytest.raises(LayoutError, match="do not fit"):
        FlatLayout(2, 4, ((6,),), (1,), (3,))


def test_element_layout_is_fsdp1_flat_partition():
    shapes = [(3, 4), (5,), (2, 2, 2)]
    lay = element_layout(shapes, 4)
    ref = RaggedShard.flat_partition(shapes, 4)
    for t in range(3):
        assert lay.placement(t) == ref[t]


# -- property tests --------------------------------------------------------------------------------------

shape_st = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)
shapes_st = st.lists(shape_st, min_size=1, max_size=6)
policy_st = st.sampled_from(["element", "row", "rows:2", "whole"])


def _build(kind, shapes, W, policy):
    if kind == "row":
        return row_layout(shapes, W)
    if kind == "element":
        return element_layout(shapes, W)
    return plan_layout([f"t{i}" for i in range(len(shapes))], shapes, W, policy, align=1)


@settings(max_examples=150, deadline=None)
@given(shapes=shapes_st, W=st.integers(1, 9), policy=policy_st, kind=st.sampled_from(["ragged", "row", "element"]))
def test_layouts_tile_tensors_exactly(shapes, W, policy, kind):
    lay = _build(kind, shapes, W, policy)
    _check_tiling(lay)
    for t, shape in enumerate(shapes):
        p = lay.placement(t)
        assert p.world_size == W
        rng = p.ranges(shape)  # re-validates every RaggedShard rule
        assert int((rng[:, 1] - rng[:, 0]).sum()) == int(np.prod(shape, dtype=np.int64))


@settings(max_examples=150, deadline=None)
@given(shapes=shapes_st, W1=st.integers(1, 9), W2=st.integers(1, 9), data=st.data())
def test_copy_plan_reproduces_target_exactly(shapes, W1, W2, data):
    k1 = data.draw(st.sampled_from(["ragged", "row", "element"]))
    k2 = data.draw(st.sampled_from(["ragged", "row", "element"]))
    p1, p2 = data.draw(policy_st), data.draw(policy_st)
    src, dst = _build(k1, shapes, W1, p1), _build(k2, shapes, W2, p2)
    # materialise source buffers from distinct values, apply the plan, compare with the target built directly
    values = [torch.arange(int(np.prod(s, dtype=np.int64)), dtype=torch.int64) + 1000 * i for i, s in enumerate(shapes)]

    def buffers(lay):
        out = [torch.full((int(n),), -1, dtype=torch.int64) for n in lay.rank_sizes()]
        seg = lay.segments()
        for i in range(len(seg)):
            t, fs, n, r, o = (int(x[i]) for x in (seg.slot, seg.flat_start, seg.length, seg.rank, seg.offset))
            out[r][o : o + n] = values[t][fs : fs + n]
        return out

    src_bufs, want = buffers(src), buffers(dst)
    got = [torch.full((int(n),), -1, dtype=torch.int64) for n in dst.rank_sizes()]
    plan = copy_plan(src, dst)
    assert plan.total == sum(int(np.prod(s, dtype=np.int64)) for s in shapes)
    for i in range(len(plan)):
        sr, so, dr, do, n = (int(x[i]) for x in (plan.src_rank, plan.src_offset, plan.dst_rank, plan.dst_offset, plan.length))
        got[dr][do : do + n] = src_bufs[sr][so : so + n]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    # coalesced: no two neighbouring runs continue each other
    if len(plan) > 1:
        cont = ((plan.src_rank[1:] == plan.src_rank[:-1]) & (plan.dst_rank[1:] == plan.dst_rank[:-1])
                & (plan.src_offset[1:] == plan.src_offset[:-1] + plan.length[:-1])
                & (plan.dst_offset[1:] == plan.dst_offset[:-1] + plan.length[:-1]))
        assert not cont.any()


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple), data=st.data())
def test_flat_range_maps_to_at_most_2d_minus_1_boxes(shape, data):
    n = int(np.prod(shape))
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    boxes = flat_range_to_boxes(shape, a, b)
    assert len(boxes) <= max(1, 2 * len(shape) - 1) or a == b
    x = torch.arange(n).reshape(shape)
    covered = []
    for off, size in boxes:
        sl = tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))
        covered.append(x[sl].reshape(-1))
    got = torch.cat(covered) if covered else torch.zeros(0, dtype=torch.long)
    assert torch.equal(got, torch.arange(a, b))


def test_layouts_compare_by_value():
    import ragckpt

    spec = {"a": ((6, 4), "float32"), "b": ((5,), "bfloat16")}
    for kind in ("row", "ragged", "element"):
        one = ragckpt.CheckpointLayout.build(spec, 3, kind)
        assert one == ragckpt.CheckpointLayout.build(spec, 3, kind)
        assert one != ragckpt.CheckpointLayout.build(spec, 4, kind)
        assert len({*one.layouts, *ragckpt.CheckpointLayout.build(spec, 3, kind).layouts}) == len(one.layouts)
    assert ragckpt.CheckpointLayout.build(spec, 3, "row") != ragckpt.CheckpointLayout.build(spec, 3, "element")
