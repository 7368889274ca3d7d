"""Validation, granularity policies and odd placements of the layout model: `FlatLayout`,
`PerTensorLayout`, `RaggedShard`, `flat_range_to_boxes`, the planner's granularity rules and the
resharding plan (`follow_params`, `target_layout`, `SourceIndex.join`, `rank_plan`).

Each check states its expectation independently: an exact error type and message fragment, a value
worked out by hand from the layout's defining rule, or the original tensors after a round trip.
"""

from __future__ import annotations

import pytest
import torch

import ragckpt
from ragckpt import (
    BufferSpec,
    CheckpointLayout,
    FlatLayout,
    LayoutError,
    PerTensorLayout,
    RaggedShard,
    row_layout,
)
from ragckpt.format.intervals import flat_range_to_boxes
from ragckpt.planner.planner import granularity_of, plan_layout
from ragckpt.reshard.plan import SourceIndex, follow_params, rank_plan, target_layout
from tests.helpers import assert_bit_equal, special_tensor

# -- layouts whose buffer order is not slot order ---------------------------------------------------------


def test_rank_segments_come_in_buffer_order_when_slots_are_not():
    """Guards `rank_segments` returning a rank's pieces in slot order when the offsets put them in another order."""
    lay = FlatLayout(1, 10, ((4,), (6,)), (1, 1), (6, 0))  # slot 1 at [0, 6), slot 0 at [6, 10)
    seg = lay.rank_segments(0)
    assert seg.offset.tolist() == [0, 6]
    assert seg.slot.tolist() == [1, 0]
    assert seg.length.tolist() == [6, 4]
    assert seg.flat_start.tolist() == [0, 0]


def test_custom_flat_layout_out_of_slot_order_round_trips(tmp_path):
    """Guards saving, reading, loading and resharding a custom flat layout whose tensors are not in slot order in the buffer."""
    # global buffer of 2 x 6: b at [0, 3), a at [3, 6), c at [6, 11), one element of padding
    flat = FlatLayout(2, 6, ((3,), (3,), (5,)), (1, 1, 1), (3, 0, 6))
    lay = CheckpointLayout(2, "custom", [flat], [BufferSpec("float32", "float32", 0, ("a", "b", "c"))])
    state = {"a": special_tensor((3,), torch.float32, 1), "b": special_tensor((3,), torch.float32, 2),
             "c": special_tensor((5,), torch.float32, 3)}
    ranks = [torch.cat([state["b"], state["a"]]), torch.cat([state["c"], torch.zeros(1)])]
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    for r, buf in enumerate(ranks):
        ragckpt.save_shard(src, r, {"float32": buf}, lay)
    ragckpt.commit(src)
    ck = ragckpt.open(src)
    assert ck.kind == "custom"
    for name, want in state.items():
        assert_bit_equal(ck.read(name), want, name)
    for r, want in enumerate(ranks):
        assert_bit_equal(ck.read_rank(0, r), want, f"stored rank {r}")
        assert_bit_equal(ragckpt.load(ck, lay, r)["float32"], want, f"loaded rank {r}")
    ragckpt.reshard.reshard(src, dst, 2, layout="row")
    out = ragckpt.open(dst)
    for name, want in state.items():
        assert_bit_equal(out.read(name), want, name)
    for r in range(2):
        assert_bit_equal(out.read_rank(0, r), torch.cat([state[n].chunk(2)[r] for n in ("a", "b", "c")]),
                         f"row rank {r}")


# -- refusals of inconsistent plans -------------------------------------------------------------------------


def test_join_refuses_a_source_that_covers_part_of_a_destination_piece():
    """Guards a join silently producing runs that fill only part of a destination piece (a source with holes)."""
    with pytest.raises(LayoutError, match=r"source segments cover 4 of 6 elements .*the source layout has holes"):
        SourceIndex(row_layout([(4,)], 1)).join(row_layout([(6,)], 1).rank_segments(0))


