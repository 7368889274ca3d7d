"""Filling destination memory from a source checkpoint: the inner loop of every reshard.

Given copy runs `(src_rank, src_offset, dst_offset, length)` for one window of destination memory,
`Gatherer.fill` turns them into as few source byte ranges as possible and reads them with the
checkpoint's verified range-read primitive (`Checkpoint.read_rank_ranges`: widened to checksum
blocks, batched, concurrent on object stores), then scatters the runs into place.

Memory stays bounded whatever the layouts do:

* runs are first cut at a grid of `cell_bytes` in each source rank's buffer, so a merged range
  (widened to whole checksum blocks) never exceeds one cell;
* runs are grouped per source rank and merged while the next run starts inside, or right after,
  the checksum block where the previous one ends: merging never adds a block the reader would not
  have fetched anyway, so each source block is read at most once per window;
* merged ranges are fetched in batches cut where a range starts past a multiple of `budget_bytes`
  (normally one batch, i.e. one `read_rank_ranges` call per destination chunk), so a batch holds at
  most `budget_bytes` plus one merged range (itself at most one cell); a batch of many small ranges
  is joined into one staging copy before the scatter, so a fill holds at most about four times
  `budget_bytes` (12 MiB measured at the 4 MiB local default);
* with a `PartialBlocks`, short ranges are read exactly, without widening, and the blocks they cut
  are verified once their pieces cover them (`_read_exact`): where many fills each need a slice of
  the same blocks (many small source ranks into few), each byte is read once instead of each block
  once per fill;
* with a `BlockMemo`, the blocks a fill fetched whole but used only in part stay with the thread for
  its next fill (the next destination chunk), a fixed number of them: the offline resharder counts
  them in its window.

Bytes are moved as same-width unsigned integers, so every dtype (bf16, fp8, bool, NaN payloads)
is copied bit-exactly.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ragckpt.checkpoint.partial import PartialBlocks
from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.errors import LayoutError
from ragckpt.format.dtypes import itemsize
from ragckpt.format.intervals import CopyPlan

UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.complex128}  # copies keep every bit
_LOOP_MAX_RUNS = 32
_LOOP_MIN_MEAN = 2048
_INDEX_BATCH = 1 << 18  # elements per fancy-index batch: 4 MiB of int64 indices on both sides
_CONCAT_MIN_GROUPS = 16
_IN_PLACE_MIN_FETCHES = 4  # a run is read in place from this many fetch batches' worth of bytes up
#: with a `PartialBlocks`, a range that widening to whole blocks would add bytes to is read exactly
#: (`Gatherer._read_exact`), and its partial blocks are verified from their pieces. Off, every range
#: is widened and the blocks a fill used in part are what a `BlockMemo` can keep for the next one
#: (256 row ranks of 4 MiB into 8 ragged read 7.3x their bytes so, 1.0x exact; tests switch it off
#: to measure that)
EXACT_READS = True
#: object stores read a range exactly only where it is one stretch and its widened span is under
#: EXACT_MAX_SPAN (a short block, one GET either way): a longer range's exact read is up to three
#: GETs (the partial blocks at its ends, the whole blocks between) where a widened one is one, and
#: ranges read exactly beside ones read whole leave blocks that must be read again to be verified
#: (a ragged 4 -> 1 reshard from S3 read 1.39x its bytes taking those with a span of twice their
#: data too, 1.26x without)
EXACT_MAX_SPAN = 1 << 20
#: runs this long on average are read straight into place by `read_scatter` (local files); shorter
#: ones cost more in per-view Python work than the staging copy they save
_SCATTER_MIN_RUN_BYTES = 64 << 10


@dataclass
class GatherStats:
    """Counters shared by the threads of one process (updated under a lock)."""

    bytes_read: int = 0  # bytes fetched from the source, checksum-block widening included
    bytes_requested: int = 0  # bytes of the merged ranges asked for
    requests: int = 0  # merged ranges
    read_calls: int = 0  # read_rank_ranges and read_blocks_into calls
    bytes_reused: int = 0  # bytes taken from blocks an earlier fill fetched (BlockMemo), not read again
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, read: int, requested: int, requests: int, calls: int = 1) -> None:
        with self.lock:
            self.bytes_read += read
            self.bytes_requested += requested
            self.requests += requests
            self.read_calls += calls

    def reused(self, nbytes: int) -> None:
        with self.lock:
            self.bytes_reused += nbytes

    def as_dict(self) -> dict:
        return {"bytes_read": self.bytes_read, "bytes_requested": self.bytes_requested,
                "read_requests": self.requests, "read_calls": self.read_calls, "bytes_reused": self.bytes_reused}


class BlockMemo:
    """The last few source checksum blocks each thread fetched but used only in part, so the next
    fill can take their bytes instead of fetching (and verifying) them again.

    An offline reshard fills a destination rank chunk after chunk in one thread; unless the layouts
    happen to align, the source block where one chunk's data ends is where the next chunk's begins,
    and with small chunks (a small --window) re-fetching it was most of the I/O: 1 MiB chunks read
    1.9x the data of a ragged checkpoint and 4x of a row one. The blocks were verified when fetched
    and a committed source never changes, so serving them again is exact. Each thread keeps its
    blocks in one page-aligned mapping of `slots` blocks (least recently used goes first), so memory
    is fixed and nothing churns through malloc arenas."""

    def __init__(self, slots: int, block_bytes: int, *, slot_bytes: int | None = None):
        self.slots = max(0, int(slots))
        self.block = int(block_bytes)
        # room per kept block: a source whose rank buffers are shorter than a block has only short
        # blocks, and thousands of them fit where a few whole blocks would
        self.slot_bytes = self.block if slot_bytes is None else max(1, min(int(slot_bytes), self.block))
        self._local = threading.local()

    def _state(self) -> tuple[np.ndarray, dict, list[int]]:
        st = getattr(self._local, "state", None)
        if st is None:
            store = np.frombuffer(mmap.mmap(-1, max(1, self.slots * self.slot_bytes), flags=mmap.MAP_PRIVATE),
                                  dtype=np.uint8)
            # key -> (slot, nbytes), dict order = recency; and the slots not in use
            st = self._local.state = (store, {}, list(range(self.slots - 1, -1, -1)))
        return st

    def held(self, buffer: int) -> list[tuple[int, int]]:
        """(rank, block index) of the blocks this thread holds for source buffer `buffer`, least
        recently used first."""
        if self.slots == 0 or getattr(self._local, "state", None) is None:
            return []
        return [(r, k) for (b, r, k) in self._local.state[1] if b == buffer]

    def get(self, buffer: int, rank: int, block: int) -> np.ndarray:
        store, index, _ = self._state()
        slot, n = index.pop((buffer, rank, block))
        index[(buffer, rank, block)] = (slot, n)  # most recent now
        return store[slot * self.slot_bytes : slot * self.slot_bytes + n]

    def put(self, buffer: int, rank: int, block: int, data) -> None:
        """Keep a copy of `data` (one block, or the pieces that make it up in order); a block longer
        than a slot is not kept (it is fetched again if needed)."""
        if self.slots == 0:
            return
        pieces = data if isinstance(data, list) else [data]
        if sum(len(p) for p in pieces) > self.slot_bytes:
            return
        store, index, free = self._state()
        key = (buffer, rank, block)
        if key in index:
            slot = index.pop(key)[0]
        elif free:
            slot = free.pop()
        else:
            slot = index.pop(next(iter(index)))[0]  # the least recently used
        pos = slot * self.slot_bytes
        for piece in pieces:
            n = len(piece)
            store[pos : pos + n] = np.frombuffer(piece, dtype=np.uint8)
            pos += n
        index[key] = (slot, pos - slot * self.slot_bytes)


def copy_runs_np(dst: np.ndarray, dst_starts: np.ndarray, src: np.ndarray, src_starts: np.ndarray,
                 lengths: np.ndarray) -> None:
    """`dst[d:d+n] = src[s:s+n]` for every run; a slice loop for few or long runs, index gathers in
    bounded batches for many short ones (so the index arrays never outgrow a few MiB)."""
    n = len(lengths)
    if n == 0:
        return
    if n <= _LOOP_MAX_RUNS or lengths.mean() >= _LOOP_MIN_MEAN:
        for a, b, m in zip(dst_starts.tolist(), src_starts.tolist(), lengths.tolist(), strict=True):
            dst[a : a + m] = src[b : b + m]
        return
    ends = np.cumsum(lengths)
    i = 0
    while i < n:
        base = int(ends[i] - lengths[i])
        j = max(i + 1, int(np.searchsorted(ends, base + _INDEX_BATCH, side="right")))
        lens = lengths[i:j]
        total = int(lens.sum())
        rel = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
        dst[np.repeat(dst_starts[i:j], lens) + rel] = src[np.repeat(src_starts[i:j], lens) + rel]
        i = j


def split_at_grid(plan: CopyPlan, cell: int) -> CopyPlan:
    """Cut runs where they cross a multiple of `cell` elements of their source rank's buffer."""
    if len(plan) == 0:
        return plan
    first = plan.src_offset // cell
    last = (plan.src_offset + plan.length - 1) // cell
    pieces = last - first + 1
    if not np.any(pieces > 1):
        return plan
    rep = np.repeat(np.arange(len(plan), dtype=np.int64), pieces)
    k = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    cell_idx = first[rep] + k
    s0 = plan.src_offset[rep]
    a = np.maximum(s0, cell_idx * cell)
    b = np.minimum(s0 + plan.length[rep], (cell_idx + 1) * cell)
    return CopyPlan(plan.src_rank[rep], a, plan.dst_rank[rep], plan.dst_offset[rep] + (a - s0), b - a)


