"""Comparing two checkpoints tensor by tensor, bit for bit, whatever their world sizes and layouts.

This is how a user checks that a reshard, an import or a copy kept every bit: both checkpoints are
read through the verified range reads in windows of flat elements, never a whole tensor, and the
bytes compared as same-width integers, so NaN payloads and -0.0 count as the values they are and
nothing is ever cast. A differing tensor is described by how many elements differ, the first of
them (N-D index and both values) and, for numbers, the largest absolute difference.
"""

from __future__ import annotations

import fnmatch
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.checkpoint.reader import open as open_checkpoint
from ragckpt.checkpoint.writer import default_workers
from ragckpt.errors import OptionError, UnknownNameError
from ragckpt.format.dtypes import itemsize, torch_dtype
from ragckpt.storage.direct import ThreadBuffers

if TYPE_CHECKING:
    import torch
else:
    from ragckpt.lazy import torch

#: default memory for data in flight: both sides' windows of every thread together
DEFAULT_WINDOW_BYTES = 256 << 20
#: smallest read per side: below it, per-request costs dominate
MIN_WINDOW_BYTES = 64 << 10


def min_window_bytes(a: Checkpoint, b: Checkpoint) -> int:
    """The least memory one comparing thread needs: a `MIN_WINDOW_BYTES` window of each side and
    the staging copy a read may make of it, and, per side, the two checksum blocks a window's ends
    may cut, which are read whole into the reader's scratch to be verified."""
    return 4 * MIN_WINDOW_BYTES + 2 * (a.block_bytes + b.block_bytes)


@dataclass
class TensorDifference:
    """One tensor that is not the same in both checkpoints. `kind` is `only_a`, `only_b`, `shape`,
    `dtype` or `values`; for `values`, how many elements differ and the first one."""

    name: str
    kind: str
    detail: str
    differing: int = 0
    numel: int = 0
    first_index: tuple[int, ...] | None = None
    first_values: tuple[object, object] | None = None
    max_abs_diff: float | int | None = None  # over the differing elements not NaN on either side; exact for ints

    def as_dict(self) -> dict:
        d: dict = {"name": self.name, "kind": self.kind, "detail": self.detail}
        if self.kind == "values":
            d.update(differing=self.differing, numel=self.numel, first_index=list(self.first_index or ()),
                     first_values=[_json_number(v) for v in self.first_values or ()],
                     max_abs_diff=_json_number(self.max_abs_diff))
        return d


@dataclass
class CompareReport:
    a: str
    b: str
    compared: int = 0  # tensors whose elements were compared (same shape and dtype on both sides)
    identical: int = 0
    bytes: int = 0  # bytes compared, per side
    differences: list[TensorDifference] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences

    def as_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "ok": self.ok, "identical": self.ok, "compared": self.compared,
                "identical_tensors": self.identical, "bytes": self.bytes,
                "differences": [d.as_dict() for d in self.differences]}


def _json_number(v: object) -> object:
    """NaN and infinities as strings: JSON has no spelling for them."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, complex):
        return str(v)
    return v


def _select(names: Iterable[str], patterns: Sequence[str] | None) -> list[str]:
    if not patterns:
        return list(names)
    if isinstance(patterns, str):  # one glob, not its characters (a lone '*' would match everything)
        patterns = [patterns]
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _as_words(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements as unsigned integers of their width, one row per element for 16-byte
    complex128 (two 64-bit words), so that `!=` compares bits, not values."""
    raw = t.view(torch.uint8) if t.dtype == torch.bool else t
    size = t.element_size()
    as_u8 = raw.view(torch.uint8).numpy()
    if size == 16:
        return as_u8.view(np.uint64).reshape(-1, 2)
    return as_u8.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size])