def test_rank_plan_refuses_layouts_of_different_shapes():
    """Guards `rank_plan` copying between layouts of different tensor shapes instead of refusing."""
    with pytest.raises(LayoutError, match="different tensor shapes"):
        rank_plan(row_layout([(4,)], 1), row_layout([(2,)], 1), 0)


# -- layout validation ----------------------------------------------------------------------------------------


def test_flat_layout_refuses_a_shard_size_that_cuts_units_of_a_long_tensor():
    """Guards a tensor that crosses two rank boundaries being accepted when the shard size is not a multiple of its unit."""
    # (4, 2) by rows at offset 1, S = 3: the first boundary (3) is on a row edge, the second (6) is not
    with pytest.raises(LayoutError, match=r"tensor #0 \(shape \(4, 2\)\): a rank boundary cuts a unit of 2 elements"):
        FlatLayout(3, 3, ((4, 2),), (1,), (1,))
    FlatLayout(3, 4, ((4, 2),), (1,), (2,))  # S = 4: every boundary on a row edge


def test_per_tensor_layout_refuses_negative_units():
    """Guards negative unit counts passing because the row total still adds up (3 + -1 rows of a 2-row tensor)."""
    with pytest.raises(LayoutError, match="unit counts must be non-negative"):
        PerTensorLayout(2, ((2, 3),), (1,), [[3, -1]])


def test_whole_owned_empty_tensor_still_has_one_owner():
    """Guards a whole-owned (dims=()) tensor with no elements being given two owners."""
    with pytest.raises(LayoutError, match="a whole-owned tensor \\(dims=\\(\\)\\) has more than one owning rank"):
        PerTensorLayout(2, ((0,),), (0,), [[1, 1]])
    assert PerTensorLayout(2, ((0,),), (0,), [[0, 1]]).rank_sizes().tolist() == [0, 0]


def test_units_of_several_rows_give_row_aligned_ranges():
    """Guards a unit that is not a whole number of rows being refused when every boundary still falls on a row edge."""
    # 12 elements over 6 units: 2 elements per unit, rows of 4; boundaries at 4 and 12 are row edges
    rng = RaggedShard((0,), (2, 4)).ranges((3, 4))
    assert rng.dtype == "int64" and rng.tolist() == [[0, 4], [4, 12]]
    with pytest.raises(LayoutError, match="cuts a row of 4 elements"):
        RaggedShard((0,), (1, 5)).ranges((3, 4))  # boundary at 2


def test_whole_refuses_an_owner_outside_the_world():
    """Guards `RaggedShard.whole` accepting owner == world size (an IndexError, or a placement with no owner)."""
    with pytest.raises(LayoutError, match="owner rank 4 is outside world size 4"):
        RaggedShard.whole(4, owner=4)
    with pytest.raises(LayoutError, match="owner rank -1 is outside world size 4"):
        RaggedShard.whole(4, owner=-1)
    assert RaggedShard.whole(4, owner=3).local_units == (0, 0, 0, 1)


@pytest.mark.parametrize("policy", [0, -6])
def test_explicit_granularity_must_be_positive(policy):
    """Guards a zero or negative element-count granularity (a multiple of the row size) being accepted."""
    with pytest.raises(LayoutError, match=f"granularity {policy} must be a positive multiple of the row size 6"):
        granularity_of(policy, (4, 6))
    assert granularity_of(12, (4, 6)) == (12, 1)


def test_a_range_of_a_zero_d_tensor_is_one_empty_box():
    """Guards the one element of a 0-d tensor not being described as the single box ((), ())."""
    assert flat_range_to_boxes((), 0, 1) == [((), ())]
    assert flat_range_to_boxes((), 0, 0) == []


# -- granularity policies --------------------------------------------------------------------------------------


def test_a_mapping_without_default_plans_other_tensors_by_row():
    """Guards a per-name granularity mapping without "*" giving the tensors it does not name a default other than row."""
    lay = plan_layout(["a", "b"], [(4, 3), (4, 3)], 2, {"b": "whole"})
    assert lay.dims == (1, 0)
    assert lay.placement(0).dims == (0,) and lay.placement(1).dims == ()


