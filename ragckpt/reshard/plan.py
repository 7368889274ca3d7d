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

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ragckpt.errors import LayoutError
from ragckpt.format.intervals import CopyPlan, coalesce
from ragckpt.format.layout import BufferLayout, PerTensorLayout, Segments
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

#: source slots per stored row of rank-buffer offsets (dense per-tensor sources): a run's offset in its
#: source rank's buffer is that row's entry plus the pieces of at most this many - 1 slots before it
_OFFSET_ROWS = 8
#: a join's runs are worked out this many at a time (a dozen int64 temporaries of this length)
JOIN_BATCH_RUNS = 1 << 17


def _dense(lay: BufferLayout) -> bool:
    """A per-tensor layout whose (T, W) units table is mostly non-zero (row shards of tensors with
    at least as many rows as ranks): its segments are as many as the table has entries."""
    if not isinstance(lay, PerTensorLayout):
        return False
    units = lay.units
    return units.size > 0 and 2 * int(np.count_nonzero(units)) >= units.size


@dataclass
class SourceIndex:
    """Source segments of one buffer layout sorted in a virtual space where the tensors lie end to end
    (tensor t starts at `bases[t]`), ready for interval joins.

    A dense per-tensor source (row shards: 1,000 tensors on 8,192 ranks are 8 M segments) is not
    expanded into segment arrays (five int64 per segment in the layout, four more here: 520 MiB at
    that size, held for the whole reshard). Its index is one (T, W) table of virtual starts, the
    size of the layout's own units table, plus every `_OFFSET_ROWS`-th row of the rank-buffer
    offsets; a run's offset is worked out from those for the runs a join makes."""

    layout: BufferLayout
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _built: tuple | None = field(default=None, repr=False, compare=False)

    def _index(self) -> tuple:
        built = self._built
        if built is None:
            with self._lock:
                if self._built is None:
                    self._built = self._build()
                built = self._built
        return built

    def _build(self) -> tuple:
        n = self.layout.numels
        bases = np.cumsum(n) - n
        if _dense(self.layout):
            lay = self.layout
            units, usz = lay.units, lay._unit_sizes  # noqa: SLF001 - elements per unit, computed once per layout
            T, W = units.shape
            flat = np.empty(T * W + 1, dtype=np.int64)  # virtual start of (t, s) at t * W + s; then the end
            v = flat[:-1].reshape(T, W)
            np.cumsum(units, axis=1, out=v)
            v -= units
            v *= usz[:, None]
            v += bases[:, None]
            flat[-1] = int(n.sum())
            rows = np.arange(0, T, _OFFSET_ROWS)
            sums = np.zeros((len(rows), W), dtype=np.int64)  # elements of each group of slots, per rank
            for g, t0 in enumerate(rows.tolist()):
                t1 = min(T, t0 + _OFFSET_ROWS)
                np.sum(units[t0:t1] * usz[t0:t1, None], axis=0, out=sums[g])
            offsets = np.cumsum(sums, axis=0)
            offsets -= sums  # offset of slot g * _OFFSET_ROWS in every rank's buffer
            return ("dense", bases, flat, offsets, units, usz)
        s: Segments = self.layout.segments()  # sorted by (slot, flat_start): virtual starts ascend
        starts = bases[s.slot] + s.flat_start
        return ("segments", bases, starts, starts + s.length, s.rank, s.offset)

    def _locate(self, dst: Segments, slot_map: np.ndarray | None) -> tuple[np.ndarray, ...]:
        """(virtual start, virtual end, first source entry, count of source entries) per segment."""
        ix = self._index()
        bases, sv = ix[1], ix[2]
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
        return dv, de, i0, count

    def count(self, dst: Segments, slot_map: np.ndarray | None = None) -> np.ndarray:
        """Per destination segment, how many source pieces it overlaps: at least the runs its join
        makes (before coalescing), with no run made."""
        if len(dst) and not dst.length.all():
            dst = dst.select(dst.length > 0)
        if len(dst) == 0:
            return _EMPTY
        return self._locate(dst, slot_map)[3]

    def join(self, dst: Segments, slot_map: np.ndarray | None = None) -> CopyPlan:
        """Copy runs that fill destination segments `dst` (typically one rank's, sorted by buffer
        offset) from this source. `slot_map[d]` is the source slot of destination slot `d` (identity
        when None). Runs come out coalesced and in the order of `dst`. Zero-length segments need
        nothing (they were once reported as not covered by the source). Worked out
        `JOIN_BATCH_RUNS` runs at a time, so temporaries stay small whatever the plan's size."""
        if len(dst) and not dst.length.all():
            dst = dst.select(dst.length > 0)
        if len(dst) == 0:
            return empty_plan()
        dv, de, i0, count = self._locate(dst, slot_map)
        cum = np.cumsum(count)
        if int(cum[-1]) <= JOIN_BATCH_RUNS:
            return coalesce(self._join_part(dst, dv, de, i0, count))
        cuts = np.searchsorted(cum, np.arange(JOIN_BATCH_RUNS, int(cum[-1]), JOIN_BATCH_RUNS), side="left")
        bounds = np.unique(np.concatenate([[0], np.minimum(cuts + 1, len(dst)), [len(dst)]]))
        parts = [coalesce(self._join_part(dst.select(slice(a, b)), dv[a:b], de[a:b], i0[a:b], count[a:b]))
                 for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)]
        return coalesce(CopyPlan(*(np.concatenate([getattr(p, f) for p in parts])
                                   for f in ("src_rank", "src_offset", "dst_rank", "dst_offset", "length"))))

    def _join_part(self, dst: Segments, dv: np.ndarray, de: np.ndarray, i0: np.ndarray,
                   count: np.ndarray) -> CopyPlan:
        ix = self._index()
        total = int(count.sum())
        j = np.repeat(np.arange(len(dst), dtype=np.int64), count)
        k = np.repeat(i0, count) + (np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count))
        if ix[0] == "dense":
            _, _, flat, offsets, units, usz = ix
            sv_k, se_k = flat[k], flat[np.minimum(k + 1, len(flat) - 1)]  # k may be the end entry (a hole)
        else:
            _, _, sv, se, srank, soff = ix
            sv_k, se_k = sv[k], se[k]
        a = np.maximum(dv[j], sv_k)
        b = np.minimum(de[j], se_k)
        covered = np.add.reduceat(np.maximum(b - a, 0), np.cumsum(count) - count)  # int64: exact at any size
        if np.any(covered != dst.length):
            bad = int(np.nonzero(covered != dst.length)[0][0])
            raise LayoutError(f"source segments cover {int(covered[bad])} of {int(dst.length[bad])} elements of a "
                              f"destination piece of slot {int(dst.slot[bad])}; the source layout has holes")
        if ix[0] == "dense":
            keep = b > a  # the table has an entry for every (tensor, rank), empty pieces too
            if not keep.all():
                j, k, a, b, sv_k = j[keep], k[keep], a[keep], b[keep], sv_k[keep]
            W = units.shape[1]
            t, rank = np.divmod(k, W)
            off = _buffer_offsets(offsets, units, usz, t, rank)
        else:
            rank, off = srank[k], soff[k]
        return CopyPlan(
            src_rank=rank,
            src_offset=off + (a - sv_k),
            dst_rank=dst.rank[j],
            dst_offset=dst.offset[j] + (a - dv[j]),
            length=b - a,
        )