#: elements of a differing window examined at a time (a few MiB of masks, indices and differences)
_SUB_ELEMENTS = 1 << 16


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: `torch.equal` on them is a plain memory comparison (NaN equals itself)."""
    return (t.view(torch.uint8) if t.dtype == torch.bool else t).view(torch.uint8)


def _largest_gap(da: torch.Tensor, db: torch.Tensor) -> float | int | None:
    """max |a - b| over pairs where neither is NaN; None if there is no such pair. Exact for integers
    of any width (as Python ints: 64-bit values above 2**53 would lose their low bits in float64)."""
    if da.dtype == torch.bool or not (da.dtype.is_floating_point or da.dtype.is_complex):
        if da.element_size() < 8 or da.dtype == torch.bool:
            return int((da.to(torch.int64) - db.to(torch.int64)).abs().max())
        signed = da.dtype == torch.int64
        ua = da.view(torch.uint8).numpy().view(np.uint64)
        ub = db.view(torch.uint8).numpy().view(np.uint64)
        sa = ua.view(np.int64) if signed else ua
        sb = ub.view(np.int64) if signed else ub
        # the true distance is below 2**64: unsigned wrap-around subtraction in the right order gives it
        return int(np.where(sa >= sb, ua - ub, ub - ua).max())
    if da.dtype.is_complex:
        gaps = (da.to(torch.complex128) - db.to(torch.complex128)).abs()
    else:
        gaps = (da.double() - db.double()).abs()
    gaps = gaps[~gaps.isnan()]  # a NaN on either side (or NaNs with other payloads) has no distance
    return float(gaps.max()) if gaps.numel() else None


def _item(t: torch.Tensor) -> object:
    v = t.item()
    return bool(v) if t.dtype == torch.bool else v


class _Tally:
    """What the windows of one tensor found, merged as they finish (in any order)."""

    def __init__(self, name: str, shape: tuple[int, ...], numel: int):
        self.name, self.shape, self.numel = name, shape, numel
        self.differing = 0
        self.first: int | None = None
        self.first_values: tuple[object, object] | None = None
        self.max_abs: float | int | None = None
        self.lock = threading.Lock()

    def add(self, start: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Merge in flat elements `[start, start + len(a))`. Identical windows (the common case) cost
        one comparison of their bytes and no memory; differing ones are examined `_SUB_ELEMENTS` at
        a time, so the masks, indices and differences of a window where everything differs stay a
        few MiB, not tens of bytes per element."""
        if torch.equal(_raw(a), _raw(b)):
            return
        wa, wb = _as_words(a), _as_words(b)
        for s in range(0, len(wa), _SUB_ELEMENTS):
            e = min(len(wa), s + _SUB_ELEMENTS)
            ne = wa[s:e] != wb[s:e]
            if ne.ndim == 2:
                ne = ne.any(axis=1)
            idx = np.flatnonzero(ne)
            if len(idx):
                pick = torch.from_numpy(idx + s)
                self._merge(start + s + int(idx[0]), len(idx), a[pick], b[pick])

    def _merge(self, first: int, count: int, da: torch.Tensor, db: torch.Tensor) -> None:
        gap = _largest_gap(da, db)
        with self.lock:
            self.differing += count
            if self.first is None or first < self.first:
                self.first = first
                self.first_values = (_item(da[0]), _item(db[0]))
            if gap is not None and (self.max_abs is None or gap > self.max_abs):
                self.max_abs = gap

    def difference(self) -> TensorDifference | None:
        if not self.differing:
            return None
        first = tuple(int(i) for i in np.unravel_index(self.first, self.shape)) if self.shape else ()
        a, b = self.first_values or (None, None)
        gap = self.max_abs
        largest = ("only NaNs differ" if gap is None else f"largest |a - b| {gap}" if isinstance(gap, int)
                   else f"largest |a - b| {gap:g}")
        return TensorDifference(
            self.name, "values",
            f"{self.differing} of {self.numel} elements differ (first at {list(first)}: {a!r} vs {b!r}; {largest})",
            differing=self.differing, numel=self.numel, first_index=first, first_values=(a, b),
            max_abs_diff=self.max_abs)