def test_optimizer_state_of_another_shape_does_not_follow_its_parameter():
    """Guards optimizer state being given its parameter's policy when its shape differs (row stats of a whole matrix)."""
    p = follow_params({"w": "whole", "*": "row"}, ["w", "optim.state.w.row_stats"], [(6, 4), (6,)])
    assert p("optim.state.w.row_stats", (6,)) == "row"
    assert p("w", (6, 4)) == "whole"


def test_a_policy_named_for_optimizer_state_wins_over_its_parameters():
    """Guards a policy given for an optimizer-state tensor by name being overridden by its parameter's policy."""
    names, shapes = ["w", "optim.state.w.exp_avg", "optim.state.w.exp_avg_sq"], [(6, 4)] * 3
    p = follow_params({"w": "rows:2", "optim.state.w.exp_avg": "whole", "*": "row"}, names, shapes)
    assert p("optim.state.w.exp_avg", (6, 4)) == "whole"
    assert p("optim.state.w.exp_avg_sq", (6, 4)) == "rows:2"  # follows w


def test_a_ragged_target_of_an_element_source_is_planned_by_rows():
    """Guards granularity being inferred from a non-ragged source (an element source would make the target element-granular)."""
    src = CheckpointLayout.build({"w": ((6, 4), "float32")}, 3, "element")
    assert src.layouts[0].dims == (2,)
    assert target_layout(src, 5, "ragged").layouts[0].dims == (1,)


# -- sizes past float64's exact range and past int64, and loosely typed arguments ----------------------------

def test_coalesced_runs_are_exact_past_2_53_elements():
    """Run lengths were summed in float64 (a weighted bincount): one run of 2**61 + 1 elements came
    out as 2**61, a plan one element short, from both the public copy plan and the resharder's."""
    from ragckpt.format.intervals import copy_plan
    from ragckpt.format.layout import element_layout

    shapes = [(2**60 + 1,), (2**60,)]
    p = copy_plan(element_layout(shapes, 1), row_layout(shapes, 1))
    assert p.length.tolist() == [2**61 + 1]
    src = CheckpointLayout.build({"a": (shapes[0], "uint8"), "b": (shapes[1], "uint8")}, 1, "element")
    dst = target_layout(src, 1, "row")
    assert rank_plan(src.layouts[0], dst.layouts[0], 0).length.tolist() == [2**61 + 1]


@pytest.mark.parametrize("kind", ["ragged", "row", "element"])
def test_a_buffer_totalling_2_62_elements_is_refused_whatever_each_tensor_holds(kind):
    """Each tensor was checked, never their sum: a row layout built with negative rank sizes, an
    element layout said "tensors do not fit in 8 x -576461164620283904", a ragged one failed later
    with a raw numpy error."""
    n = 2**62 - 2**40
    with pytest.raises(LayoutError, match=r"the 3 tensors of one buffer \('t0', ...\) total 13,835,054,756,747,280,384"):
        CheckpointLayout.build({f"t{i}": ((n,), "float32") for i in range(3)}, 8, kind)
    with pytest.raises(LayoutError, match="tensors total .* more than a buffer can address"):
        FlatLayout(1, 2**61, ((2**61,), (2**61,)), (1, 1), (0, 2**61))
    with pytest.raises(LayoutError, match="4 ranks x 2,305,843,009,213,693,952 elements is more than a buffer"):
        FlatLayout(4, 2**61, ((3,),), (1,), (0,))
    with pytest.raises(LayoutError, match=r"a shape \(4611686018427387904, 4\) is more than a layout can address"):
        RaggedShard((0,), (2**61, 2**61)).ranges((2**62, 4))
    with pytest.raises(LayoutError, match="more than a layout can address"):
        RaggedShard.flat_partition([(2**62,), (2**62,)], 8)


