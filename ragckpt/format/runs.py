"""Copying many runs between flat tensors without a Python loop per run.

Layouts with thousands of small pieces (row shards of 1,000 tensors on 8,192 ranks) would spend
seconds in per-run slicing; past a threshold the runs are expanded into index arrays in bounded
batches and copied with one gather/scatter per batch. Tensors are viewed as same-width integers
first, so every dtype (bf16, fp8, bool) moves bit-exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
else:
    from ragckpt.lazy import torch

#: integer dtype names of each element width (complex128 for 16 bytes: no 128-bit integer in torch)
_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64", 16: "complex128"}
_LOOP_MAX_RUNS = 64
#: elements expanded into index arrays at a time: their int64 indices (five arrays' worth) stay a few
#: MiB, and small batches stay in cache (measured 1.5-2x faster than 4M-element ones, which also took
#: ~160 MiB; an import-dcp of inner-dimension shards went 3x past its memory bound with them)
_BATCH_ELEMS = 1 << 16


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """Same memory, viewed as an integer dtype of the same width."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view(getattr(torch, _INT_OF_SIZE[t.element_size()]))


def flat_bits(t: torch.Tensor, device: str | torch.device | None = None) -> torch.Tensor:
    """`t` as a contiguous 1-D tensor of its dtype (on `device`, default its own), its bytes as they
    are. torch's own reshape of a strided tensor, `contiguous`, `clone` and `to` all turn every
    nonzero bool byte into 1; moving a same-width integer view keeps them."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    flat = bits_view(t).reshape(-1)
    if device is not None:
        flat = flat.to(device)
    return flat.view(t.dtype)


def host_bits(t: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """`t` in host memory, same shape and bytes (see `flat_bits`); `copy` even where it is there."""
    return bits_view(t).to("cpu", copy=copy).view(t.dtype)


def copy_bits(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`dst.copy_(src)` for tensors of one dtype, moving their bytes as they are: torch's own bool
    copy (and `clone`, `to`) turns every nonzero byte into 1, which a checkpoint must not do. A lazy
    conjugate or negative view is resolved first: its bytes are not its values."""
    if src.is_conj() or src.is_neg():
        src = src.resolve_conj().resolve_neg()
    bits_view(dst).copy_(bits_view(src))
    return dst


def copy_runs(dst: torch.Tensor, dst_starts, src: torch.Tensor, src_starts, lengths) -> None:
    """`dst[d:d+n] = src[s:s+n]` for every run (1-D tensors of the same element width). A run outside
    either tensor is an error: slices would quietly copy less (or nothing, from an empty source)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not lengths.any():
        return
    dst_starts = np.asarray(dst_starts, dtype=np.int64)
    src_starts = np.asarray(src_starts, dtype=np.int64)
    live = lengths != 0
    ds, ss, ln = dst_starts[live], src_starts[live], lengths[live]
    if (ln < 0).any() or (ds < 0).any() or (ss < 0).any() \
            or int((ds + ln).max()) > dst.numel() or int((ss + ln).max()) > src.numel():
        raise ValueError(f"copy_runs: a run lies outside its tensors ({dst.numel()} destination, {src.numel()} "
                         "source elements)")
    d, s = bits_view(dst), bits_view(src)
    if len(lengths) <= _LOOP_MAX_RUNS or lengths.mean() >= 4096:
        for a, b, n in zip(dst_starts.tolist(), src_starts.tolist(), lengths.tolist(), strict=True):
            if n:
                d[a : a + n] = s[b : b + n]
        return
    ends = np.cumsum(lengths)
    i = 0
    while i < len(lengths):
        base = ends[i] - lengths[i]
        j = int(np.searchsorted(ends, base + _BATCH_ELEMS, side="right"))
        j = max(j, i + 1)
        lens = lengths[i:j]
        total = int(lens.sum())
        rel = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
        di = torch.from_numpy(np.repeat(dst_starts[i:j], lens) + rel)
        si = torch.from_numpy(np.repeat(src_starts[i:j], lens) + rel)
        d[di] = s[si]
        i = j
