"""Spreading whole-owned tensors over ranks across `fully_shard` units.

The planner lays out each unit on its own and fills ranks from rank 0, so with whole-tensor
granularity (Muon's matrices, each owned by one rank that runs Newton–Schulz on it) every block of
a transformer gives the same ranks the same matrices: at 8 ranks and 7 matrices per block, rank 0 is
the busiest in every block and some ranks own nothing anywhere. Rotating a unit's global flat buffer
by whole shards moves every tensor that does not cross the wrap point to another rank, unchanged
inside its shard (the same shard size, padding and cuts), so the engine picks, per unit, the rotation
that keeps the running per-rank load lowest. Every rank computes the same choice (same units in the
same order), so no communication is needed.
"""

from __future__ import annotations

import ragckpt

#: per world size, the work of the whole-owned tensors placed so far on each rank (this process's units)
_load: dict[int, list[int]] = {}


def _cost(shape: tuple[int, ...]) -> int:
    """A whole-owned tensor's per-step work on its owner: a matrix's Newton–Schulz cost grows with
    numel x min(rows, cols); anything else with its size."""
    n = 1
    for s in shape:
        n *= s
    return n * min(shape[0], shape[1]) if len(shape) == 2 else n


def whole_owned(layout: ragckpt.FlatLayout) -> list[int]:
    """The slots of the tensors `layout` keeps whole on one rank (0-d and one-element ones aside)."""
    return [t for t, (shape, d) in enumerate(zip(layout.shapes, layout.dims, strict=True))
            if d == 0 and len(shape) > 0 and int(layout.numels[t]) > 1]


def _rotated(layout: ragckpt.FlatLayout, r: int) -> tuple[int, ...] | None:
    """The offsets after moving shard k to rank (k + r) mod W; None when a tensor crosses the wrap."""
    W, S = layout.world_size, layout.shard_size
    cut = (W - r) * S
    out = []
    for o, n in zip(layout.offsets, layout.numels, strict=True):
        o, n = int(o), int(n)
        if n and o < cut < o + n:
            return None
        out.append(o + r * S if o < cut else o - cut)
    return tuple(out)


def balance(layout: ragckpt.FlatLayout) -> ragckpt.FlatLayout:
    """`layout`, rotated by the whole shards that best spread its whole-owned tensors over the ranks
    given the units laid out before it; unchanged when it has none (row and element plans are
    already even) or one rank."""
    W, S = layout.world_size, layout.shard_size
    whole = whole_owned(layout)
    if W == 1 or not whole or S == 0:
        return layout
    here = [0] * W
    for t in whole:
        here[int(layout.offsets[t]) // S] += _cost(layout.shapes[t])
    load = _load.setdefault(W, [0] * W)
    best: tuple[tuple[int, int], int, tuple[int, ...]] | None = None
    for r in range(W):
        offsets = _rotated(layout, r)
        if offsets is None:
            continue
        after = [load[k] + here[(k - r) % W] for k in range(W)]
        key = (max(after), r)
        if best is None or key < best[0]:
            best = (key, r, offsets)
    assert best is not None  # r = 0 always fits
    _, r, offsets = best
    for k in range(W):
        load[k] += here[(k - r) % W]
    if r == 0:
        return layout
    return ragckpt.FlatLayout(W, S, layout.shapes, layout.dims, offsets)


def reset() -> None:
    """Forget the units placed so far (a new model in the same process starts from even ranks)."""
    _load.clear()