def test_numpy_integer_arguments_are_plain_ints_in_the_metadata(tmp_path):
    """`positive_int` accepted np.int64 but its result was dropped, so the numpy value reached the
    JSON metadata: "Object of type int64 is not JSON serializable" from write_global and reshard
    (world size, align), and an np.int64 granularity was "unknown granularity '6'"."""
    import numpy as np

    state = {"a": special_tensor((6, 4), torch.float32, 1), "b": special_tensor((5,), torch.bfloat16, 2)}
    ragckpt.write_global(state, str(tmp_path / "x"), np.int64(3), granularity=np.int64(8))
    ragckpt.write_global(state, str(tmp_path / "al"), 4, layout="element", align=np.int64(8))
    ragckpt.reshard.reshard(str(tmp_path / "x"), str(tmp_path / "y"), np.int64(2), granularity=np.int64(4))
    for where, w in (("x", 3), ("al", 4), ("y", 2)):
        ck = ragckpt.open(str(tmp_path / where))
        assert ck.world_size == w and type(ck.world_size) is int
        for name, t in state.items():
            assert_bit_equal(ck.read(name), t, f"{where}: {name}")
    assert granularity_of(np.int64(8), (6, 4)) == (8, 1)


@pytest.mark.parametrize("call, message", [
    (lambda: ragckpt.plan([5, -3, 4], [1, 1, 1], 2), r"tensor element counts must be non-negative integers, got \(5, -3, 4\)"),
    (lambda: ragckpt.plan([5.5], [1], 2), "tensor element counts must be non-negative integers"),
    (lambda: ragckpt.plan(["5"], [1], 2), "tensor element counts must be non-negative integers"),
    (lambda: RaggedShard((0,), (1, 1)).local_shape((8, 4), -1), "rank -1 is outside world size 2"),
    (lambda: RaggedShard((0,), (1, 1)).local_shape((8, 4), 5), "rank 5 is outside world size 2"),
    (lambda: RaggedShard((0,), (1, 1)).ranges((2, -3)), r"a shape must be non-negative integers, got \(2, -3\)"),
    (lambda: RaggedShard((0,), (1, 1)).ranges((2.5, 2)), "a shape must be non-negative integers"),
    (lambda: RaggedShard.row_chunks((10.5, 4), 2), "a shape must be non-negative integers"),
    (lambda: RaggedShard.whole(4, owner=1.5), "owner rank 1.5 is outside world size 4"),
    (lambda: RaggedShard.whole(2.5, 1), "world size must be a positive integer, got 2.5"),
    (lambda: RaggedShard.flat_partition([(3,), (2, -2)], 2), "a shape must be non-negative integers"),
    (lambda: plan_layout(["w"], [(2, 3.5)], 2), "the shape of tensor #0 must be non-negative integers"),
    (lambda: FlatLayout(2, 4.5, ((9,),), (1,), (0,)), "shard size must be non-negative integers"),
    (lambda: FlatLayout(2, 8, ((2, -2),), (1,), (0,)), "the shape of tensor #0 must be non-negative integers"),
    (lambda: FlatLayout(2, 8, ((4,),), (1,), (0.5,)), "offsets must be non-negative integers"),
    (lambda: PerTensorLayout(2, ((4,),), (1,), [[1, 1, 2]]), "unit counts hold 3 entries, expected 1 tensors x 2 ranks"),
    (lambda: PerTensorLayout(2, ((4,),), (1,), [[1.5, 2.5]]), "unit counts must be integers, got an array of float64"),
    (lambda: PerTensorLayout.from_placements([(2,), (3,)], [RaggedShard((0,), (1, 1))]),
     "2 shapes but 1 placements; give one placement per tensor"),
])
def test_loosely_typed_or_out_of_range_arguments_are_one_layout_error(call, message):
    """Each of these returned a wrong answer (a negative count planned into overlapping offsets,
    rank -1 read as the last rank, 2.5 rows truncated to 2) or raised a raw IndexError, TypeError
    or ValueError from deep inside."""
    with pytest.raises(LayoutError, match=message):
        call()


