"""The structure-aware planner: one global flat buffer of `W * S` elements for a group of tensors.

Rules (REFERENCE.md section 1): tensors are contiguous and disjoint; a rank boundary strictly inside a
tensor t must fall on a multiple of its granularity `g_t` from the tensor start (blocks are never
split); S is a multiple of the collective alignment; minimise S. Padding goes only between tensors.

The problem is NP-hard when tensors may be reordered. We keep the given order (the engine's buffer
order), and for a given order and S the greedy placement is exact: each tensor goes to its earliest
valid start (`_place`). Which S fit is not monotone, so as published we binary-search S, then scan
the sizes below the result for the smallest that fits. A tensor that crosses two or more boundaries
needs `S % g_t == 0`; one up to 2S long can often start where it crosses just one. The result is
always valid (`FlatLayout` checks it), and `S >= sum(numel)` always fits.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ragckpt.errors import LayoutError
from ragckpt.format.layout import FlatLayout
from ragckpt.format.placement import counts, numel_of, positive_int, world_size_of


@dataclass(frozen=True)
class Plan:
    shard_size: int
    offsets: tuple[int, ...]
    world_size: int
    total_numel: int

    @property
    def padding(self) -> int:
        return self.world_size * self.shard_size - self.total_numel

    @property
    def padding_ratio(self) -> float:
        return self.padding / max(1, self.world_size * self.shard_size)


def _place(numels: Sequence[int], grans: Sequence[int], S: int, limit: int) -> tuple[list[int] | None, int]:
    """Every tensor, in order, at its earliest valid start at shard size S, or None when they do not
    fit in `limit` elements; with the number of tensors placed before that was known (the work done). Exact for a given order and S: a later start can only narrow the choices of
    the tensors after it, so the earliest start of each is never worse.

    A start at offset q into a shard first meets the boundary `S - q` elements on. It is valid when the
    tensor ends by then; or when that boundary is on a block edge (`(S - q) % g == 0`) and the tensor
    either ends before the boundary after it (`q + e <= 2S`) or every later boundary is on an edge too
    (`S % g == 0`). Every shard after the current one offers the same offsets, so the current shard
    (from the current position) and the next one (from its start) decide."""
    out = []
    p = 0
    for e, g in zip(numels, grans, strict=True):
        if e == 0:
            out.append(p)
            continue
        base, q0 = (p // S) * S, p % S
        start = -1
        for _ in range(2):
            if e <= S - q0:  # crosses no boundary
                start = base + q0
                break
            q = q0 + (S - q0) % g  # the first offset whose next boundary is on a block edge
            if q < S and (S % g == 0 or q + e <= 2 * S):
                start = base + q
                break
            base, q0 = base + S, 0
        if start < 0:
            return None, len(out) + 1
        out.append(start)
        p = start + e
        if p > limit:
            return None, len(out)
    return out, len(out)


class _MustDivide:
    """What a shard size S itself must be a multiple of: `align`, and the block of every tensor longer
    than 2S, which crosses two boundaries wherever it starts, so both lie on block edges only if
    S % g == 0. A tensor of e elements stops counting at S = ceil(e / 2). Tensors are kept longest
    first with running lcms of their blocks, so a lookup is a bisection, not a pass over all of them
    (with many coprime blocks one lcm pass cost a millisecond)."""

    def __init__(self, numels: Sequence[int], grans: Sequence[int], align: int):
        pairs = sorted(((e, g) for e, g in zip(numels, grans, strict=True) if e), reverse=True)
        self._neg = [-e for e, _ in pairs]  # ascending, for bisect
        self._lcm = [align]
        for _, g in pairs:
            self._lcm.append(math.lcm(self._lcm[-1], g))

    def at(self, S: int) -> tuple[int, int]:
        """(the multiple S must be, the smallest larger S where that changes, or -1 if it never does)."""
        n = bisect.bisect_left(self._neg, -2 * S)  # tensors with e > 2S
        return self._lcm[n], ((-self._neg[n - 1] + 1) // 2 if n else -1)


#: tensor placements (about 0.4 us each) spent on the sizes below the binary search's result: first
#: trying them one by one from the bottom (exhaustive for small groups), then, if that runs out,
#: probing each stretch of sizes with the same required divisor
_SCAN_WORK = 100_000
_PROBE_WORK = 200_000


class _Budget:
    """`_place` at shard size S with the tensor placements it costs charged to `left`."""

    def __init__(self, numels: list[int], grans: list[int], world_size: int, left: int):
        self.numels, self.grans, self.world_size, self.left = numels, grans, world_size, left

    def fits(self, S: int) -> list[int] | None:
        out, work = _place(self.numels, self.grans, S, self.world_size * S)
        self.left -= work
        return out


def plan(numels: Sequence[int], granularities: Sequence[int], world_size: int, align: int = 1) -> Plan:
    """Minimal-S offsets for tensors of `numels` elements with block sizes `granularities`, W =
    `world_size`, S a multiple of `align`, tensors in the order given. Deterministic.

    Which shard sizes fit is not monotone, so a search over S can stop above the smallest one. A
    binary search over multiples of the blocks that must divide S first finds a size that fits. Then
    every shard size that could fit below it (multiples of `align` and of the blocks of tensors
    longer than 2S) is tried in order from the bottom, the first that fits taken: the result is the
    smallest S for this order whenever that scan completes within `_SCAN_WORK` (always for small
    groups). When it does not, the sizes left are split into stretches that share a required divisor
    (it changes where a tensor stops being longer than 2S); from the bottom, the first stretch whose
    largest candidate fits is bisected for its smallest fitting one. Without that, a few huge tensors
    with coprime blocks (whose lcm exceeds the total) left S at the total where a tenth of it fits."""
    numels = list(counts(numels, "tensor element counts"))
    grans = [max(1, g) for g in counts(granularities, "granularities")]
    if len(numels) != len(grans):
        raise LayoutError(f"{len(numels)} tensors but {len(grans)} granularities")
    world_size = world_size_of(world_size)
    align = positive_int(align, "alignment")
    total = sum(numels)

    def up(x: int, unit: int) -> int:
        return -(-x // unit) * unit

    if total == 0:
        return Plan(0, tuple(0 for _ in numels), world_size, 0)
    # every rank's share of the data, and a whole-owned tensor (g == e) must fit in one shard
    lower = up(max(-(-total // world_size), max((g for g, e in zip(grans, numels, strict=True) if e == g),
                                                 default=1)), align)
    S0 = max(lower, up(max((g for g, e in zip(grans, numels, strict=True) if e), default=1), align))
    # The binary search runs over multiples of the lcm of the blocks of tensors larger than S (a
    # fixed point, since raising S can only shrink that set): those can cross two boundaries. Only
    # tensors longer than 2S strictly need S to be a multiple of their block; the scans below the
    # result afterwards try the sizes this leaves out.
    for _ in range(64):
        unit = align
        for g, e in zip(grans, numels, strict=True):
            if e > S0:
                unit = math.lcm(unit, g)
        S1 = -(-S0 // unit) * unit
        if S1 == S0:
            break
        S0 = S1
    hi_k = -(-total // unit)  # one rank holds everything: always feasible
    lo_k = min(S0 // unit, hi_k)
    unbounded = _Budget(numels, grans, world_size, 0)

    best = unbounded.fits(lo_k * unit)
    k_best = lo_k
    if best is None:
        # exponential probe upward, then binary search between the last miss and the first hit
        step, miss = 1, lo_k
        while True:
            cand = min(hi_k, lo_k + step)
            res = unbounded.fits(cand * unit)
            if res is not None:
                k_best, best = cand, res
                break
            if cand == hi_k:  # pragma: no cover - S >= total always fits
                raise LayoutError("planner failed to find a feasible shard size")
            miss, step = cand, step * 2
        while k_best - miss > 1:
            mid = (miss + k_best) // 2
            res = unbounded.fits(mid * unit)
            if res is None:
                miss = mid
            else:
                k_best, best = mid, res
    S = k_best * unit
    assert best is not None
    must_divide = _MustDivide(numels, grans, align)

    def stretches(start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """(first candidate, last candidate, step) of each stretch of sizes in [start, stop) whose
        required divisor is the same, from the bottom; stretches without a candidate are skipped."""
        while start < stop:
            must, change = must_divide.at(start)
            end = stop if change < 0 else min(change, stop)
            first, last = up(start, must), (end - 1) // must * must
            if first <= last:
                yield first, last, must
            start = end

    # 1. every candidate from the bottom, while the budget lasts
    scan = _Budget(numels, grans, world_size, _SCAN_WORK)
    reached = S
    for first, last, step in stretches(lower, S):
        for cand in range(first, last + 1, step):
            if scan.left <= 0:
                reached = cand
                break
            res = scan.fits(cand)
            if res is not None:
                return Plan(cand, tuple(res), world_size, total)
        else:
            continue
        break
    # 2. the rest: the first stretch whose top fits, bisected for its smallest fit (as if monotone)
    probe = _Budget(numels, grans, world_size, _PROBE_WORK)
    for first, last, step in stretches(reached, S):
        if probe.left <= 0:
            break
        res = probe.fits(last)
        if res is None:
            continue
        lo, hi = (first - step) // step, last // step  # in steps: lo known not to (or not tried to) fit
        S, best = last, res
        while hi - lo > 1 and probe.left > 0:
            mid = (lo + hi) // 2
            res = probe.fits(mid * step)
            if res is None:
                lo = mid
            else:
                hi, S, best = mid, mid * step, res
        break
    return Plan(S, tuple(best), world_size, total)


# -- granularity policies -------------------------------------------------------------------------

GranularitySpec = str | int | Mapping[str, "str | int"] | Callable[[str, tuple[int, ...]], "str | int"]
_KROWS = re.compile(r"^rows?:(\d+)$")


def granularity_of(policy: str | int, shape: Sequence[int], name: str | None = None) -> tuple[int, int]:
    """(block elements g, placement dims) for a tensor under `policy`:
    'element', 'row', 'rows:k' (k-row blocks, e.g. quantisation groups), 'whole', or an int
    (explicit element count, must be a multiple of a row). `name` (the tensor's) words errors."""
    shape = tuple(int(s) for s in shape)
    n = numel_of(shape)
    if not shape:
        return 1, 0  # 0-d: a single element owned by one rank
    row = numel_of(shape[1:])
    if policy == "element":
        return 1, len(shape)
    if policy == "row":
        return max(1, row), 1
    if policy == "whole":
        return max(1, n), 0
    if isinstance(policy, int | np.integer) and not isinstance(policy, bool):
        policy = int(policy)
        if policy <= 0 or (row and policy % row):
            what = f"of tensor '{name}' " if name is not None else ""
            raise LayoutError(f"granularity {policy} must be a positive multiple of the row size {row} {what}(shape "
                              f"{shape}); give an element count that every tensor's row size divides, or use row, "
                              "rows:K, element or whole")
        return policy, 1
    m = _KROWS.match(str(policy))
    if m:
        k = int(m.group(1))
        if k <= 0:
            raise LayoutError(f"granularity '{policy}': k must be positive")
        return max(1, k * row), 1
    raise LayoutError(f"unknown granularity '{policy}'; use element, row, rows:K, whole or an element count")


def resolve_granularity(spec: GranularitySpec, name: str, shape: Sequence[int]) -> tuple[int, int]:
    if callable(spec):
        return granularity_of(spec(name, tuple(shape)), shape, name)
    if isinstance(spec, Mapping):
        return granularity_of(spec.get(name, spec.get("*", "row")), shape, name)
    return granularity_of(spec, shape, name)


def plan_layout(
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    world_size: int,
    granularity: GranularitySpec = "row",
    align: int = 1,
) -> FlatLayout:
    """Plan a `FlatLayout` for named tensors under a granularity policy."""
    gd = [resolve_granularity(granularity, n, s) for n, s in zip(names, shapes, strict=True)]
    numels = [numel_of(s) for s in shapes]
    # 0-d and whole-owned tensors must never be split: their block is the whole tensor
    grans = [n if d == 0 else g for (g, d), n in zip(gd, numels, strict=True)]
    p = plan(numels, grans, world_size, align)
    return FlatLayout(world_size, p.shard_size, tuple(tuple(s) for s in shapes), tuple(d for _, d in gd), p.offsets)
