"""The structure-aware planner: one global flat buffer of `W * S` elements for a group of tensors.

Rules (REFERENCE.md section 1): tensors are contiguous and disjoint; a rank boundary strictly inside a
tensor t must fall on a multiple of its granularity `g_t` from the tensor start (blocks are never
split); S is a multiple of the collective alignment; minimise S. Padding goes only between tensors.

The problem is NP-hard, so as published we binary-search S and place tensors greedily in order,
moving a tensor's start forward to the first offset where every boundary it crosses is aligned.
A tensor that crosses two or more boundaries additionally needs `S % g_t == 0`. The search result is
always valid: the planner checks its own output, and `S >= sum(numel)` is always feasible.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ragckpt.errors import LayoutError
from ragckpt.format.layout import FlatLayout
from ragckpt.format.placement import counts, numel_of, positive_int


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


def _place(numels: Sequence[int], grans: Sequence[int], S: int, limit: int) -> list[int] | None:
    """Greedy placement at shard size S; None when it does not fit in `limit` elements."""
    out = []
    p = 0
    for e, g in zip(numels, grans, strict=True):
        if e == 0:
            out.append(p)
            continue
        while True:
            b = (p // S + 1) * S  # first boundary strictly after p
            if p + e <= b:
                break  # crosses nothing
            shift = (b - p) % g
            if shift == 0:
                if p + e > b + S and S % g:
                    return None  # crosses two boundaries that cannot both be aligned at this S
                break
            p += shift  # may land exactly on b; the next round re-checks from there
            if p > limit:
                return None
        out.append(p)
        p += e
        if p > limit:
            return None
    return out


def plan(numels: Sequence[int], granularities: Sequence[int], world_size: int, align: int = 1) -> Plan:
    """Minimal-S (heuristically) offsets for tensors of `numels` elements with block sizes
    `granularities`, W = `world_size`, S a multiple of `align`. Deterministic."""
    numels = [int(x) for x in numels]
    grans = [max(1, g) for g in counts(granularities, "granularities")]
    if len(numels) != len(grans):
        raise LayoutError(f"{len(numels)} tensors but {len(grans)} granularities")
    positive_int(world_size, "world size")
    positive_int(align, "alignment")
    total = sum(numels)

    def up(x: int) -> int:
        return -(-x // align) * align

    if total == 0:
        return Plan(0, tuple(0 for _ in numels), world_size, 0)
    # a tensor whose block is larger than S could never be split at all: S >= its block
    S0 = up(max(-(-total // world_size), max((g for g, e in zip(grans, numels, strict=True) if e), default=1)))
    # Only a tensor larger than S can cross two boundaries, and then S must be a multiple of its
    # block; search S among multiples of the lcm of those blocks (a fixed point, since raising S
    # can only shrink the set of large tensors).
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

    def fits(k: int) -> list[int] | None:
        return _place(numels, grans, k * unit, world_size * k * unit)

    best = fits(lo_k)
    k_best = lo_k
    if best is None:
        # exponential probe upward, then binary search between the last miss and the first hit
        step, miss = 1, lo_k
        while True:
            cand = min(hi_k, lo_k + step)
            res = fits(cand)
            if res is not None:
                k_best, best = cand, res
                break
            if cand == hi_k:  # pragma: no cover - S >= total always fits
                raise LayoutError("planner failed to find a feasible shard size")
            miss, step = cand, step * 2
        while k_best - miss > 1:
            mid = (miss + k_best) // 2
            res = fits(mid)
            if res is None:
                miss = mid
            else:
                k_best, best = mid, res
    S = k_best * unit
    assert best is not None
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
    if isinstance(policy, int) and not isinstance(policy, bool):
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