def _buffer_offsets(rows: np.ndarray, units: np.ndarray, usz: np.ndarray, t: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Offset of tensor `t`'s piece in rank `rank`'s buffer: the stored row of its group of slots
    plus the pieces of the slots between that row and `t`."""
    g = t // _OFFSET_ROWS
    out = rows[g, rank]
    first = g * _OFFSET_ROWS
    for d in range(_OFFSET_ROWS - 1):
        row = first + d
        m = row < t
        if not m.any():
            break
        r, c = row[m], rank[m]
        out[m] += units[r, c] * usz[r]
    return out


class DestSegments:
    """Segments of blocks of consecutive destination ranks, sorted by (rank, offset), as the
    layout's `rank_segments` gives them one rank at a time. A per-tensor layout's are worked out from
    its units table for the block alone (`rank_segments` first sorts every segment of the layout
    by rank: 2 M segments, 200 MiB held, for 500 row-sharded tensors on 4,096 ranks); others are
    the layout's own."""

    def __init__(self, layout: BufferLayout, block: int = 64):
        self.layout = layout
        self.block = max(1, int(block))
        self._starts: np.ndarray | None = None
        self._lock = threading.Lock()

    def _flat_starts(self, r0: int) -> np.ndarray:
        """(T,) elements of every tensor held by ranks before `r0`."""
        lay = self.layout
        with self._lock:
            if self._starts is None:
                units, usz = lay.units, lay._unit_sizes  # noqa: SLF001
                cols = np.arange(0, units.shape[1], self.block)
                sums = np.add.reduceat(units, cols, axis=1) if units.size else np.zeros((len(usz), 0), np.int64)
                starts = np.zeros((units.shape[0], len(cols) + 1), dtype=np.int64)
                np.cumsum(sums, axis=1, out=starts[:, 1:])
                self._starts = starts  # units before every block-th rank
        q, rest = divmod(r0, self.block)
        out = self._starts[:, q].copy()
        if rest:
            out += lay.units[:, q * self.block : r0].sum(axis=1)
        return out * lay._unit_sizes  # noqa: SLF001

    def ranks(self, r0: int, r1: int) -> Segments:
        lay = self.layout
        if not isinstance(lay, PerTensorLayout):
            parts = [lay.rank_segments(r) for r in range(r0, r1)]
            return Segments(*(np.concatenate([getattr(p, f) for p in parts])
                              for f in ("slot", "flat_start", "length", "rank", "offset")))
        usz = lay._unit_sizes  # noqa: SLF001
        T = len(usz)
        elems = lay.units[:, r0:r1] * usz[:, None]  # (T, ranks)
        flat = np.cumsum(elems, axis=1)
        flat -= elems
        flat += self._flat_starts(r0)[:, None]
        off = np.cumsum(elems, axis=0)
        off -= elems  # a rank's buffer holds its pieces in slot order
        e = elems.T.ravel()
        nz = np.flatnonzero(e)
        rank, slot = np.divmod(nz, T)
        return Segments(slot=slot, flat_start=flat.T.ravel()[nz], length=e[nz], rank=rank + r0,
                        offset=off.T.ravel()[nz])


def rank_plan(src: BufferLayout | SourceIndex, dst: BufferLayout, rank: int) -> CopyPlan:
    """Runs that fill destination rank `rank`'s buffer from `src` (same tensors, slot for slot)."""
    index = src if isinstance(src, SourceIndex) else SourceIndex(src)
    if index.layout.shapes != dst.shapes:
        raise LayoutError("source and destination layouts describe different tensor shapes")
    return index.join(dst.rank_segments(rank))

