"""Interval algebra in flat element space, vectorised with numpy.

* `copy_plan(src, dst)` intersects two layouts of the same tensors into coalesced runs
  `(src_rank, src_offset, dst_rank, dst_offset, length)`; redistribution between any two layouts
  (any world sizes, any dims) is exactly those runs.
* `flat_range_to_boxes(shape, start, stop)` expresses a flat range as at most `2d-1` N-D boxes, which
  is how a ragged shard is described to box-based systems such as PyTorch DCP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ragckpt.errors import LayoutError
from ragckpt.format.layout import BufferLayout, Segments
from ragckpt.format.placement import counts, numel_of


@dataclass(frozen=True)
class CopyPlan:
    """Coalesced copy runs, sorted by (dst_rank, dst_offset)."""

    src_rank: np.ndarray
    src_offset: np.ndarray
    dst_rank: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.length)

    def select(self, idx) -> CopyPlan:
        return CopyPlan(*(a[idx] for a in (self.src_rank, self.src_offset, self.dst_rank, self.dst_offset, self.length)))

    @property
    def total(self) -> int:
        return int(self.length.sum())


def _virtual_starts(seg: Segments, bases: np.ndarray) -> np.ndarray:
    return bases[seg.slot] + seg.flat_start


def copy_plan(src: BufferLayout, dst: BufferLayout) -> CopyPlan:
    """Runs that move every tensor element from its place in `src` to its place in `dst`."""
    if src.shapes != dst.shapes:
        raise LayoutError("source and destination layouts describe different tensor shapes")
    numels = src.numels
    bases = np.cumsum(numels) - numels  # tensors laid end to end in a virtual space
    total = int(numels.sum())
    s, d = src.segments(), dst.segments()
    sv, dv = _virtual_starts(s, bases), _virtual_starts(d, bases)
    cuts = np.sort(np.concatenate([sv, dv]))  # np.union1d, without its hash-based unique (70x slower here)
    cuts = cuts[np.concatenate([[True], cuts[1:] != cuts[:-1]])] if len(cuts) else cuts
    if len(cuts) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return CopyPlan(empty, empty, empty, empty, empty)
    lengths = np.diff(np.append(cuts, total))
    si = np.searchsorted(sv, cuts, side="right") - 1
    di = np.searchsorted(dv, cuts, side="right") - 1
    plan = CopyPlan(
        src_rank=s.rank[si],
        src_offset=s.offset[si] + (cuts - sv[si]),
        dst_rank=d.rank[di],
        dst_offset=d.offset[di] + (cuts - dv[di]),
        length=lengths,
    )
    order = np.lexsort((plan.dst_offset, plan.dst_rank))
    return coalesce(plan.select(order))


def coalesce(plan: CopyPlan) -> CopyPlan:
    """Merge neighbouring runs that continue each other on both sides (plan sorted by destination)."""
    if len(plan) <= 1:
        return plan
    cont = (
        (plan.src_rank[1:] == plan.src_rank[:-1])
        & (plan.dst_rank[1:] == plan.dst_rank[:-1])
        & (plan.src_offset[1:] == plan.src_offset[:-1] + plan.length[:-1])
        & (plan.dst_offset[1:] == plan.dst_offset[:-1] + plan.length[:-1])
    )
    head = np.concatenate([[True], ~cont])
    keep = np.nonzero(head)[0]
    lengths = np.add.reduceat(plan.length, keep)  # exact: a float64 bincount rounds sums above 2**53
    return CopyPlan(plan.src_rank[keep], plan.src_offset[keep], plan.dst_rank[keep], plan.dst_offset[keep], lengths)


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, lengths)


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """N-D boxes (offsets, sizes) whose union is exactly flat elements [start, stop) of `shape`, in
    row-major order; at most 2*ndim - 1 boxes."""
    shape = counts(shape, "a shape")
    start, stop = counts((start, stop), "flat range bounds")
    numel = numel_of(shape)
    if not start <= stop <= numel:
        raise LayoutError(f"flat range [{start}, {stop}) is not within the {numel} elements of shape {shape}")
    if stop == start:
        return []
    if not shape:
        return [((), ())]
    return _boxes(shape, start, stop)


def _boxes(shape: tuple[int, ...], a: int, b: int) -> list[Box]:
    if len(shape) == 1:
        return [((a,), (b - a,))]
    inner = 1
    for s in shape[1:]:
        inner *= s
    r0, r1 = a // inner, b // inner  # first row touched, row where b falls
    if a % inner == 0 and b % inner == 0:
        return [((r0, *([0] * (len(shape) - 1))), (r1 - r0, *shape[1:]))]
    out: list[Box] = []
    if r0 == r1 or (r0 + 1 == r1 and b % inner == 0 and a % inner):
        # the range lies inside one row
        row = a // inner
        end_in_row = b - row * inner
        for off, size in _boxes(shape[1:], a - row * inner, end_in_row):
            out.append(((row, *off), (1, *size)))
        return out
    head_end = r0 + 1 if a % inner else r0
    if a % inner:
        for off, size in _boxes(shape[1:], a - r0 * inner, inner):
            out.append(((r0, *off), (1, *size)))
    if r1 > head_end:
        out.append(((head_end, *([0] * (len(shape) - 1))), (r1 - head_end, *shape[1:])))
    if b % inner:
        for off, size in _boxes(shape[1:], 0, b - r1 * inner):
            out.append(((r1, *off), (1, *size)))
    return out
