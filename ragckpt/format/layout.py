"""Buffer layouts: which piece of which tensor sits at which offset of each rank's flat buffer.

Two families cover every sharding scheme in use:

* `FlatLayout` - one *global-contiguous* buffer of `W * S` elements; tensor t occupies
  `[offset_t, offset_t + numel_t)` and rank k owns `[k*S, (k+1)*S)`. The structure-aware planner,
  FSDP1/ZeRO flat partitions (dense offsets, granularity 1) and whole-tensor ownership (Muon) all
  produce this. Its metadata is O(tensors): offsets and S.
* `PerTensorLayout` - every tensor has its own RaggedShard placement and each rank's buffer is the
  concatenation of its local pieces in tensor order (FSDP2 `Shard(0)` style). Its metadata is a
  (tensors x ranks) unit table, kept in a binary array rather than JSON.

Both reduce to the same *segment table*: sorted runs `(slot, flat_start, length, rank, offset)` that
tile every tensor exactly once. All interval algebra (copy plans, reads, resharding) works on that
table, so adding a layout family means writing one `segments()` method.
"""

from __future__ import annotations

import math
import operator
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ragckpt.errors import LayoutError
from ragckpt.format.placement import (
    MAX_NUMEL,
    RaggedShard,
    chunk_sizes,
    counts,
    flat_partition_extent,
    numel_of,
    shapes_of,
    world_size_of,
)


@dataclass(frozen=True)
class Segments:
    """Runs that tile every tensor of a layout: tensor `slot[i]` elements
    `[flat_start[i], flat_start[i] + length[i])` live in rank `rank[i]`'s buffer at `offset[i]`.
    Sorted by (slot, flat_start); zero-length runs are omitted."""

    slot: np.ndarray
    flat_start: np.ndarray
    length: np.ndarray
    rank: np.ndarray
    offset: np.ndarray

    def __len__(self) -> int:
        return len(self.slot)

    def select(self, mask_or_index: np.ndarray) -> Segments:
        return Segments(*(a[mask_or_index] for a in (self.slot, self.flat_start, self.length, self.rank, self.offset)))

    def for_slot(self, slot: int) -> Segments:
        lo, hi = np.searchsorted(self.slot, [slot, slot + 1])
        return self.select(slice(lo, hi))


