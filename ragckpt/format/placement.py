"""The RaggedShard placement of one tensor over one mesh dimension of W ranks.

A placement says which contiguous range of the tensor's row-major flattened elements each rank
holds. `dims` is the flattened prefix: one *unit* of `local_units` scales to a whole number of
"rows" of the `dims` view, so a shard boundary never cuts a row. `dims=()` means the tensor is never
split and exactly one rank owns it. The global shape is always carried alongside the placement
because a rank that holds zero units cannot recover it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ragckpt.errors import LayoutError

#: elements of one tensor or one buffer: offsets are int64, and a buffer's sum of sizes must not wrap
MAX_NUMEL = 1 << 62
#: the largest world size a layout may have (docs/FORMAT.md section 3): readers allocate per-rank
#: tables, so writers never produce more. Checked before anything of that size is allocated: a
#: typo such as `world_size=10**9` would otherwise fill memory with per-rank tables first.
MAX_WORLD_SIZE = 1 << 20


def positive_int(value: object, what: str) -> int:
    """`value` as an int >= 1, or one LayoutError naming `what` (a float or 0 would otherwise surface as
    a ZeroDivisionError or a silently truncated size deep inside the layout code)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise LayoutError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def world_size_of(value: object, what: str = "world size") -> int:
    """`value` as a world size: a positive int no larger than `MAX_WORLD_SIZE`, or one LayoutError."""
    n = positive_int(value, what)
    if n > MAX_WORLD_SIZE:
        raise LayoutError(f"{what} {n:,} is above the format's limit of {MAX_WORLD_SIZE:,} ranks; check the value")
    return n


def all_counts(values: list | tuple, lo: int = 0, hi: int | None = None) -> bool:
    """Whether every value is a plain int (no bool, float or numpy integer) in [lo, hi], in a few
    C-level passes rather than a call per value: opening a checkpoint checks a shape, a dims entry
    and an offset per tensor, and one check at a time was a tenth of a `ragckpt.open`."""
    return set(map(type, values)) <= {int} and (not values or (lo <= min(values) and (hi is None or max(values) <= hi)))


