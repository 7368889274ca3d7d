"""One process's share of a reshard: the destination ranks it was given, each assembled from the
source's copy runs and streamed to DST. The in-process job (`offline.reshard`), its worker processes
(`workers`) and every torchrun process (`distributed`) run this same step, so it sits below all three.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from ragckpt.checkpoint.partial import PartialBlocks
from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.checkpoint.reader import open as open_checkpoint
from ragckpt.checkpoint.writer import ChunkSource, write_streaming
from ragckpt.errors import (
    DestinationExistsError,
    FormatError,
    RagckptError,
)
from ragckpt.format.dtypes import itemsize
from ragckpt.format.intervals import CopyPlan
from ragckpt.format.layout import BufferLayout, Segments
from ragckpt.planner.state import CheckpointLayout
from ragckpt.reshard import gather
from ragckpt.reshard.gather import UINT_OF_SIZE, BlockMemo, Gatherer, GatherStats, plan_window
from ragckpt.reshard.plan import DestSegments, SourceIndex
from ragckpt.storage.direct import ThreadBuffers

MiB = 1 << 20
DEFAULT_WINDOW = 512 * MiB
# per-thread memory budget in destination chunks: the chunk, a fetch batch of up to two chunks of
# widened source ranges, a transient join of a range that spans two source objects, and a chunk of
# source blocks kept for the next chunk (gather.BlockMemo)
CHUNKS_PER_THREAD = 5
#: kept source blocks per thread. A row source of S ranks needs S blocks kept between a destination
#: rank's chunks (each chunk takes a piece of every source rank's block) where its ranges are read
#: whole (object stores; local files read them exactly, gather.EXACT_READS). Lookups grow with the blocks
#: held, so a window with room for more still stops here.
MAX_MEMO_SLOTS = 4096
#: local sources: threads share a destination rank's chunks when its copy runs average this long
#: (a row 4 -> 2 reshard's 3 MiB runs: 15-25% faster shared; a 2048 -> 1 row reshard's 1.5 KiB
#: runs: 1.72-1.83 s shared against 1.46-1.53 s)
SHARE_MIN_RUN_BYTES = 256 << 10
# testing knob: seconds to sleep after each destination chunk (used to kill a worker mid-run)
DELAY_ENV = "RAGCKPT_RESHARD_CHUNK_DELAY_S"


class ReshardError(RagckptError):
    """A reshard worker failed or died; the destination was left uncommitted."""


@dataclass(frozen=True)
class ReshardJob:
    """Everything a worker needs, picklable (sent to spawned processes)."""

    src: str
    dst: str
    storage_options: dict
    threads: int
    chunk_bytes: int  # destination chunk = one object at most
    budget_bytes: int  # widened source bytes per read_rank_ranges call, also the source cell size
    dst_identity: tuple[int, int] | None = None  # the destination directory prepare wrote (Store.pin_root)
    window_bytes: int = DEFAULT_WINDOW  # this process's share of --window; what chunks leave is for BlockMemo



def memo_slots(window: int, processes: int, threads: int, chunk: int, block_bytes: int) -> int:
    """How many source blocks each thread keeps for its next chunk: what is left of its share of the
    window after the chunk and the reads (four chunks), at least one block and at most
    `MAX_MEMO_SLOTS`. A row source needs several (8 -> 3 ranks with 1 MiB chunks read 4.0x its data
    keeping none, 3.0x keeping one block, 1.3x keeping four); a ragged one needs one (1.9x -> 1.0x)."""
    spare = window // max(1, processes) // max(1, threads) - (CHUNKS_PER_THREAD - 1) * chunk
    return max(1, min(MAX_MEMO_SLOTS, spare // block_bytes))


#: copy runs a plan held for a block of destination ranks, or for one rank, may have (five int64
#: each: 5 MiB). A rank with more (a row source of 4,096 ranks going to 3: 680,000 runs per rank and
#: buffer) is planned a destination chunk at a time (`RankPlan.window`) instead of whole.
PLAN_MAX_RUNS = 1 << 17


class RankPlan:
    """The copy runs of one destination rank's buffer, handed out a window of destination elements at
    a time: from the whole rank's plan where that is small, else joined for each window."""

    def __init__(self, plan: CopyPlan | None = None, *, segs: Segments | None = None,
                 index: SourceIndex | None = None, runs: int = 0):
        self.plan, self.segs, self.index = plan, segs, index
        if plan is not None:
            self.ends = plan.dst_offset + plan.length
            self.runs, self.total = len(plan), plan.total
        else:
            assert segs is not None and index is not None
            self.ends = segs.offset + segs.length
            self.runs, self.total = runs, int(segs.length.sum())

    def window(self, lo: int, hi: int) -> CopyPlan:
        if self.plan is not None:
            return plan_window(self.plan, self.ends, lo, hi)
        segs = self.segs
        k0 = int(np.searchsorted(self.ends, lo, side="right"))
        k1 = int(np.searchsorted(segs.offset, hi, side="left"))
        part = segs.select(slice(k0, k1))
        if k1 > k0:
            a = np.maximum(part.offset, lo)
            b = np.minimum(part.offset + part.length, hi)
            part = Segments(part.slot, part.flat_start + (a - part.offset), b - a, part.rank, a)
        return self.index.join(part)


