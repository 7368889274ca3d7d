"""Whole-owned tensors (Muon's matrices) spread over the ranks across units: the planner alone gives
the same ranks the same matrices in every block; the engine's per-unit rotation evens the owners'
Newton-Schulz work out, without changing the shard size, the padding or any tensor's cuts."""

from __future__ import annotations

import pytest

import ragckpt
from ragfsdp.engine import owner_balance


def _block(d: int, h: int) -> tuple[list[str], list[tuple[int, ...]]]:
    shapes = {"q": (d, d), "k": (d // 4, d), "v": (d // 4, d), "o": (d, d), "gate": (h, d), "up": (h, d),
              "down": (d, h), "norm1": (d,), "norm2": (d,)}
    return list(shapes), list(shapes.values())


def _policy(name: str, shape: tuple[int, ...]) -> str:
    return "whole" if len(shape) == 2 else "row"


def _owner_work(layouts: list[ragckpt.FlatLayout], W: int) -> list[int]:
    work = [0] * W
    for lay in layouts:
        for t, shape in enumerate(lay.shapes):
            if len(shape) == 2:
                seg = lay.segments().for_slot(t)
                assert len(seg) == 1 and int(seg.length[0]) == shape[0] * shape[1]  # still whole on one rank
                work[int(seg.rank[0])] += shape[0] * shape[1] * min(shape)
    return work


@pytest.mark.parametrize("W", [3, 8, 16])
def test_rotation_spreads_the_owners_work_and_keeps_every_cut(W):
    names, shapes = _block(256, 688)
    planned = [ragckpt.plan_layout(names, shapes, W, _policy) for _ in range(8)]
    owner_balance.reset()
    balanced = [owner_balance.balance(lay) for lay in planned]
    owner_balance.reset()
    before, after = _owner_work(planned, W), _owner_work(balanced, W)
    mean = sum(before) / W
    assert max(before) / mean > 1.15  # the planner alone: the same ranks busiest in every block
    assert max(after) / mean < max(before) / mean and max(after) / mean < 1.1
    for p, b in zip(planned, balanced, strict=True):
        assert b.shard_size == p.shard_size and b.padding() == p.padding()
        for t in range(len(shapes)):  # the same elements in each tensor's runs, only on other ranks
            sp, sb = p.segments().for_slot(t), b.segments().for_slot(t)
            assert list(sp.length) == list(sb.length) and list(sp.offset) == list(sb.offset)


def test_layouts_without_whole_tensors_and_one_rank_are_left_alone():
    names, shapes = _block(64, 176)
    rows = ragckpt.plan_layout(names, shapes, 4, "row")
    assert owner_balance.balance(rows) is rows
    one = ragckpt.plan_layout(names, shapes, 1, _policy)
    assert owner_balance.balance(one) is one
    owner_balance.reset()


def test_a_tensor_across_the_wrap_point_rules_that_rotation_out():
    # a row-split tensor spanning ranks 2 and 3 of 4 cannot move by one shard (it would wrap to rank 0)
    lay = ragckpt.FlatLayout(4, 10, ((10, 1), (15, 1), (2, 4)), (0, 1, 0), (0, 25, 10))
    assert owner_balance._rotated(lay, 1) is None
    moved = owner_balance._rotated(lay, 2)
    assert moved is not None
    ragckpt.FlatLayout(4, 10, lay.shapes, lay.dims, moved)  # valid