class BufferLayout(ABC):
    """Common interface of the layout families (see module docstring)."""

    kind: str
    world_size: int
    shapes: tuple[tuple[int, ...], ...]
    dims: tuple[int, ...]  # per slot: number of leading dims flattened into the sharded axis

    @cached_property
    def numels(self) -> np.ndarray:
        """(slots,) element count of every tensor; computed once per layout: recomputing it for every
        tensor on each read costs 16 ms per read at 10,000 tensors."""
        out = np.fromiter(map(math.prod, self.shapes), dtype=np.int64, count=len(self.shapes))
        out.setflags(write=False)
        return out

    def rank_sizes(self) -> np.ndarray:
        """(W,) elements in each rank's buffer (padding included); computed once per layout."""
        return self._rank_sizes

    @cached_property
    def _rank_sizes(self) -> np.ndarray:
        out = self._compute_rank_sizes()
        out.setflags(write=False)
        return out

    @abstractmethod
    def _compute_rank_sizes(self) -> np.ndarray: ...

    def segments(self) -> Segments:
        """Every stored run of every tensor: (slot, rank, offset in the rank's buffer, flat start
        in the tensor, length), sorted by slot then flat start."""
        return self._segments

    @cached_property
    def _segments(self) -> Segments:
        return self._compute_segments()

    @abstractmethod
    def _compute_segments(self) -> Segments: ...

    @cached_property
    def _by_rank(self) -> tuple[Segments, np.ndarray]:
        seg = self._segments
        # a stable sort by rank alone keeps slot order, which is buffer order in every layout the
        # planner and the per-tensor family produce; fall back to a full sort for arbitrary offsets
        order = np.argsort(seg.rank, kind="stable")
        s = seg.select(order)
        same = s.rank[1:] == s.rank[:-1]
        if np.any(same & (s.offset[1:] < s.offset[:-1])):
            s = seg.select(np.lexsort((seg.offset, seg.rank)))
        return s, np.searchsorted(s.rank, np.arange(self.world_size + 1))

    def rank_segments(self, rank: int) -> Segments:
        """Runs stored in `rank`'s buffer, sorted by buffer offset (index built once per layout)."""
        s, starts = self._by_rank
        return s.select(slice(int(starts[rank]), int(starts[rank + 1])))

    @abstractmethod
    def placement(self, slot: int) -> RaggedShard:
        """The tensor in `slot` as RaggedShard(dims, local_units): which rank holds which part."""

    @abstractmethod
    def to_meta(self) -> tuple[dict, dict[str, np.ndarray]]:
        """JSON-able description plus named binary tables (stored as zarr arrays)."""

    def padding(self) -> int:
        """Buffer elements that hold no tensor data."""
        return self.total_elements() - int(self.numels.sum())

    def total_elements(self) -> int:
        """Elements of all ranks' buffers together, padding included."""
        return int(self.rank_sizes().sum())

    @property
    def pending(self) -> bool:
        """Whether a table of this layout is yet to be read (see `DeferredUnits`): then anything per
        rank (`rank_sizes`, `segments`, `placement`) reads it first."""
        return False

    def local_units(self, slot: int) -> np.ndarray:
        """(W,) units of the tensor in `slot` that each rank holds."""
        return np.asarray(self.placement(slot).local_units, dtype=np.int64)

    def _check_slot_args(self) -> None:
        """Normalise the fields every layout has (plain ints: numpy integers would reach the JSON
        metadata) and refuse what would wrap int64 further on: a negative or fractional size, or
        tensors totalling `MAX_NUMEL` elements or more."""
        object.__setattr__(self, "world_size", world_size_of(self.world_size))
        object.__setattr__(self, "shapes", shapes_of(self.shapes))
        object.__setattr__(self, "dims", counts(self.dims, "dims entries"))
        if len(self.dims) != len(self.shapes):
            raise LayoutError(f"{len(self.shapes)} tensors but {len(self.dims)} dims entries")
        if not all(map(operator.le, self.dims, map(len, self.shapes))):  # dims are >= 0 (counts)
            d, shape = next((d, s) for d, s in zip(self.dims, self.shapes, strict=True) if d > len(s))
            raise LayoutError(f"dims={d} is invalid for a tensor of shape {shape}")
        total = sum(map(math.prod, self.shapes))
        if total >= MAX_NUMEL:
            raise LayoutError(f"the layout's tensors total {total:,} elements, more than a buffer can address "
                              "(under 2**62)")


def _unit_elems(shape: Sequence[int], ndims: int) -> int:
    """Elements per RaggedShard unit: a row of the dims view, or the whole tensor for dims=()."""
    return math.prod(shape[ndims:]) if ndims else max(1, math.prod(shape))  # shapes of a layout are int tuples


