"""Load-time resharding: one process of a new world fills its own flat buffers from an old checkpoint.

`load(url, target_layout, rank, into=buffers)` is what an engine calls on an elastic restart instead
of an offline pass. The process plans only its own rank (`SourceIndex.join` of its segments with
the source segments, metadata-only), then reads exactly the source byte ranges its pieces come from,
coalesced per source rank and widened only to the checksum blocks the reader must verify, straight
into the caller's buffers: no tensor is ever materialised whole, and memory beyond the buffers
themselves stays under about four times `budget_bytes` (see `reshard.gather`; by default the
store's `fetch_bytes`: 4 MiB for local files, two multipart parts, 64 MiB by default, for object
stores). CPU buffers are filled in place; a buffer on another device (a GPU) is filled through a
host staging window of `HOST_STAGING_BYTES` (64 MiB), copied over a window at a time, so host memory
does not grow with the buffer.

Tensors are matched by name, so the target layout may group tensors into buffers differently from
the checkpoint (another dtype grouping, another order, a subset of the tensors); shapes and dtypes
must match exactly (a reshard never casts).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from ragckpt.args import check_count
from ragckpt.checkpoint import reader as rd
from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.checkpoint.reader import open as open_checkpoint
from ragckpt.errors import LayoutError, OptionError, UnknownNameError
from ragckpt.format.dtypes import torch_dtype
from ragckpt.planner.state import CheckpointLayout
from ragckpt.reshard.gather import UINT_OF_SIZE, Gatherer, GatherStats, plan_window
from ragckpt.reshard.plan import DestSegments, SourceIndex

if TYPE_CHECKING:
    import torch
else:
    from ragckpt.lazy import torch


def _as_uint(t: torch.Tensor) -> np.ndarray:
    """A writable numpy view of a contiguous CPU tensor as unsigned integers of its element width."""
    flat = t.view(torch.uint8) if t.dtype == torch.bool else t
    return flat.view(torch.uint8).numpy().view(UINT_OF_SIZE[t.element_size()])


#: the largest read budget taken (more than any host holds)
MAX_BUDGET_BYTES = 1 << 40


def load(
    url: str | Checkpoint,
    target_layout: CheckpointLayout,
    rank: int,
    into: Mapping[str, torch.Tensor] | None = None,
    *,
    storage_options: dict | None = None,
    budget_bytes: int | None = None,
    stats: GatherStats | None = None,
) -> dict[str, torch.Tensor]:
    """Fill rank `rank`'s flat buffers of `target_layout` from the checkpoint at `url`.

    `into` maps buffer names to 1-D tensors of `target_layout.rank_sizes(buffer)[rank]` elements and
    the buffer's dtype (the engine's own flat buffers; any device, CPU ones are filled in place with no
    extra copy). Only the buffers named in `into` are loaded; without `into`, every buffer is
    allocated on the CPU. Padding elements are set to zero. Returns `{buffer name: tensor}`."""
    check_count("budget_bytes", budget_bytes, optional=True)
    if budget_bytes is not None and budget_bytes > MAX_BUDGET_BYTES:  # an int64 of offsets would wrap
        raise OptionError(f"budget_bytes must be at most {MAX_BUDGET_BYTES} (1 TiB), got {budget_bytes}")
    ck = url if isinstance(url, Checkpoint) else open_checkpoint(url, storage_options=storage_options)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise TypeError(f"rank must be an integer, got {rank!r}")
    rank = int(rank)
    if not isinstance(target_layout, CheckpointLayout):
        raise TypeError(f"target_layout must be a CheckpointLayout (e.g. ragckpt.reshard.target_layout(ck.layout, "
                        f"world_size)), got {type(target_layout).__name__}")
    if into is not None and not isinstance(into, Mapping):
        raise TypeError(f"into must map buffer names to tensors, got a {type(into).__name__}")
    if not 0 <= rank < target_layout.world_size:
        raise LayoutError(f"rank {rank} is outside the target layout's world size {target_layout.world_size}")
    names = [b.name for b in target_layout.buffers]
    if into is not None:
        unknown = [k for k in into if k not in names]
        if unknown:
            raise UnknownNameError(f"buffer '{unknown[0]}' is not in the target layout; its buffers are {names}")
        wanted = list(into)
        for bname in wanted:  # every buffer checked before any is filled (None: allocate that one)
            if into[bname] is not None:
                _check_into(rank, bname, into[bname], target_layout)
    else:
        wanted = names
    # every tensor of every wanted buffer is matched with the checkpoint before any buffer is filled:
    # a mismatch found midway would leave the engine's buffers half overwritten
    sources = {bname: _source_slots(ck, target_layout, bname) for bname in wanted}
    stats = stats if stats is not None else GatherStats()
    if budget_bytes is None:
        budget_bytes = ck.store.fetch_bytes
    out: dict[str, torch.Tensor] = {}
    indexes: dict[int, SourceIndex] = {}
    for bname in wanted:
        bi = target_layout.buffer_index(bname)
        lay = target_layout.layout_of(bi)
        n = int(lay.rank_sizes()[rank])
        dt = torch_dtype(target_layout.buffers[bi].dtype)
        given = None if into is None else into[bname]
        src_of, slot_of = sources[bname]
        seg = DestSegments(lay).ranks(rank, rank + 1)  # not the whole layout sorted by rank
        covered = np.zeros((0, 2), dtype=np.int64)
        if len(seg):
            covered = np.stack([seg.offset, seg.offset + seg.length], axis=1)
        fills = []  # (Gatherer, plan, plan's end offsets) per source buffer
        for sb in np.unique(src_of[seg.slot]).tolist() if len(seg) else []:
            li = ck.layout.buffers[sb].layout
            index = indexes.setdefault(li, SourceIndex(ck.layout.layouts[li]))
            plan = index.join(seg.select(src_of[seg.slot] == sb), slot_map=slot_of)
            fills.append((Gatherer(ck, sb, budget_bytes=budget_bytes, stats=stats), plan, plan.dst_offset + plan.length))
        if given is None or rd.on_host(given):
            host = given.reshape(-1) if given is not None else torch.empty(n, dtype=dt, device="cpu")
            dst = _as_uint(host)
            _zero_gaps(dst, covered)
            for g, plan, _ in fills:
                g.fill(dst, 0, plan)
            out[bname] = given if given is not None else host
            continue
        # another device: through one host window at a time, so host memory does not grow with the
        # buffer (an engine's fp32 state can be tens of GB per rank)
        def window(lo: int, hi: int, host: torch.Tensor, covered=covered, fills=fills) -> None:
            dst = _as_uint(host)
            _zero_gaps(dst, np.clip(covered, lo, hi) - lo)
            for g, plan, ends in fills:
                g.fill(dst, lo, plan_window(plan, ends, lo, hi))

        rd.fill_through_host(given, max(1, rd.HOST_STAGING_BYTES // dt.itemsize), window)
        out[bname] = given
    return out


def _source_slots(ck: Checkpoint, target_layout: CheckpointLayout, bname: str) -> tuple[np.ndarray, np.ndarray]:
    """(source buffer, source slot) of every tensor of target buffer `bname`, checked to have the
    same shape and dtype in the checkpoint."""
    bi = target_layout.buffer_index(bname)
    spec = target_layout.buffers[bi]
    lay = target_layout.layout_of(bi)
    src_of = np.full(len(spec.tensors), -1, dtype=np.int64)
    slot_of = np.full(len(spec.tensors), -1, dtype=np.int64)
    for s, tname in enumerate(spec.tensors):
        try:
            sb, ss = ck.layout.locate(tname)
        except KeyError:
            raise UnknownNameError(f"tensor '{tname}' of buffer '{bname}' is not in checkpoint {ck.url}") from None
        src_spec = ck.layout.buffers[sb]
        src_shape = ck.layout.layout_of(sb).shapes[ss]
        if src_shape != lay.shapes[s]:
            raise LayoutError(f"tensor '{tname}': checkpoint shape {src_shape}, target shape {lay.shapes[s]}")
        if src_spec.dtype != spec.dtype:
            raise LayoutError(f"tensor '{tname}': checkpoint dtype {src_spec.dtype}, target buffer '{bname}' "
                              f"is {spec.dtype}; load never casts")
        src_of[s], slot_of[s] = sb, ss
    return src_of, slot_of


def _zero_gaps(dst: np.ndarray, covered: np.ndarray) -> None:
    """Zero every element of `dst` outside the sorted, disjoint `[start, stop)` rows of `covered`."""
    pos = 0
    for a, b in covered.tolist():
        if a > pos:
            dst[pos:a] = 0
        pos = max(pos, b)
    if pos < len(dst):
        dst[pos:] = 0


def _check_into(rank: int, bname: str, given: object, target_layout: CheckpointLayout) -> None:
    """`into[bname]` must be memory that rank `rank`'s buffer `bname` can be loaded into as is."""
    bi = target_layout.buffer_index(bname)
    n = int(target_layout.rank_sizes(bi)[rank])
    dt = torch_dtype(target_layout.buffers[bi].dtype)
    where = f"rank {rank}: buffer '{bname}'"
    if not isinstance(given, torch.Tensor):
        raise TypeError(f"{where} is of type {type(given).__name__}, not a torch.Tensor (torch.from_numpy shares a numpy "
                        "array's memory)")
    if given.dtype != dt or given.numel() != n:
        raise LayoutError(f"{where} must be {n} elements of {dt}, got {given.numel()} of {given.dtype}")
    if not given.is_contiguous():
        raise LayoutError(f"{where} must be contiguous")
    if given.is_conj() or given.is_neg():
        raise LayoutError(f"{where} is a lazily conjugated or negated view, whose memory does not hold its values; "
                          "load into a tensor that does (t.resolve_conj())")
    if given.device.type == "meta":
        raise LayoutError(f"{where} is on the meta device and has no memory to load into; materialize it first "
                          "(e.g. torch.empty_like(t, device=...))")