def compare(a: str | Checkpoint, b: str | Checkpoint, *, names: Sequence[str] | None = None,
            storage_options: dict | None = None, window_bytes: int = DEFAULT_WINDOW_BYTES,
            workers: int | None = None, progress: Callable[[int], None] | None = None,
            on_total: Callable[[int], None] | None = None) -> CompareReport:
    """Compare every tensor of checkpoints `a` and `b` (or those matching the glob `names`).

    The two may have any world sizes and layout kinds: tensors are matched by name and compared in
    flat element order. Memory for data stays under `window_bytes`: `workers` threads each hold
    one window of both sides, room for the staging copy a read may make, and the two checksum blocks
    a window's ends cut on each side (read whole to verify them), so the least window is
    `min_window_bytes` of the two (4.25 MiB for the default 1 MiB blocks). Every byte is read
    through the checksum-verified path, so a damaged
    object raises `IntegrityError` rather than counting as a difference. User metadata and per-rank
    extras are not compared (a reshard records its provenance in the user metadata, and extras
    belong to the ranks of one world size)."""
    ca = a if isinstance(a, Checkpoint) else open_checkpoint(a, storage_options=storage_options)
    cb = b if isinstance(b, Checkpoint) else open_checkpoint(b, storage_options=storage_options)
    per_thread = min_window_bytes(ca, cb)
    if window_bytes < per_thread:  # raised to it silently, it would not be the bound asked for
        raise OptionError(f"window of {window_bytes} bytes is below the {per_thread} diff needs for these checkpoints "
                          f"(a {MIN_WINDOW_BYTES >> 10} KiB window of each side, its staging copy and the checksum "
                          f"blocks at its ends: {ca.block_bytes} and {cb.block_bytes} bytes); give --window "
                          f"{-(-per_thread // (64 << 10)) * 64}KiB or more")
    report = CompareReport(ca.url, cb.url)
    in_a, in_b = set(_select(ca.names(), names)), set(_select(cb.names(), names))
    if isinstance(names, str):
        names = [names]
    # every glob must match something: a typo among several would drop its tensors from the
    # comparison, and a real difference there would pass as "identical"
    unmatched = [p for p in names or () if not _select(in_a | in_b, [p])]
    if unmatched:
        raise UnknownNameError(f"no tensor of {ca.url} or {cb.url} matches {' or '.join(map(repr, unmatched))}; "
                               "`ragckpt ls` lists the names")
    for n in sorted(in_a - in_b):
        report.differences.append(TensorDifference(n, "only_a", f"only in {ca.url}"))
    for n in sorted(in_b - in_a):
        report.differences.append(TensorDifference(n, "only_b", f"only in {cb.url}"))
    tallies: list[_Tally] = []
    for n in sorted(in_a & in_b):
        ma, mb = ca.meta(n), cb.meta(n)
        if ma.shape != mb.shape:
            report.differences.append(TensorDifference(n, "shape", f"shape {list(ma.shape)} vs {list(mb.shape)}"))
        elif ma.dtype != mb.dtype:
            report.differences.append(TensorDifference(n, "dtype", f"dtype {ma.dtype} vs {mb.dtype}"))
        else:
            tallies.append(_Tally(n, ma.shape, ma.numel))
    # every thread's windows, staging copies and edge blocks together stay under window_bytes (fewer
    # threads for a small one)
    workers = max(1, min(workers or default_workers(), window_bytes // per_thread))
    edges = per_thread - 4 * MIN_WINDOW_BYTES
    per_side = max(MIN_WINDOW_BYTES, (window_bytes // workers - edges) // 4)
    jobs: list[tuple[_Tally, int, int]] = []
    for t in tallies:
        step = max(1, per_side // itemsize(ca.meta(t.name).dtype))
        jobs.extend((t, s, min(t.numel, s + step)) for s in range(0, t.numel, step))
        report.bytes += ca.meta(t.name).nbytes
    if on_total is not None:
        on_total(report.bytes)

    # each thread reads every window into the same two buffers: fresh ones per window were freed into
    # the threads' malloc arenas, which kept them (a 32 MiB window peaked at 290 MiB)
    side_a, side_b = ThreadBuffers(per_side), ThreadBuffers(per_side)

    def one(job: tuple[_Tally, int, int]) -> None:
        t, s, e = job
        dt = torch_dtype(ca.meta(t.name).dtype)
        wa = ca.read_flat(t.name, s, e, out=side_a.take_tensor(e - s, dt))
        t.add(s, wa, cb.read_flat(t.name, s, e, out=side_b.take_tensor(e - s, dt)))
        if progress is not None:
            progress((e - s) * wa.element_size())

    if workers > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(min(workers, len(jobs))) as ex:
            for _ in ex.map(one, jobs):
                pass
    else:
        for job in jobs:
            one(job)
    report.compared = len(tallies)
    for t in tallies:
        d = t.difference()
        if d is None:
            report.identical += 1
        else:
            report.differences.append(d)
    report.differences.sort(key=lambda d: d.name)
    return report