@dataclass(frozen=True)
class FlatLayout(BufferLayout):
    """Global-contiguous layout: tensor t at `offsets[t]` of a virtual `W * shard_size` buffer."""

    world_size: int
    shard_size: int
    shapes: tuple[tuple[int, ...], ...]
    dims: tuple[int, ...]
    offsets: tuple[int, ...]
    kind: str = "flat"

    def __post_init__(self) -> None:
        self._check_slot_args()
        object.__setattr__(self, "shard_size", counts((self.shard_size,), "shard size")[0])
        object.__setattr__(self, "offsets", counts(self.offsets, "offsets"))
        if len(self.offsets) != len(self.shapes):
            raise LayoutError(f"{len(self.shapes)} tensors but {len(self.offsets)} offsets")
        if self.world_size * self.shard_size >= MAX_NUMEL:
            raise LayoutError(f"{self.world_size} ranks x {self.shard_size:,} elements is more than a buffer can "
                              "address (under 2**62); re-plan the layout")
        n = self.numels
        off = np.asarray(self.offsets, dtype=np.int64)
        if len(off) and (off.min() < 0 or (off + n).max() > self.world_size * self.shard_size):
            raise LayoutError(
                f"tensors do not fit in {self.world_size} x {self.shard_size} elements; re-plan the layout"
            )
        live = n > 0
        order = np.argsort(off[live], kind="stable")
        starts, ends = off[live][order], (off + n)[live][order]
        if len(starts) > 1 and np.any(starts[1:] < ends[:-1]):
            raise LayoutError("tensors overlap in the flat layout; offsets must be disjoint")
        # every boundary strictly inside a tensor must cut at a whole unit of its dims view
        S = self.shard_size
        for t in np.nonzero(live)[0]:
            o, e = int(off[t]), int(n[t])
            first = o // S + 1
            last = (o + e - 1) // S
            if last >= first:
                u = _unit_elems(self.shapes[t], self.dims[t])
                if self.dims[t] == 0:
                    raise LayoutError(
                        f"tensor #{t} (shape {self.shapes[t]}) is whole-owned but crosses a rank boundary"
                    )
                if (first * S - o) % u or (last > first and S % u):
                    raise LayoutError(
                        f"tensor #{t} (shape {self.shapes[t]}): a rank boundary cuts a unit of {u} elements"
                    )

    def _compute_rank_sizes(self) -> np.ndarray:
        return np.full(self.world_size, self.shard_size, dtype=np.int64)

    def total_elements(self) -> int:
        return self.world_size * self.shard_size

    def _compute_segments(self) -> Segments:
        n = self.numels
        off = np.asarray(self.offsets, dtype=np.int64)
        S = max(self.shard_size, 1)
        live = np.nonzero(n > 0)[0]
        first = off[live] // S
        last = (off[live] + n[live] - 1) // S
        count = last - first + 1
        slot = np.repeat(live, count)
        # rank of each run: first[t] + 0, 1, ..., count[t]-1
        base = np.repeat(np.cumsum(count) - count, count)
        rank = np.repeat(first, count) + (np.arange(int(count.sum()), dtype=np.int64) - base)
        t_off = off[slot]
        t_end = t_off + n[slot]
        g_start = np.maximum(t_off, rank * S)
        g_end = np.minimum(t_end, (rank + 1) * S)
        return Segments(
            slot=slot.astype(np.int64),
            flat_start=g_start - t_off,
            length=g_end - g_start,
            rank=rank,
            offset=g_start - rank * S,
        )

    def placement(self, slot: int) -> RaggedShard:
        n = int(self.numels[slot])
        d = self.dims[slot]
        seg = self.segments().for_slot(slot)
        units = np.zeros(self.world_size, dtype=np.int64)
        if n:
            units[seg.rank] = seg.length // _unit_elems(self.shapes[slot], d)
        return RaggedShard(tuple(range(d)), tuple(int(u) for u in units))

    def to_meta(self) -> tuple[dict, dict[str, np.ndarray]]:
        return {"family": "flat", "shard_size": self.shard_size}, {}


@dataclass(frozen=True)
class DeferredUnits:
    """A units table read only when something needs it: a checkpoint's (T, W) table can be
    gigabytes once decoded (1,000 tensors at 1,048,576 ranks: 8 GiB), while what `ragckpt info`
    prints follows from the shapes alone. `load` returns the table; a table that breaks the layout's
    rules is refused with `refuse(error)` (the reader names the object it came from)."""

    load: Callable[[], np.ndarray]
    refuse: Callable[[LayoutError], Exception]


_DEFERRED_LOCK = threading.RLock()