def counts(values: Sequence[object], what: str) -> tuple[int, ...]:
    """`values` as non-negative ints (shapes, units), or one LayoutError naming `what`: `int()` alone
    would turn 4.5 into 4 and let a wrong size through."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise LayoutError(f"{what} must be a sequence of non-negative integers, got {values!r}")
    if type(values) in (tuple, list) and all_counts(values):
        return tuple(values)  # the common case (plain ints, as JSON and checked shapes hold them), no loop
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise LayoutError(f"{what} must be non-negative integers, got {tuple(values)[:16]}")
        out.append(int(v))
    return tuple(out)


def shape_of(shape: Sequence[object], what: str = "a shape") -> tuple[int, ...]:
    """`shape` as non-negative ints with fewer than `MAX_NUMEL` elements (and no dimension that
    large, even with no elements), or one LayoutError naming `what`: sizes past that wrap int64 in
    the offsets and sums computed from them."""
    dims = counts(shape, what)
    if max(dims, default=0) >= MAX_NUMEL or math.prod(dims) >= MAX_NUMEL:
        raise LayoutError(f"{what} {dims} is more than a layout can address (under 2**62 elements); check the shape")
    return dims


def shapes_of(shapes: Sequence[Sequence[object]], what: str = "tensor") -> tuple[tuple[int, ...], ...]:
    """Every shape in `shapes` as `shape_of` gives it (the error names the shape of `what` #i). The
    common case, tuples or lists of Python ints as JSON and the planner give them, is checked in a
    few C-level passes: opening a checkpoint validates every tensor's shape, and one `shape_of` call
    per tensor was a fifth of a `ragckpt.open`."""
    kinds = set(map(type, shapes)) if type(shapes) in (tuple, list) else None
    if kinds is not None and kinds <= {tuple, list}:
        flat = list(itertools.chain.from_iterable(shapes))
        if all_counts(flat, 0, MAX_NUMEL - 1) and max(map(math.prod, shapes), default=0) < MAX_NUMEL:
            return tuple(map(tuple, shapes))
    return tuple(shape_of(s, f"the shape of {what} #{t}") for t, s in enumerate(shapes))


def rank_index(rank: object, world_size: int, what: str = "rank") -> int:
    """`rank` as an int in [0, world_size), or one LayoutError (a negative index would silently
    count from the end)."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
        raise LayoutError(f"{what} {rank!r} is outside world size {world_size}")
    return int(rank)


def flat_partition_extent(shapes: Sequence[Sequence[int]], world_size: int,
                          align: int = 1) -> tuple[np.ndarray, np.ndarray, int]:
    """The FSDP1 / ZeRO flat partition of tensors packed densely in order: their element counts,
    their offsets in the packed buffer, and the per-rank share (the total over `world_size`, rounded
    up to a multiple of `align`; the end is padding)."""
    world_size = world_size_of(world_size)
    align = positive_int(align, "alignment")
    sizes = [numel_of(shape_of(s)) for s in shapes]
    total = sum(sizes)
    if total >= MAX_NUMEL:
        raise LayoutError(f"the tensors total {total:,} elements, more than a layout can address (under 2**62)")
    numels = np.asarray(sizes, dtype=np.int64)
    per_rank = -(-total // world_size) if total else 0
    return numels, np.cumsum(numels) - numels, -(-per_rank // align) * align


def numel_of(shape: Sequence[int]) -> int:
    return math.prod(map(int, shape))


def row_numel(shape: Sequence[int], ndims: int) -> int:
    """Elements in one "row" when the first `ndims` dimensions are flattened into the sharded axis."""
    return numel_of(shape[ndims:])


@dataclass(frozen=True)
class RaggedShard:
    """`RaggedShard(dims, local_units)`: rank r owns flat elements
    `[sum(u[:r]) * ratio, sum(u[:r+1]) * ratio)` with `ratio = numel / sum(u)`."""

    dims: tuple[int, ...]
    local_units: tuple[int, ...]

    def __post_init__(self) -> None:
        dims = counts(self.dims, "RaggedShard dims")  # int() would take 0.7 for 0 and "0" too
        if dims != tuple(range(len(dims))):
            raise LayoutError(f"RaggedShard dims must be a prefix (0, 1, ..., d-1) of the tensor dims, got {dims}")
        if hasattr(self.local_units, "__len__") and len(self.local_units) > MAX_WORLD_SIZE:
            world_size_of(len(self.local_units), "RaggedShard world size (its number of local_units)")
        units = counts(self.local_units, "RaggedShard local_units")
        if not units:
            raise LayoutError("RaggedShard needs one unit count per rank; got an empty local_units")
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "local_units", units)

    @property
    def world_size(self) -> int:
        return len(self.local_units)

    # -- validation against a concrete tensor ---------------------------------------------------
    def ratio(self, shape: Sequence[int]) -> int:
        """Elements per unit for a tensor of `shape`; validates every rule of the placement."""
        shape = shape_of(shape)
        n = numel_of(shape)
        total = sum(self.local_units)
        if len(self.dims) > len(shape):
            raise LayoutError(f"RaggedShard dims {self.dims} flatten more dims than the tensor has (shape {shape})")
        if total == 0:
            if n != 0:
                raise LayoutError(f"RaggedShard units are all zero but the tensor of shape {shape} has {n} elements")
            return 0
        if n % total:
            raise LayoutError(
                f"tensor of shape {shape} has {n} elements, not divisible by sum(local_units)={total}; "
                "scale the units so each one is a whole number of elements"
            )
        ratio = n // total
        row = row_numel(shape, len(self.dims))
        if not self.dims:
            if sum(1 for u in self.local_units if u) > 1:
                raise LayoutError(f"dims=() means one owner, but {sum(1 for u in self.local_units if u)} ranks have units")
        elif n and ratio % row:
            # each unit must be a whole number of rows, otherwise boundaries cut rows
            bounds = np.cumsum(np.asarray(self.local_units, dtype=np.int64)) * ratio
            if np.any(bounds % row):
                raise LayoutError(
                    f"RaggedShard(dims={self.dims}) on shape {shape}: a shard boundary cuts a row of {row} elements"
                )
        return ratio

    def ranges(self, shape: Sequence[int]) -> np.ndarray:
        """(W, 2) int64 array of each rank's [start, stop) flat element range."""
        ratio = self.ratio(shape)
        ends = np.cumsum(np.asarray(self.local_units, dtype=np.int64)) * ratio
        starts = np.concatenate([[0], ends[:-1]])
        return np.stack([starts, ends], axis=1)

    def local_shape(self, shape: Sequence[int], rank: int) -> tuple[int, ...]:
        """N-D shape of rank's piece: `(rows, *shape[1:])` when it is whole rows of dim 0 (always so
        for dims=(0,)), `shape` for the owner of an unsplit tensor. A piece that cuts dim-0 rows
        (element partitions) has no N-D shape: use its flat range."""
        start, stop = (int(x) for x in self.ranges(shape)[rank_index(rank, self.world_size)])
        shape = shape_of(shape)
        if not shape:
            return () if stop > start else (0,)
        row = row_numel(shape, 1)
        if row == 0:  # rows of zero elements: count them from the units where each unit is whole rows
            total = sum(self.local_units)
            if self.dims == (0,) and total and shape[0] % total == 0:
                return (self.local_units[rank_index(rank, self.world_size)] * (shape[0] // total), *shape[1:])
            return (0, *shape[1:])
        if start % row or stop % row:
            raise LayoutError(f"rank {rank}'s piece [{start}, {stop}) of shape {shape} cuts a dim-0 row of {row} "
                              "elements; it is only a flat range")
        return ((stop - start) // row, *shape[1:])

    # -- constructors from the layouts users have today -------------------------------------------
    @classmethod
    def row_chunks(cls, shape: Sequence[int], world_size: int) -> RaggedShard:
        """FSDP2 `Shard(0)`: torch.chunk row splits (ceil-sized chunks; trailing ranks may be empty)."""
        shape = shape_of(shape)
        if not shape:
            return cls.whole(world_size, owner=0)
        return cls((0,), tuple(int(x) for x in chunk_sizes(shape[0], world_size)))

    @classmethod
    def whole(cls, world_size: int, owner: int = 0) -> RaggedShard:
        """Whole-tensor ownership (Muon, Shampoo): one rank holds everything."""
        world_size = world_size_of(world_size)
        units = [0] * world_size
        units[rank_index(owner, world_size, "owner rank")] = 1
        return cls((), tuple(units))

    @classmethod
    def flat_partition(
        cls, shapes: Sequence[Sequence[int]], world_size: int, align: int = 1
    ) -> list[RaggedShard]:
        """FSDP1 / ZeRO / Megatron distributed optimizer: the parameters are concatenated into one flat
        buffer, padded at the end to a multiple of `world_size * align`, and split into equal parts.
        Returns one element-granular placement per tensor."""
        numels, offsets, per_rank = flat_partition_extent(shapes, world_size, align)
        out = []
        bounds = np.arange(world_size + 1, dtype=np.int64) * per_rank
        for shape, off, n in zip(shapes, offsets, numels, strict=True):
            lo = np.clip(bounds[:-1], off, off + n)
            hi = np.clip(bounds[1:], off, off + n)
            out.append(cls(tuple(range(len(shape))), tuple(int(x) for x in hi - lo)))
        return out


def chunk_sizes(n: int, world_size: int) -> np.ndarray:
    """Row counts per rank of `torch.chunk(x, world_size)` on `n` rows, zero-padded to world_size."""
    world_size = world_size_of(world_size)
    if n == 0:
        return np.zeros(world_size, dtype=np.int64)
    c = -(-n // world_size)
    starts = np.arange(world_size, dtype=np.int64) * c
    return np.clip(n - starts, 0, c)
