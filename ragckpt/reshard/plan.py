"""Resharding plans: the destination layout, and which source bytes fill each destination rank.

Everything here is metadata-only and vectorised. Two steps:

* `target_layout` lays the same buffers (same names, dtypes, tensor order per buffer, same sharing of
  layouts between buffers) out for a new world size and layout kind, so destination slot `i` of a
  buffer is source slot `i` and the optimizer state that shares its parameters' layout keeps doing so.
* `SourceIndex.join` intersects one destination rank's segments with the source segments in flat
  element space: an interval join (two `searchsorted` calls and a `repeat`), O(output runs), that
  yields coalesced `CopyPlan` runs already sorted by destination offset. Unlike
  `ragckpt.format.intervals.copy_plan`, which builds the whole W_src x W_dst plan at once, a process
  only ever builds the plans of the destination ranks it writes, one rank at a time; this is what
  keeps per-tensor layouts with millions of pieces (row shards of 1,000 tensors on 8,192 ranks)
  cheap in time and memory, and what `load` uses for the single rank of a restarting process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ragckpt.errors import LayoutError
from ragckpt.format.intervals import CopyPlan, coalesce
from ragckpt.format.layout import BufferLayout, Segments
from ragckpt.format.names import split_optim_state_name
from ragckpt.planner.planner import GranularitySpec
from ragckpt.planner.state import PLANNED_KINDS, BufferSpec, CheckpointLayout, check_plan_options, plan_buffer

_EMPTY = np.zeros(0, dtype=np.int64)


def empty_plan() -> CopyPlan:
    return CopyPlan(_EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)


# -- destination layout --------------------------------------------------------------------------------

def inferred_granularity(src: BufferLayout, names: Sequence[str]) -> dict[str, str]:
    """Per-tensor granularity policy recovered from a planned (ragged) source: whole-owned tensors
    (dims=()) stay whole (Muon/Shampoo ownership), element-granular ones stay element-granular,
    everything else is row-granular. `rows:K` blocks are not recorded in the format, so a source
    planned with them needs `granularity` passed again."""
    out = {}
    for name, shape, d in zip(names, src.shapes, src.dims, strict=True):
        if d == 0:
            out[name] = "whole"
        elif d == len(shape) and len(shape) > 1:
            out[name] = "element"
        else:
            out[name] = "row"
    return out


def follow_params(spec: GranularitySpec, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> GranularitySpec:
    """Make name-keyed granularity policies apply to optimizer state too: `optim.state.<p>.<key>`
    with the shape of parameter `p` is planned with `p`'s policy, so Adam moments are cut exactly
    where their parameter is (block-wise optimizers never see a split block)."""
    if isinstance(spec, str | int | np.integer):
        return spec
    shape_of = {n: tuple(s) for n, s in zip(names, shapes, strict=True)}
    params = {n for n in names if not n.startswith("optim.")}

    def policy(name: str, shape: tuple[int, ...]) -> str | int:
        target = name
        split = split_optim_state_name(name, params)
        if split is not None and shape_of.get(split[0]) == tuple(shape):
            target = split[0]
        if callable(spec):
            return spec(target, tuple(shape))
        assert isinstance(spec, Mapping)
        if name in spec:
            return spec[name]
        return spec.get(target, spec.get("*", "row"))

    return policy


def target_layout(
    src: CheckpointLayout,
    world_size: int,
    kind: str | None = None,
    granularity: GranularitySpec | None = None,
    align: int = 1,
) -> CheckpointLayout:
    """`src`'s buffers laid out for `world_size` ranks with layout `kind` (default: `src.kind`).

    Buffers keep their names, dtypes and tensor order, and buffers that share a layout in `src` share
    it in the result, so the copy plan between the two is slot-for-slot. `granularity` is used by
    kind 'ragged' only; by default it is inferred from a ragged source and 'row' otherwise."""
    if not isinstance(src, CheckpointLayout):
        raise TypeError(f"target_layout: src must be a CheckpointLayout (an open checkpoint's is ck.layout), got "
                        f"{type(src).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)):
        raise TypeError(f"target world size must be an integer, got {world_size!r}")
    if world_size <= 0:
        raise LayoutError(f"target world size must be positive, got {world_size}")
    kind = kind or src.kind
    if kind not in PLANNED_KINDS:
        if kind == "custom":
            raise LayoutError("the source checkpoint has a custom layout (an engine's own), which the resharder "
                              "cannot plan again; choose the target layout: kind='ragged', 'row' or 'element' "
                              "(--layout on the command line)")
        raise LayoutError(f"unknown target layout '{kind}'; use one of {', '.join(PLANNED_KINDS)}")
    # what the target kind would silently ignore is refused, as CheckpointLayout.build refuses it
    check_plan_options(kind, "row" if granularity is None else granularity, align,
                       {n: None for b in src.buffers for n in b.tensors})
    layouts: list[BufferLayout] = []
    for li, lay in enumerate(src.layouts):
        users = [b for b in src.buffers if b.layout == li]
        names = list(users[0].tensors) if users else [f"#{i}" for i in range(len(lay.shapes))]
        shapes = [tuple(s) for s in lay.shapes]
        spec: GranularitySpec = "row"
        if kind == "ragged" and granularity is not None:
            spec = follow_params(granularity, names, shapes)
        elif kind == "ragged" and src.kind == "ragged":
            spec = inferred_granularity(lay, names)
        layouts.append(plan_buffer(kind, names, shapes, world_size, spec, align))
    buffers = [BufferSpec(b.name, b.dtype, b.layout, tuple(b.tensors)) for b in src.buffers]
    return CheckpointLayout(world_size, kind, layouts, buffers)


# -- rank-restricted interval join ----------------------------------------------------------------------

@dataclass
class SourceIndex:
    """Source segments of one buffer layout sorted in a virtual space where the tensors lie end to end
    (tensor t starts at `bases[t]`), ready for interval joins."""

    layout: BufferLayout

    @cached_property
    def _index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n = self.layout.numels
        bases = np.cumsum(n) - n
        s: Segments = self.layout.segments()  # sorted by (slot, flat_start): virtual starts ascend
        starts = bases[s.slot] + s.flat_start
        return bases, starts, starts + s.length, s.rank, s.offset

    def join(self, dst: Segments, slot_map: np.ndarray | None = None) -> CopyPlan:
        """Copy runs that fill destination segments `dst` (typically one rank's, sorted by buffer
        offset) from this source. `slot_map[d]` is the source slot of destination slot `d` (identity
        when None). Runs come out coalesced and in the order of `dst`. Zero-length segments need
        nothing (they were once reported as not covered by the source)."""
        if len(dst) and not dst.length.all():
            dst = dst.select(dst.length > 0)
        if len(dst) == 0:
            return empty_plan()
        bases, sv, se, srank, soff = self._index
        src_slot = dst.slot if slot_map is None else slot_map[dst.slot]
        if np.any(src_slot < 0):
            raise LayoutError("a destination tensor has no source slot")
        dv = bases[src_slot] + dst.flat_start
        de = dv + dst.length
        i0 = np.searchsorted(sv, dv, side="right") - 1
        i1 = np.searchsorted(sv, de, side="left")
        count = i1 - i0
        if np.any(i0 < 0) or np.any(count <= 0):
            raise LayoutError("the source layout does not cover a destination segment; the checkpoint metadata is "
                              "inconsistent")
        total = int(count.sum())
        j = np.repeat(np.arange(len(dst), dtype=np.int64), count)
        k = np.repeat(i0, count) + (np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count))
        a = np.maximum(dv[j], sv[k])
        b = np.minimum(de[j], se[k])
        covered = np.add.reduceat(np.maximum(b - a, 0), np.cumsum(count) - count)  # int64: exact at any size
        if np.any(covered != dst.length):
            bad = int(np.nonzero(covered != dst.length)[0][0])
            raise LayoutError(f"source segments cover {int(covered[bad])} of {int(dst.length[bad])} elements of a "
                              f"destination piece of slot {int(dst.slot[bad])}; the source layout has holes")
        plan = CopyPlan(
            src_rank=srank[k],
            src_offset=soff[k] + (a - sv[k]),
            dst_rank=dst.rank[j],
            dst_offset=dst.offset[j] + (a - dv[j]),
            length=b - a,
        )
        return coalesce(plan)


def rank_plan(src: BufferLayout | SourceIndex, dst: BufferLayout, rank: int) -> CopyPlan:
    """Runs that fill destination rank `rank`'s buffer from `src` (same tensors, slot for slot)."""
    index = src if isinstance(src, SourceIndex) else SourceIndex(src)
    if index.layout.shapes != dst.shapes:
        raise LayoutError("source and destination layouts describe different tensor shapes")
    return index.join(dst.rank_segments(rank))