class _PlanCache:
    """Per-process LRU of copy plans for blocks of consecutive destination ranks, keyed by
    (destination layout, block). One vectorised join serves a whole block (per-rank joins would pay
    numpy call overhead thousands of times), and buffers that share a layout (parameters and their
    Adam moments) share plans. Memory is bounded whatever the layouts: a block whose join would make
    more than `PLAN_MAX_RUNS` runs keeps only its destination segments, and each of its ranks is
    planned when asked for (whole, or a window at a time: `RankPlan`)."""

    def __init__(self, size: int, block: int = 64):
        self.size = size
        self.block = block
        self.items: OrderedDict[tuple[int, int], Future[tuple]] = OrderedDict()
        self.dests: dict[int, DestSegments] = {}
        self.lock = threading.Lock()

    def get(self, li_dst: int, rank: int, index: SourceIndex, dst: BufferLayout) -> RankPlan:
        key = (li_dst, rank // self.block)
        with self.lock:
            fut = self.items.get(key)
            mine = fut is None
            if mine:
                # the first thread to miss computes the join; the others wait for it rather than
                # each holding a copy of the same plan
                fut = self.items[key] = Future()
                while len(self.items) > self.size:
                    self.items.popitem(last=False)
            else:
                self.items.move_to_end(key)
            dests = self.dests.setdefault(li_dst, DestSegments(dst, self.block))
        if mine:
            try:
                r0 = key[1] * self.block
                r1 = min(dst.world_size, r0 + self.block)
                segs = dests.ranks(r0, r1)
                count = index.count(segs)
                if int(count.sum()) <= PLAN_MAX_RUNS:
                    fut.set_result(("plan", index.join(segs)))
                else:
                    segs = segs.select(segs.length > 0)
                    fut.set_result(("segments", segs, np.cumsum(count)))
            except BaseException as e:
                with self.lock:
                    if self.items.get(key) is fut:
                        del self.items[key]
                fut.set_exception(e)
                raise
        got = fut.result()
        if got[0] == "plan":
            plan = got[1]
            lo, hi = np.searchsorted(plan.dst_rank, [rank, rank + 1])
            return RankPlan(plan.select(slice(int(lo), int(hi))))
        segs, cum = got[1], got[2]
        lo, hi = (int(x) for x in np.searchsorted(segs.rank, [rank, rank + 1]))
        runs = int(cum[hi - 1] - (cum[lo - 1] if lo else 0)) if hi > lo else 0
        mine_segs = segs.select(slice(lo, hi))
        if runs <= PLAN_MAX_RUNS:
            return RankPlan(index.join(mine_segs))
        return RankPlan(segs=mine_segs, index=index, runs=runs)


def source_buffer_map(src: CheckpointLayout, dst: CheckpointLayout) -> list[int]:
    """Source buffer index of every destination buffer; both must hold the same tensors slot for slot."""
    out = []
    for b in dst.buffers:
        try:
            si = src.buffer_index(b.name)
        except KeyError:
            raise FormatError(f"destination buffer '{b.name}' is not in the source checkpoint") from None
        s = src.buffers[si]
        if s.tensors != b.tensors or s.dtype != b.dtype or src.layout_of(si).shapes != dst.layout_of(
                dst.buffer_index(b.name)).shapes:
            raise FormatError(f"buffer '{b.name}' differs between source and destination metadata; "
                              "the destination was planned from another checkpoint")
        out.append(si)
    return out


def write_share(job: ReshardJob, ranks: Sequence[int], progress: Callable[[int], None] | None = None, *,
                checkpoint: Checkpoint | None = None) -> tuple[dict[int, dict], dict]:
    """Write destination ranks `ranks` (this process's share). Returns the rank manifests and read
    counters. Never writes global metadata and never commits. `checkpoint` is SRC when this
    process already has it open."""
    ck = checkpoint if checkpoint is not None else open_checkpoint(job.src, storage_options=job.storage_options)
    dst = Checkpoint(job.dst, storage_options=job.storage_options, allow_uncommitted=True)
    if dst.committed:
        raise DestinationExistsError(f"{dst.url} was committed while this reshard was running")
    dlay = dst.layout
    smap = source_buffer_map(ck.layout, dlay)
    stats = GatherStats()
    indexes: dict[int, SourceIndex] = {}
    for si in smap:
        li = ck.layout.buffers[si].layout
        indexes.setdefault(li, SourceIndex(ck.layout.layouts[li]))
    plans = _PlanCache(2 * len(dlay.layouts) + 2)

    def mean_run_bytes() -> float:
        runs = nbytes = 0
        for bi, spec in enumerate(dlay.buffers):
            li_src = ck.layout.buffers[smap[bi]].layout
            for r in ranks:
                plan = plans.get(spec.layout, r, indexes[li_src], dlay.layouts[spec.layout])
                runs += plan.runs
                nbytes += plan.total * itemsize(spec.dtype)
        return nbytes / max(runs, 1)

    # with fewer destination ranks than threads, threads share a rank's chunks where a chunk waits on
    # storage: always on object stores, and on local disks where the copy runs are long (short runs
    # are interpreter work that more threads only contend for; docs/RESHARD.md has both measurements)
    few = len(ranks) < job.threads
    share = few and (not ck.store.zero_copy_reads or mean_run_bytes() >= SHARE_MIN_RUN_BYTES)
    # source blocks a fill read whole but used in part are kept for the thread's next fill only where
    # ranges are read whole (object stores): local files read them exactly, so there is nothing to keep
    memo = None
    if not (ck.store.zero_copy_reads and gather.EXACT_READS):
        # the window the chunks leave goes to the threads that will be busy, in blocks as long as the
        # source's blocks really are (rank buffers shorter than a block are one short block)
        busy = min(job.threads, len(ranks)) if few and not share else job.threads
        block = int(ck.block_bytes)
        longest_rank = max((int(ck.layout.rank_sizes(si).max(initial=0)) * itemsize(ck.layout.buffers[si].dtype)
                            for si in smap), default=block)
        slot = max(1, min(block, longest_rank))
        memo = BlockMemo(memo_slots(job.window_bytes, 1, busy, job.chunk_bytes, slot), block, slot_bytes=slot)
    # short ranges are read exactly, their blocks verified from the pieces the fills read; what no
    # fill of this process read is read at the end (gather.PartialBlocks), before anything commits
    partial = PartialBlocks(ck)
    gatherers = [Gatherer(ck, si, budget_bytes=job.budget_bytes, cell_bytes=job.budget_bytes, stats=stats, memo=memo,
                          partial=partial) for si in smap]
    # one destination chunk per writer thread, page-aligned: a local destination writes it with no
    # bounce copy (storage.direct)
    scratch = ThreadBuffers(job.chunk_bytes)
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)

    def fill_for(bi: int, rank: int) -> ChunkSource:
        si = smap[bi]
        li_src = ck.layout.buffers[si].layout
        li_dst = dlay.buffers[bi].layout
        plan = plans.get(li_dst, rank, indexes[li_src], dlay.layouts[li_dst])
        g = gatherers[bi]
        isz = g.isz
        n = int(dlay.rank_sizes(bi)[rank])

        def fill(lo: int, hi: int) -> memoryview:
            raw = scratch.take((hi - lo) * isz)
            out = raw.view(UINT_OF_SIZE[isz])
            part = plan.window(lo, hi)
            if int(part.length.sum()) != hi - lo:
                out[:] = 0  # padding between tensors is stored as zeros
            g.fill(out, lo, part, reuse=lo > 0 or hi < n)  # chunks of one rank share their edge blocks
            if delay:
                time.sleep(delay)
            return memoryview(raw)

        return fill

    docs = write_streaming(job.dst, dlay, fill_for, storage_options=job.storage_options,
                           block_bytes=int(dst.block_bytes), max_chunk_bytes=int(dst.max_chunk_bytes),
                           workers=job.threads, ranks=list(ranks), progress=progress, do_commit=False,
                           write_metadata=False, share_chunks=share,
                           extra_for=ck.extra_bytes if ck.world_size == dlay.world_size else None,
                           root_identity=job.dst_identity)
    rest = partial.complete()
    stats.add(rest, rest, 0, calls=0)
    return docs, stats.as_dict()


def peak_rss_self() -> int:
    """Peak resident set size of this process in bytes. On Linux this is VmHWM of the current
    address space: `ru_maxrss` would also count whatever the process that forked us had resident
    before our exec (the kernel carries it over), which is how a test harness holding a big state
    makes a small child look big."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