def test_a_custom_source_needs_a_target_layout_even_at_its_own_world_size():
    """The refusal said the custom layout "cannot be rebuilt for another world size", also when the
    world size was not changing."""
    lay = CheckpointLayout(2, "custom", [row_layout([(4, 2)], 2)], [BufferSpec("float32", "float32", 0, ("w",))])
    for w in (2, 3):
        with pytest.raises(LayoutError, match=r"custom layout \(an engine's own\), which the resharder cannot plan "
                                              r"again; choose the target layout: kind='ragged', 'row' or 'element' "
                                              r"\(--layout on the command line\)"):
            target_layout(lay, w)
    assert target_layout(lay, 2, "row").layouts[0] == lay.layouts[0]


def test_target_layout_refuses_what_the_target_kind_would_ignore():
    """align for a row target and granularity for a non-ragged one were dropped without a word (an
    engine asking for 128-element alignment at restart got unaligned shards), where
    CheckpointLayout.build and the offline reshard refuse them; misplaced arguments are TypeErrors."""
    src = CheckpointLayout.build({"w": ((10, 3), "float32")}, 2, "row")
    with pytest.raises(LayoutError, match=r"align applies to flat layouts \(ragged, element\) only, and this "
                                          r"layout is 'row'; drop align"):
        target_layout(src, 3, "row", align=128)
    with pytest.raises(LayoutError, match=r"align applies to flat layouts .* this layout is 'row'"):
        target_layout(src, 3, align=8)  # the source's kind, row
    with pytest.raises(LayoutError, match=r"granularity applies to ragged layouts only, and this layout is "
                                          r"'element' .*drop granularity='whole'"):
        target_layout(src, 3, "element", granularity="whole")
    with pytest.raises(ragckpt.UnknownNameError, match=r"granularity names 1 tensor\(s\) not in the layout: 'v'"):
        target_layout(src, 3, "ragged", granularity={"v": "whole"})  # a typo would leave 'w' on the default
    for bad in (0, -2, 1.5, True):
        with pytest.raises(LayoutError, match="align must be a positive integer"):
            target_layout(src, 3, "element", align=bad)
    assert target_layout(src, 3, "element", align=8).rank_sizes(0).tolist() == [16, 16, 16]
    assert target_layout(src, 3, "ragged", granularity="whole", align=2).world_size == 3
    for bad_src in (None, "/ckpt/step_1", {"w": 1}):
        with pytest.raises(TypeError, match="src must be a CheckpointLayout \\(an open checkpoint's is ck.layout\\)"):
            target_layout(bad_src, 2)
    with pytest.raises(TypeError, match="target world size must be an integer"):
        target_layout(src, "4")


@pytest.mark.parametrize("dims", [(0.7,), (0, 1.9), ("0",), ("a",), None, 0])
def test_ragged_shard_dims_are_checked_not_coerced(dims):
    """int() took 0.7 for 0 and "0" for 0; None and 0 raised raw TypeErrors."""
    with pytest.raises(LayoutError, match="RaggedShard dims must be"):
        RaggedShard(dims, (1, 1))
    with pytest.raises(LayoutError, match="RaggedShard local_units must be a sequence"):
        RaggedShard((0,), None)


def test_from_placements_names_the_tensor_a_placement_does_not_fit():
    with pytest.raises(LayoutError, match=r"^tensor #1: tensor of shape \(10, 3\) has 30 elements, not divisible"):
        PerTensorLayout.from_placements([(4, 2), (10, 3)], [RaggedShard((0,), (1, 1)), RaggedShard((0, 1), (4, 4))])


@pytest.mark.parametrize("shape,W", [((3, 0), 4), ((4, 0, 2), 2), ((5, 0), 5)])
def test_local_shape_of_rows_with_no_elements_matches_torch_chunk(shape, W):
    chunks = [tuple(c.shape) for c in torch.chunk(torch.empty(shape), W)]
    units = [c[0] for c in chunks] + [0] * (W - len(chunks))
    p = RaggedShard((0,), tuple(units))
    got = [p.local_shape(shape, r) for r in range(W)]
    assert got[: len(chunks)] == chunks and all(s == (0, *shape[1:]) for s in got[len(chunks):])