def plan_window(plan: CopyPlan, ends: np.ndarray, lo: int, hi: int) -> CopyPlan:
    """The runs of one destination rank's `plan` (sorted by destination offset; `ends` their end
    offsets) that fall in destination elements `[lo, hi)`, cut to that window: a rank buffer filled
    a window at a time."""
    k0 = int(np.searchsorted(ends, lo, side="right"))
    k1 = int(np.searchsorted(plan.dst_offset, hi, side="left"))
    part = plan.select(slice(k0, k1))
    if k1 > k0 and (int(part.dst_offset[0]) < lo or int(ends[k1 - 1]) > hi):
        a = np.maximum(part.dst_offset, lo)
        b = np.minimum(part.dst_offset + part.length, hi)
        part = CopyPlan(part.src_rank, part.src_offset + (a - part.dst_offset), part.dst_rank, a, b - a)
    return part


class Gatherer:
    """Reads runs of one source buffer into destination memory (see module docstring)."""

    def __init__(self, ck: Checkpoint, buffer: int, *, budget_bytes: int, cell_bytes: int | None = None,
                 stats: GatherStats | None = None, memo: BlockMemo | None = None,
                 partial: PartialBlocks | None = None):
        self.ck = ck
        self.buffer = buffer
        self.spec = ck.layout.buffers[buffer]
        self.isz = itemsize(self.spec.dtype)
        self.np_dtype = UINT_OF_SIZE[self.isz]
        self.block = int(ck.block_bytes)
        cell_bytes = budget_bytes if cell_bytes is None else cell_bytes
        # whole blocks and whole elements (a block may be smaller than an element, or not divide it:
        # an 8-byte block of complex128 once made a zero-element cell and divided by zero)
        unit = math.lcm(self.block, self.isz)
        cell_bytes = max(unit, (cell_bytes // unit) * unit)
        self.cell = cell_bytes // self.isz  # elements; a multiple of whole blocks
        self.budget = max(int(budget_bytes), cell_bytes)
        self.rank_nbytes = ck.layout.rank_sizes(buffer) * self.isz
        self.stats = stats if stats is not None else GatherStats()
        self.in_place = ck.store.zero_copy_reads
        # blocks are kept whole, so they must hold whole elements (they do unless block_bytes is odd)
        if memo is not None and memo.block != self.block:
            raise ValueError(f"BlockMemo of {memo.block}-byte blocks given for a checkpoint of {self.block}-byte blocks")
        self.memo = memo if memo is not None and memo.slots and self.block % self.isz == 0 else None
        # with `partial`, short ranges are read exactly and their blocks verified from the pieces
        # (`_read_exact`); the caller must call `partial.complete()` before trusting what was read
        self.partial = partial

    def _take_from_memo(self, out: np.ndarray, base: int, plan: CopyPlan) -> CopyPlan:
        """Copy the parts of runs that lie in blocks this thread kept from an earlier fill; returns
        the rest. A run touching a kept block is cut at that block's edges only, so the rest of it
        stays one run (cut at every block edge, a 16 MiB run of 4 KiB blocks became 4,096 pieces
        too short for the in-place read: 4x slower to reuse 12 KiB). Vectorised over runs and kept
        blocks: a reshard of thousands of small ranks makes thousands of fills."""
        held = self.memo.held(self.buffer)
        if not held:
            return plan
        lo, hi = int(plan.src_rank.min()), int(plan.src_rank.max())
        if not any(lo <= r <= hi for r, _ in held):  # the common miss, for a few microseconds
            return plan
        be = self.block // self.isz  # elements per block
        # (rank, element offset) -> one ordered code, rank * span + offset
        span = int(self.rank_nbytes.max()) // self.isz + be + 1
        kept = np.sort(np.array([r * span + k * be for r, k in held], dtype=np.int64))  # where each kept block starts
        cuts = np.union1d(kept, kept + be)
        a = plan.src_rank * span + plan.src_offset
        b = a + plan.length
        i0 = np.searchsorted(cuts, a, side="right")
        i1 = np.searchsorted(cuts, b, side="left")
        j = np.searchsorted(kept, b, side="left") - 1  # a run touches the last kept block starting before its end, or none
        touch = (j >= 0) & (kept[np.maximum(j, 0)] + be > a)
        if not touch.any():
            return plan
        sub = plan.select(touch)
        a, b, i0, i1 = a[touch], b[touch], i0[touch], i1[touch]
        cnt = i1 - i0 + 1  # pieces: the cuts strictly inside each run, plus one
        rep = np.repeat(np.arange(len(sub), dtype=np.int64), cnt)
        k = np.arange(int(cnt.sum()), dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        last = len(cuts) - 1
        p_lo = np.where(k == 0, a[rep], cuts[np.minimum(i0[rep] + k - 1, last)])
        p_hi = np.where(k == cnt[rep] - 1, b[rep], cuts[np.minimum(i0[rep] + k, last)])
        rank = sub.src_rank[rep]
        pieces = CopyPlan(rank, p_lo - rank * span, sub.dst_rank[rep], sub.dst_offset[rep] + (p_lo - a[rep]),
                          p_hi - p_lo)
        # a piece lies in one kept block or in none (kept blocks' edges are cuts)
        code = rank * span + pieces.src_offset // be * be
        hit = np.isin(code, kept)
        used = set(code[hit].tolist())
        for r, kk in held:  # least recent first, as `get` makes each the most recent: their order stays
            c = r * span + kk * be
            if c not in used:
                continue
            sel = code == c
            data = self.memo.get(self.buffer, r, kk).view(self.np_dtype)
            copy_runs_np(out, pieces.dst_offset[sel] - base, data, pieces.src_offset[sel] - kk * be,
                         pieces.length[sel])
        self.stats.reused(int(pieces.length[hit].sum()) * self.isz)
        rest = [plan.select(~touch), pieces.select(~hit)]
        return CopyPlan(*(np.concatenate([getattr(x, f) for x in rest])
                          for f in ("src_rank", "src_offset", "dst_rank", "dst_offset", "length")))

    def _tails_to_keep(self, g_rank: np.ndarray, g_hi: np.ndarray, w_hi: np.ndarray, last_dst: np.ndarray) -> np.ndarray:
        """Start (bytes) of the trailing block to keep for each merged range, -1 for none: of each
        source rank's last range in this fill, the ones whose block goes on past the data (where
        the next chunk's data of that rank begins), nearest the end of the destination first, as
        many as the memo holds."""
        tail = np.full(len(g_rank), -1, dtype=np.int64)
        last = np.ones(len(g_rank), dtype=bool)
        last[:-1] = g_rank[1:] != g_rank[:-1]
        cand = np.nonzero(last & (g_hi * self.isz < w_hi))[0]
        if len(cand):
            cand = cand[np.argsort(-last_dst[cand], kind="stable")][: self.memo.slots]
            tail[cand] = (w_hi[cand] - 1) // self.block * self.block
        return tail

    def _read_aligned_runs(self, out: np.ndarray, base: int, plan: CopyPlan) -> CopyPlan:
        """Read runs that start and end on checksum-block boundaries of their source buffer (plans
        arrive coalesced, so on an unchanged layout a whole rank buffer is one run) straight into
        `out`, verified in place: no staging buffer, no scatter copy, one open file per run. Returns
        the other runs. Only long runs qualify: short ones are better merged with their neighbours
        into one request (cold loads were 10-25% slower with a request per 1-3 MiB run, and the same
        when unaligned runs were split around their partial end blocks).

        On object stores the whole blocks inside every run of at least `budget` bytes go this way,
        all in one `read_scatter_many`, whose GETs stream straight into `out` and are in flight
        together; the partial blocks at a run's ends stay in the returned plan. Batch after batch
        through staging buffers, a load kept one or two GETs in flight (60 MB/s per process against
        a server with S3's latency and per-connection rate)."""
        isz, B = self.isz, self.block
        remote = self.ck.store.concurrent_reads
        if not (self.in_place or remote) or (remote and B % isz):  # whole blocks would cut elements
            return plan
        least = self.budget if remote else _IN_PLACE_MIN_FETCHES * self.budget
        if plan.total * isz < least:  # nothing can qualify (the many small fills of a big world)
            return plan
        s = plan.src_offset * isz
        e = s + plan.length * isz
        ends_buffer = e == self.rank_nbytes[plan.src_rank]
        if remote:
            lo = -(-s // B) * B
            hi = np.where(ends_buffer, e, e // B * B)
        else:
            lo, hi = s, np.where((s % B == 0) & ((e % B == 0) | ends_buffer), e, s)
        take = hi - lo >= least
        if not take.any():
            return plan
        raw = memoryview(out).cast("B")
        idx = np.nonzero(take)[0]
        d = (plan.dst_offset[idx] - base) * isz + (lo[idx] - s[idx])
        reqs = [(r, a, raw[p : p + n]) for r, a, p, n in
                zip(plan.src_rank[idx].tolist(), lo[idx].tolist(), d.tolist(), (hi - lo)[idx].tolist(), strict=True)]
        if remote:
            self.ck.read_scatter_many(self.buffer, [(r, a, [v]) for r, a, v in reqs])
        else:
            for r, a, v in reqs:
                self.ck.read_blocks_into(self.buffer, r, a, v)
        moved = int((hi - lo)[idx].sum())
        self.stats.add(moved, moved, len(idx), calls=1 if remote else len(idx))
        if not remote:
            return plan.select(~take)
        # what is left: the runs not taken, and the partial blocks at the ends of those taken
        sub = plan.select(take)
        s0, e0 = sub.src_offset, sub.src_offset + sub.length
        lo_e, hi_e = lo[idx] // isz, hi[idx] // isz
        heads, tails = lo_e > s0, hi_e < e0
        pieces = [plan.select(~take),
                  CopyPlan(sub.src_rank, s0, sub.dst_rank, sub.dst_offset, lo_e - s0).select(heads),
                  CopyPlan(sub.src_rank, hi_e, sub.dst_rank, sub.dst_offset + (hi_e - s0), e0 - hi_e).select(tails)]
        return CopyPlan(*(np.concatenate([getattr(x, f) for x in pieces])
                          for f in ("src_rank", "src_offset", "dst_rank", "dst_offset", "length")))

    def _read_exact(self, out: np.ndarray, runs: tuple[np.ndarray, ...], starts: np.ndarray, stops: np.ndarray,
                    g_rank: np.ndarray, w_lo: np.ndarray, w_hi: np.ndarray) -> np.ndarray:
        """Read the groups whose block-widened range holds bytes this fill does not need exactly:
        each stretch of source-consecutive runs straight into place, with no widening and no bytes
        between runs (other fills' data), the blocks verified from their pieces by `self.partial`.
        Returns which groups were read. Where a source block holds data of several destination chunks
        (many source ranks going to a few), reading the whole block for each chunk would fetch
        12.6x the checkpoint for 2048 -> 8 ragged ranks, 7.3x for 256 ranks of 4 MiB -> 8 ragged.
        Object stores take fewer (`EXACT_MAX_SPAN`)."""
        sr, so, ln, do = runs
        isz = self.isz
        data = np.add.reduceat(ln, starts) * isz
        span = w_hi - w_lo
        ok = span > data
        if not self.in_place:
            ok &= span < EXACT_MAX_SPAN
        if not ok.any():  # most fills of a reshard between similar worlds: nothing more to work out
            return ok
        head = np.ones(len(sr), dtype=bool)
        head[1:] = so[1:] != so[:-1] + ln[:-1]
        head[starts] = True
        ok &= _without_overlap(so, ln, starts)  # PartialBlocks takes each byte once
        if not self.in_place:
            ok &= np.add.reduceat(head, starts) == 1
        if not ok.any():
            return ok
        # runs long enough on average land in place (`_scatter_groups` has the measure); shorter ones
        # are read a stretch at a time into one staging buffer and copied into place together
        count = stops - starts
        staged = ok & ~(self.in_place & (data >= _SCATTER_MIN_RUN_BYTES * count))
        run_staged = np.repeat(staged, count)
        staged_len = np.where(run_staged, ln, 0)
        stage = np.cumsum(staged_len) - staged_len  # elements: each staged run's place in the staging buffer
        buf = self.ck._scratch.take(int(staged_len.sum()) * isz).view(self.np_dtype)
        raw, stage_raw = memoryview(out).cast("B"), memoryview(buf).cast("B")
        first = np.nonzero(head)[0]  # each stretch's first run
        ends = np.append(first[1:], len(sr))
        take = np.repeat(ok, count)[first]
        reqs: list[tuple[int, int, list[memoryview]]] = []
        for r0, r1 in zip(first[take].tolist(), ends[take].tolist(), strict=True):
            if run_staged[r0]:
                p = int(stage[r0]) * isz
                views = [stage_raw[p : p + int(ln[r0:r1].sum()) * isz]]
            else:
                views = [raw[d : d + n] for d, n in zip((do[r0:r1] * isz).tolist(), (ln[r0:r1] * isz).tolist(),
                                                        strict=True)]
            reqs.append((int(sr[r0]), int(so[r0]) * isz, views))
        self.ck.read_pieces(self.buffer, reqs, self.partial)
        idx = np.nonzero(run_staged)[0]
        copy_runs_np(out, do[idx], buf, stage[idx], ln[idx])
        moved = int(data[ok].sum())
        self.stats.add(moved, moved, len(reqs))
        return ok

    def _scatter_groups(self, out: np.ndarray, runs: tuple[np.ndarray, ...], starts: np.ndarray, stops: np.ndarray,
                        g_rank: np.ndarray, w_lo: np.ndarray, w_hi: np.ndarray, tail: np.ndarray | None,
                        todo: np.ndarray) -> np.ndarray:
        """Read merged ranges whose runs are long enough (`_SCATTER_MIN_RUN_BYTES` on average) with
        `read_scatter`: the kernel puts each run's bytes at its destination, and the bytes between
        runs (needed only for the checksum) into a small scratch buffer, so there is no staging
        buffer and no scatter copy. Returns which groups were read. From the page cache a 4 -> 2
        row reshard spent a third of its time in that copy: a tensor's piece from each source rank
        lands interleaved with the other tensors' pieces."""
        sr, so, ln, do = runs
        isz = self.isz
        count = stops - starts
        data = np.add.reduceat(ln, starts) * isz
        # the views must tile the range
        ok = todo & (data >= _SCATTER_MIN_RUN_BYTES * count) & _without_overlap(so, ln, starts)
        raw = memoryview(out).cast("B")
        for gi in np.nonzero(ok)[0].tolist():
            a, b = int(starts[gi]), int(stops[gi])
            lo, hi = int(w_lo[gi]), int(w_hi[gi])
            scratch = memoryview(self.ck._scratch.take(hi - lo - int(data[gi])))  # read_scatter takes none
            views, used, pos = [], 0, lo
            for s, n, d in zip((so[a:b] * isz).tolist(), (ln[a:b] * isz).tolist(), (do[a:b] * isz).tolist(),
                               strict=True):
                if s > pos:
                    views.append(scratch[used : used + s - pos])
                    used += s - pos
                views.append(raw[d : d + n])
                pos = s + n
            if hi > pos:
                views.append(scratch[used : used + hi - pos])
            self.ck.read_scatter(self.buffer, int(g_rank[gi]), lo, views)
            if tail is not None and tail[gi] >= 0:
                self.memo.put(self.buffer, int(g_rank[gi]), int(tail[gi]) // self.block, _last_bytes(views, hi - int(tail[gi])))
        if ok.any():
            asked = (so[stops - 1] + ln[stops - 1] - so[starts]) * isz
            self.stats.add(int((w_hi - w_lo)[ok].sum()), int(asked[ok].sum()), int(ok.sum()), calls=int(ok.sum()))
        return ok

    def fill(self, out: np.ndarray, base: int, plan: CopyPlan, *, reuse: bool = True) -> None:
        """Copy every run of `plan` (destination offsets relative to `base`, all inside `out`) into
        `out`, an unsigned-integer array of this buffer's element width. With a memo, `reuse=False`
        skips looking up and keeping blocks: a destination rank that is one chunk seldom shares a
        block with the thread's neighbouring fills, and a reshard of thousands of such ranks
        (8192 -> 4096) spent more on the lookups than the blocks saved."""
        if len(plan) == 0:
            return
        if out.dtype.itemsize != self.isz:
            raise LayoutError(f"buffer '{self.spec.name}': destination has {out.dtype.itemsize}-byte elements, "
                              f"source {self.isz}-byte")
        plan = self._read_aligned_runs(out, base, plan)
        if len(plan) == 0:
            return
        memo = self.memo is not None and reuse
        if memo:
            plan = self._take_from_memo(out, base, plan)
            if len(plan) == 0:
                return
        p = split_at_grid(plan, self.cell)
        order = np.lexsort((p.src_offset, p.src_rank))
        sr, so, ln = p.src_rank[order], p.src_offset[order], p.length[order]
        do = p.dst_offset[order] - base
        isz, B = self.isz, self.block
        end_b = (so + ln) * isz
        head = np.ones(len(sr), dtype=bool)
        if len(sr) > 1:
            head[1:] = ((sr[1:] != sr[:-1]) | (so[1:] // self.cell != so[:-1] // self.cell)
                        | (so[1:] * isz > -(-end_b[:-1] // B) * B))
        starts = np.nonzero(head)[0]
        stops = np.append(starts[1:], len(sr))
        g_rank = sr[starts]
        g_lo = so[starts]  # elements
        g_hi = so[stops - 1] + ln[stops - 1]
        w_lo = (g_lo * isz // B) * B
        w_hi = np.minimum(-(-(g_hi * isz) // B) * B, self.rank_nbytes[g_rank])
        widened = w_hi - w_lo
        tail = None if not memo else self._tails_to_keep(g_rank, g_hi, w_hi, do[stops - 1] + ln[stops - 1])
        done = np.zeros(len(starts), dtype=bool)
        if self.partial is not None and EXACT_READS:
            done = self._read_exact(out, (sr, so, ln, do), starts, stops, g_rank, w_lo, w_hi)
            if tail is not None:
                tail[done] = -1  # not read whole, so not kept
        if self.in_place:
            done |= self._scatter_groups(out, (sr, so, ln, do), starts, stops, g_rank, w_lo, w_hi, tail, ~done)
        if done.any():
            keep = ~done
            if not keep.any():
                return
            # the staged path below takes a batch's runs as one span `starts[g0]:stops[g1 - 1]`,
            # so the scattered groups' runs go too, not just the groups (else the concatenated
            # scatter of a later batch spans runs of groups already read, and fails)
            counts = (stops - starts)[keep]
            runs_kept = np.repeat(keep, stops - starts)
            sr, so, ln, do = sr[runs_kept], so[runs_kept], ln[runs_kept], do[runs_kept]
            stops = np.cumsum(counts)
            starts = stops - counts
            g_rank, g_lo, g_hi, w_hi, widened = (x[keep] for x in (g_rank, g_lo, g_hi, w_hi, widened))
            tail = None if tail is None else tail[keep]
        # a range whose trailing block is kept asks for that whole block (fetched and verified anyway)
        r_lo, r_hi = g_lo, g_hi  # elements
        if tail is not None and (tail >= 0).any():
            k = tail >= 0
            r_lo = np.where(k, np.minimum(g_lo, tail // isz), g_lo)
            r_hi = np.where(k, w_hi // isz, g_hi)
        cum = np.cumsum(widened)
        batch = (cum - widened) // self.budget
        bounds = np.searchsorted(batch, np.arange(int(batch[-1]) + 2), side="left")
        for bi in range(len(bounds) - 1):
            g0, g1 = int(bounds[bi]), int(bounds[bi + 1])
            if g1 <= g0:
                continue
            reqs = list(zip(g_rank[g0:g1].tolist(), (r_lo[g0:g1] * isz).tolist(), (r_hi[g0:g1] * isz).tolist(),
                            strict=True))
            views = self.ck.read_rank_ranges(self.buffer, reqs)
            self.stats.add(int(widened[g0:g1].sum()), int(((g_hi[g0:g1] - g_lo[g0:g1]) * isz).sum()), g1 - g0)
            if tail is not None:
                for gi in np.nonzero(tail[g0:g1] >= 0)[0].tolist():
                    t = int(tail[g0 + gi])
                    self.memo.put(self.buffer, int(g_rank[g0 + gi]), t // self.block,
                                  views[gi][t - int(r_lo[g0 + gi]) * isz :])
            r0, r1 = int(starts[g0]), int(stops[g1 - 1])
            if g1 - g0 >= _CONCAT_MIN_GROUPS:
                # many small ranges: one staging copy, then one vectorised scatter
                src = np.concatenate([np.frombuffer(v, dtype=self.np_dtype) for v in views])
                glen = r_hi[g0:g1] - r_lo[g0:g1]
                gbase = np.cumsum(glen) - glen
                gid = np.repeat(np.arange(g1 - g0), stops[g0:g1] - starts[g0:g1])
                copy_runs_np(out, do[r0:r1], src, gbase[gid] + so[r0:r1] - r_lo[g0:g1][gid], ln[r0:r1])
                del src
            else:
                for gi, v in zip(range(g0, g1), views, strict=True):
                    a, b = int(starts[gi]), int(stops[gi])
                    src = np.frombuffer(v, dtype=self.np_dtype)
                    copy_runs_np(out, do[a:b], src, so[a:b] - r_lo[gi], ln[a:b])
            del views


def _without_overlap(so: np.ndarray, ln: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per group (runs sorted by source offset, groups starting at `starts`): whether its runs
    follow each other in the source without overlapping. A plan never reads one source element
    twice, so this holds; it is checked where a read relies on it."""
    overlap = np.zeros(len(so), dtype=np.int64)
    overlap[1:] = so[1:] < so[:-1] + ln[:-1]
    overlap[starts] = 0
    return np.add.reduceat(overlap, starts) == 0


def _last_bytes(views: Sequence[memoryview], n: int) -> list[memoryview]:
    """The last `n` bytes of the concatenation of `views`, as slices of them in order."""
    parts = []
    for v in reversed(views):
        if n <= 0:
            break
        piece = v[max(0, len(v) - n) :]
        parts.append(piece)
        n -= len(piece)
    return parts[::-1]
