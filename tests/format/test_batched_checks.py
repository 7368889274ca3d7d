"""The batched validators `ragckpt.open` uses for every tensor of a manifest (`shapes_of`,
`counts`, `all_counts`, `all_text`, `PerTensorLayout`'s dims check) against their one-at-a-time
definitions (`shape_of`, `is_count`, `is_text`, a loop): the same verdict and the same error for
any input, including the values a C-level pass could wave through (bools, numpy integers, floats,
negative or huge sizes, lone surrogates split across names)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragckpt import LayoutError, PerTensorLayout
from ragckpt.checkpoint.manifest import is_count
from ragckpt.format.names import all_text, is_text
from ragckpt.format.placement import MAX_NUMEL, all_counts, counts, shape_of, shapes_of

# sizes and look-alikes: plain ints near every limit, and values that are no plain int
SIZES = st.one_of(
    st.integers(0, 8),
    st.sampled_from([-1, MAX_NUMEL - 1, MAX_NUMEL, 2**31, 2**63, 10**30]),
    st.sampled_from([True, False, 2.0, "3", None]),
    st.integers(0, 8).map(np.int64),
)
SHAPE = st.one_of(st.lists(SIZES, max_size=4), st.lists(SIZES, max_size=4).map(tuple), st.just("37"))


def outcome(fn, *args):
    """(result, None) or (None, LayoutError message): what a caller can observe."""
    try:
        return fn(*args), None
    except LayoutError as e:
        return None, str(e)


@settings(max_examples=400, deadline=None)
@given(st.lists(SHAPE, max_size=6), st.booleans())
def test_shapes_of_agrees_with_shape_of_for_every_shape(shapes, as_tuple):
    shapes = tuple(shapes) if as_tuple else shapes

    def one_at_a_time(ss):
        return tuple(shape_of(s, f"the shape of tensor #{t}") for t, s in enumerate(ss))

    got, want = outcome(shapes_of, shapes), outcome(one_at_a_time, shapes)
    assert got == want
    if got[0] is not None:  # plain ints, never numpy integers that would reach the JSON metadata
        assert all(type(x) is int for s in got[0] for x in s)


def test_shapes_of_names_the_tensor_whose_shape_is_wrong():
    with pytest.raises(LayoutError, match=r"the shape of tensor #2 \(2, 4611686018427387904\) is more than"):
        shapes_of([(3, 4), [5], (2, 2**62)])
    with pytest.raises(LayoutError, match=r"the shape of tensor #1 \(0, 4611686018427387904\) is more than"):
        shapes_of([(3,), (0, 2**62)])  # no elements, but a dimension past what offsets can address
    with pytest.raises(LayoutError, match=r"the shape of tensor #1 must be non-negative integers, got \(True,\)"):
        shapes_of([(3,), (True,)])


class _Seq(list):
    """A list of another type: `counts` takes it the long way, one value at a time."""


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.lists(SIZES, max_size=6), st.lists(SIZES, max_size=6).map(tuple)))
def test_counts_agrees_with_its_loop(values):
    got, want = outcome(counts, values, "dims entries"), outcome(counts, _Seq(values), "dims entries")
    assert got == want
    if got[0] is not None:
        assert all(type(x) is int for x in got[0])


@settings(max_examples=300, deadline=None)
@given(st.lists(SIZES, max_size=6), st.integers(-1, 3), st.sampled_from([3, 2**63 - 1]))
def test_all_counts_agrees_with_is_count(values, lo, hi):
    assert all_counts(values, lo, hi) == all(is_count(v, lo, hi) for v in values)


NAMES = st.lists(st.one_of(st.text(max_size=4), st.sampled_from(["\ud83d", "\ude00", "a\ud800b", "\U0001f600"])),
                 max_size=5)


@settings(max_examples=300, deadline=None)
@given(NAMES)
def test_all_text_agrees_with_is_text(names):
    assert all_text(names) == all(map(is_text, names))


def test_all_text_refuses_a_surrogate_pair_split_across_two_names():
    """Joined, the two halves sit side by side; they must not pass for the one character they pair to."""
    assert not all_text(["x\ud83d", "\ude00y"])


def test_per_tensor_layout_names_the_dims_entry_beyond_its_tensor():
    """Tensor #0 flattens all its dimensions (dims == ndim, valid); tensor #1 asks for one more than it has."""
    units = np.array([[2, 1], [1, 1], [3, 0]])
    with pytest.raises(LayoutError, match=r"dims=2 is invalid for a tensor of shape \(2,\)"):
        PerTensorLayout(2, ((3,), (2,), (3,)), (1, 2, 1), units)