@dataclass(frozen=True, eq=False)
class PerTensorLayout(BufferLayout):
    """Per-tensor placements; rank r's buffer concatenates its piece of every tensor in slot order.
    `units[t, r]` counts units of `_unit_elems(shape_t, dims_t)` elements. Given a `DeferredUnits`,
    the table is read and checked on first use of `units`."""

    world_size: int
    shapes: tuple[tuple[int, ...], ...]
    dims: tuple[int, ...]
    units: np.ndarray
    kind: str = "per_tensor"

    def __post_init__(self) -> None:
        self._check_slot_args()
        if isinstance(self.units, DeferredUnits):
            object.__setattr__(self, "_deferred", self.units)
            object.__delattr__(self, "units")  # `__getattr__` reads it on first use
            return
        self._set_units(self.units)

    def __getattr__(self, name: str) -> object:
        """Only reached for attributes that are not set: `units` of a deferred table, read now."""
        deferred = self.__dict__.get("_deferred")
        if name != "units" or deferred is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        with _DEFERRED_LOCK:  # reader threads may all want it at once: read it once
            if "units" not in self.__dict__:
                table = deferred.load()
                try:
                    self._set_units(table)
                except LayoutError as e:
                    raise deferred.refuse(e) from None
        return self.__dict__["units"]

    @property
    def pending(self) -> bool:
        return "units" not in self.__dict__

    def __getstate__(self) -> dict:
        """The table itself, read if it was deferred: the loader cannot travel to another process."""
        self.units  # noqa: B018 - reads a deferred table
        return {k: v for k, v in self.__dict__.items() if k != "_deferred"}

    def padding(self) -> int:
        return 0  # a rank's buffer is its pieces and nothing else (no need to read the table for that)

    def total_elements(self) -> int:
        return int(self.numels.sum())

    def _set_units(self, units: object) -> None:
        """Check the (T, W) table against the shapes and keep it as this layout's `units`."""
        units = np.asarray(units)
        if units.dtype.kind not in "iu" and not (units.size == 0 and units.dtype.kind == "f"):
            raise LayoutError(f"unit counts must be integers, got an array of {units.dtype}")
        want = (len(self.shapes), self.world_size)
        if units.size != want[0] * want[1]:
            raise LayoutError(f"unit counts hold {units.size} entries, expected {want[0]} tensors x {want[1]} ranks")
        units = units.astype(np.int64, copy=False).reshape(want)
        if units.size and units.min() < 0:
            raise LayoutError("unit counts must be non-negative")
        if units.size and units.max() >= MAX_NUMEL:
            raise LayoutError(f"a unit count of {int(units.max()):,} is more than a buffer can address (under 2**62)")
        got = units.sum(axis=1) * self._unit_sizes
        bad = np.nonzero(got != self.numels)[0]
        if len(bad):
            t = int(bad[0])
            raise LayoutError(
                f"tensor #{t} (shape {self.shapes[t]}): units cover {int(got[t])} elements, expected {int(self.numels[t])}"
            )
        whole = np.asarray([d == 0 for d in self.dims], dtype=bool)
        if whole.any() and ((units[whole] > 0).sum(axis=1) > 1).any():
            raise LayoutError("a whole-owned tensor (dims=()) has more than one owning rank")
        object.__setattr__(self, "units", units)

    # the generated comparison would compare the units arrays element-wise and fail ("truth value of
    # an array is ambiguous"), and could not hash them
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PerTensorLayout):
            return NotImplemented
        return ((self.world_size, self.shapes, self.dims) == (other.world_size, other.shapes, other.dims)
                and np.array_equal(self.units, other.units))

    def __hash__(self) -> int:
        return hash((self.world_size, self.shapes, self.dims, self.units.tobytes()))

    @cached_property
    def _unit_sizes(self) -> np.ndarray:
        """(T,) elements per unit of each tensor; 0 for a tensor with no elements, whose units (rows
        of a (3, 0) tensor, say) hold nothing. Memory here matters: the (T, W) units table is the one
        large array of this layout (312 MiB at 5,000 tensors x 8,192 ranks), so nothing else of its
        size is kept, and only the dense case builds (T, W) temporaries."""
        out = np.fromiter(map(_unit_elems, self.shapes, self.dims), dtype=np.int64, count=len(self.shapes))
        out[self.numels == 0] = 0
        out.setflags(write=False)
        return out

    def _compute_rank_sizes(self) -> np.ndarray:
        return self._unit_sizes @ self.units  # (W,): no (T, W) product is materialised

    def _compute_segments(self) -> Segments:
        units, usz = self.units, self._unit_sizes
        T, W = units.shape
        idx = np.flatnonzero(units)
        if len(idx) and not usz.all():  # units of empty tensors hold nothing
            idx = idx[usz[idx // W] > 0]
        if 2 * len(idx) >= units.size:  # mostly dense: running sums along both axes of the table
            elems = units * usz[:, None]
            flat_start = np.cumsum(elems, axis=1)
            flat_start -= elems  # prefix over ranks within a tensor
            buf_off = np.cumsum(elems, axis=0)
            buf_off -= elems  # prefix over tensors within a rank
            flat = elems.ravel()
            if len(idx) == flat.size:  # every rank holds a piece of every tensor: no gather needed
                return Segments(slot=np.repeat(np.arange(T, dtype=np.int64), W), flat_start=flat_start.ravel(),
                                length=flat, rank=np.tile(np.arange(W, dtype=np.int64), T), offset=buf_off.ravel())
            return Segments(slot=idx // W, flat_start=flat_start.ravel()[idx], length=flat[idx],
                            rank=idx % W, offset=buf_off.ravel()[idx])
        # sparse (rows fewer than ranks): the same sums over the non-empty pieces only
        slot, rank = idx // W, idx % W
        length = units.ravel()[idx] * usz[slot]
        flat_start = _exclusive_group_sums(length, slot)  # pieces are in (slot, rank) order
        order = np.argsort(rank, kind="stable")  # (rank, slot) order
        offset = np.empty_like(length)
        offset[order] = _exclusive_group_sums(length[order], rank[order])
        return Segments(slot=slot, flat_start=flat_start, length=length, rank=rank, offset=offset)

    def placement(self, slot: int) -> RaggedShard:
        return RaggedShard(tuple(range(self.dims[slot])), tuple(int(u) for u in self.units[slot]))

    def to_meta(self) -> tuple[dict, dict[str, np.ndarray]]:
        return {"family": "per_tensor"}, {"units": self.units}

    @classmethod
    def from_placements(cls, shapes: Sequence[Sequence[int]], placements: Sequence[RaggedShard]) -> PerTensorLayout:
        """Canonicalise arbitrary-scale RaggedShards to units of one dims-view row."""
        if not placements:
            raise LayoutError("at least one placement is needed to know the world size")
        if len(placements) != len(shapes):
            raise LayoutError(f"{len(shapes)} shapes but {len(placements)} placements; give one placement per tensor")
        shapes = shapes_of(shapes)
        W = placements[0].world_size
        rows = np.zeros((len(shapes), W), dtype=np.int64)
        for t, (shape, p) in enumerate(zip(shapes, placements, strict=True)):
            if p.world_size != W:
                raise LayoutError(f"tensor #{t}: placement has {p.world_size} ranks, others have {W}")
            if numel_of(shape) == 0:  # no rows to count (a unit of a (3, 0) tensor holds no element)
                continue
            try:
                rng = p.ranges(shape)
            except LayoutError as e:
                raise LayoutError(f"tensor #{t}: {e}") from None
            rows[t] = (rng[:, 1] - rng[:, 0]) // _unit_elems(shape, len(p.dims))
        return cls(W, shapes, tuple(len(p.dims) for p in placements), rows)


def row_layout(shapes: Sequence[Sequence[int]], world_size: int) -> PerTensorLayout:
    """FSDP2 `Shard(0)`: torch.chunk row splits for every tensor; 0-d tensors live on rank 0."""
    world_size = world_size_of(world_size)
    units = np.zeros((len(shapes), world_size), dtype=np.int64)
    dims = []
    for t, s in enumerate(shapes):
        if len(s) == 0:
            units[t, 0] = 1
            dims.append(0)
        else:
            units[t] = chunk_sizes(int(s[0]), world_size)
            dims.append(1)
    return PerTensorLayout(world_size, tuple(tuple(s) for s in shapes), tuple(dims), units)


def element_layout(shapes: Sequence[Sequence[int]], world_size: int, align: int = 1) -> FlatLayout:
    """FSDP1 / ZeRO flat partition: tensors packed densely, end-padded, split into W equal parts."""
    _, offsets, per_rank = flat_partition_extent(shapes, world_size, align)
    return FlatLayout(world_size, per_rank, tuple(tuple(s) for s in shapes),
                      tuple(len(s) for s in shapes), tuple(int(o) for o in offsets))


def layout_from_meta(meta: dict, world_size: int, shapes, dims, offsets, tables: dict[str, np.ndarray]) -> BufferLayout:
    family = meta.get("family")
    if family == "flat":
        return FlatLayout(world_size, int(meta["shard_size"]), shapes, dims, offsets)
    if family == "per_tensor":  # the table may be a DeferredUnits, read on first use
        return PerTensorLayout(world_size, shapes, dims, tables["units"])
    raise LayoutError(f"unknown layout family '{family}' in checkpoint metadata")


def _exclusive_group_sums(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """For `values` sorted by `groups`: the sum of the values before each one in its own group."""
    total = np.cumsum(values)
    total -= values
    return total - total[np.searchsorted(groups, groups)]
