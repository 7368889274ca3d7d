"""Offline resharding: read a committed checkpoint, write a new committed one for another world size.

Flow (docs/RESHARD.md has the long form):

1. `prepare` (coordinator only): open SRC, check `--from`, build the destination layout
   (`plan.target_layout`), refuse an existing DST unless allowed, write DST's global metadata.
2. `share.write_share` (every worker process, or every torchrun process): re-open SRC, read the destination
   layout back from DST's metadata (so every process, on any machine, works from the same recorded
   layout), and stream its share of destination ranks through `write_streaming`. A destination chunk
   is assembled by `Gatherer.fill` from the copy runs of that rank (`SourceIndex.join`), reading
   each needed source byte range once, checksum-verified (blocks read in pieces by several chunks
   are verified when their pieces cover them, and what no chunk read of them is read at the end
   of the share: `PartialBlocks`). Shares are disjoint sets of whole destination ranks, so no two
   processes ever write one object.
3. `finish` (coordinator only): `commit` checks every rank's manifest and writes the marker last.
   A run that dies before leaves DST without a marker: `ragckpt info` says NOT COMMITTED.

Memory is bounded by the window: each process gets `window / processes`, split over its writer
threads; each thread holds one destination chunk and at most about three chunk-sized source fetches.
"""

from __future__ import annotations

import resource
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np

from ragckpt.args import check_count, check_flag
from ragckpt.checkpoint import manifest as mf
from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.checkpoint.reader import open as open_checkpoint
from ragckpt.checkpoint.writer import commit, write_root_metadata
from ragckpt.cpus import usable_cpus
from ragckpt.errors import (
    DestinationExistsError,
    DestinationReplacedError,
    FormatError,
    IntegrityError,
    LayoutError,
    StorageError,
)
from ragckpt.format.dtypes import itemsize
from ragckpt.planner.planner import GranularitySpec
from ragckpt.planner.state import CheckpointLayout, check_align_padding
from ragckpt.reshard.plan import target_layout
from ragckpt.reshard.share import (
    CHUNKS_PER_THREAD,
    DEFAULT_WINDOW,
    MiB,
    ReshardJob,
    peak_rss_self,
    write_share,
)
from ragckpt.reshard.workers import run_workers
from ragckpt.storage.destination import (
    attach_note,
    check_checkpoint_destination,
    kill_point,
    normalize_url,
    require_separate,
)
from ragckpt.storage.destination import replacing as replacing_destination
from ragckpt.storage.store import Store, open_store

DEFAULT_THREADS = 4
PROVENANCE_KEY = "ragckpt.reshard"
@dataclass
class ReshardStats:
    src: str
    dst: str
    from_world_size: int
    to_world_size: int
    from_layout: str
    to_layout: str
    tensors: int
    bytes_written: int  # destination bytes (padding included)
    data_bytes: int  # tensor bytes
    bytes_read: int  # fetched from SRC, widened to whole checksum blocks
    read_requests: int
    read_calls: int
    seconds: float
    gb_per_s: float  # bytes_written / seconds / 1e9
    peak_rss_bytes: int  # this process
    peak_rss_workers_bytes: int  # largest worker process (0 when in-process; under torchrun, the largest rank)
    processes: int
    threads: int
    window_bytes: int
    chunk_bytes: int
    plan_seconds: float = 0.0
    #: tensor bytes taken from source blocks a thread had fetched for its previous chunk, not read again
    bytes_reused: int = 0
    #: source ranks whose extras (RNG state, ...) were copied to the same rank of DST: all of them at
    #: the same world size, none otherwise (they belong to ranks of the old world; SRC keeps them)
    extras_copied: int = 0
    extras_dropped: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    def notes(self) -> list[str]:
        """What a person running the reshard should know beyond the numbers (the CLI and the
        torchrun module print these under their summary)."""
        out = [f"note: {old} holds what an earlier --overwrite of DST set aside, and was kept: more than one such "
               f"copy is there and none was moved back (`ragckpt recover {self.dst}` says why)"
               for old in self.extra.get("leftover_set_asides", [])]
        if self.extras_copied:
            out.append(f"per-rank extras of {self.extras_copied} rank(s) copied unchanged (same world size)")
        if self.extras_dropped:
            out.append(f"note: per-rank extras (RNG state, ...) of {self.extras_dropped} source rank(s) were not "
                       f"carried over: they belong to ranks of the old {self.from_world_size}-rank world; read them "
                       "from SRC with open_checkpoint(SRC).extra(rank)")
        return out


# -- sizing ----------------------------------------------------------------------------------------------

#: destination objects per worker process when `workers=None`. One process writing thousands of
#: small objects loses about a fifth of its CPU to its threads taking turns at the interpreter lock
#: around every system call; a spawned worker costs about 0.2 s to start (ragckpt imports no torch,
#: see ragckpt.lazy). Measured on the 2-core dev VM, 1 GiB, cold: 8192 -> 4096 ranks (12,288
#: destination objects) 4.1 s with 2 workers against 5.4-5.6 s with 1; 4096 -> 2048 (6,144)
#: 2.65-2.75 s against 3.0-3.4 s; 1024 -> 512 (1,536) and 256 -> 128 the same either way (2.0-2.3 s).
OBJECTS_PER_WORKER = 4096


def auto_workers(world_size: int, buffers: int, window: int, block_bytes: int) -> int:
    """Worker processes for a reshard to `world_size` ranks of `buffers` buffers each, when the caller
    leaves it open: one per OBJECTS_PER_WORKER destination objects (a chunk per buffer and a record
    per rank), at most one per usable CPU and no more than `window` has room for (`sizing`), at
    least one."""
    objects = world_size * (buffers + 1)
    room = window // (CHUNKS_PER_THREAD * _min_chunk(block_bytes))
    return max(1, min(usable_cpus(), room, 1 + objects // OBJECTS_PER_WORKER))


def _min_chunk(block_bytes: int) -> int:
    """The smallest destination chunk: whole blocks, at least 1 MiB."""
    return -(-max(block_bytes, MiB) // block_bytes) * block_bytes


def sizing(window: int, processes: int, threads: int | None, block_bytes: int) -> tuple[int, int]:
    """(threads per process, chunk bytes) so that processes x threads x ~4 chunks fit in `window`."""
    per_proc = window // max(1, processes)
    want = DEFAULT_THREADS if threads is None else threads
    if want <= 0:
        raise LayoutError(f"threads must be positive, got {want}")
    min_chunk = _min_chunk(block_bytes)
    t = max(1, min(want, per_proc // (CHUNKS_PER_THREAD * min_chunk)))
    chunk = (per_proc // (t * CHUNKS_PER_THREAD) // block_bytes) * block_bytes
    if chunk < min_chunk:
        need = processes * CHUNKS_PER_THREAD * min_chunk
        fewer = " or fewer workers (--workers)" if processes > 1 else ""  # a torchrun process sizes for itself
        raise LayoutError(f"memory window of {window} bytes is too small for {processes} process(es): "
                          f"use at least {-(-need // MiB)} MiB (--window){fewer}")
    return t, chunk


def split_ranks(layout: CheckpointLayout, parts: int) -> list[list[int]]:
    """Contiguous shares of destination ranks with about equal bytes each (every rank also counts a
    little for its per-rank metadata objects). Shares may be empty when parts > ranks."""
    W = layout.world_size
    cost = np.full(W, 64 * 1024, dtype=np.int64)
    for bi, b in enumerate(layout.buffers):
        cost += layout.rank_sizes(bi) * itemsize(b.dtype)
    cum = np.cumsum(cost)
    target = cum[-1] * np.arange(1, parts) / parts
    # each cut goes at the rank boundary nearest its target: taking the first boundary at or past it
    # put every cut of equal ranks one rank early, and left process 0 with nothing to do (--to 2 on
    # 2 processes split [], [0, 1])
    i = np.searchsorted(cum, target, side="right")  # ranks [0, i) end at or before the target
    before = np.where(i > 0, cum[np.maximum(i - 1, 0)], 0)
    after = cum[np.minimum(i, W - 1)]
    cuts = np.where((i < W) & (after - target < target - before), i + 1, i)
    bounds = np.concatenate([[0], cuts, [W]])
    bounds = np.maximum.accumulate(np.clip(bounds, 0, W))
    return [list(range(int(bounds[i]), int(bounds[i + 1]))) for i in range(parts)]


# -- coordinator steps -----------------------------------------------------------------------------------

def _provenance(store: Store) -> dict | None:
    """The reshard provenance recorded in a destination's root document, read from that document
    alone (an interrupted run may have left the other metadata torn); None when there is no
    readable root document."""
    try:
        raw = store.read(mf.ROOT_META_KEY)
    except StorageError as e:
        if not store.exists(mf.ROOT_META_KEY):
            return None
        raise e
    try:
        user = mf.manifest_from_root_doc(raw, store.url).get("user") or {}
    except (FormatError, ValueError, AttributeError):
        return None
    prov = user.get(PROVENANCE_KEY) if isinstance(user, dict) else None
    return prov if isinstance(prov, dict) else None


def job_chunk(chunk: int, src: Checkpoint) -> int:
    """The chunk size a job's window allows, capped at what the data can use: a huge --window needs
    no huge buffers."""
    return min(chunk, max(MiB, int(src.max_chunk_bytes)))


@contextmanager
def replacing(src: str, dst: str, *, overwrite: bool, storage_options: dict | None, tag: str,
              source: Checkpoint) -> Iterator[list[str]]:
    """`destination.replacing` for a reshard: the new DST is about the source's size. SRC's objects
    are first checked to exist at their full size, so a source with objects missing or cut short is
    refused before DST is touched (an overwrite that cannot set DST aside would otherwise have
    emptied it, and a new DST would be left holding an unfinished reshard)."""
    require_separate(dst, [src])
    check_source_objects(source)
    with replacing_destination(dst, [src], overwrite=overwrite, storage_options=storage_options, tag=tag,
                               new_bytes=source.layout.total_bytes()) as leftovers:
        yield leftovers


#: what a failed reshard adds to its error once DST holds its uncommitted metadata (without
#: --overwrite: with it, `destination.replacing` says where the old contents are)
LEFT_UNCOMMITTED = "the destination was left uncommitted; re-running the same command replaces it"


def check_source_objects(ck: Checkpoint) -> None:
    """Every chunk object SRC's layout needs is there at its full size (one listing per buffer, no
    data read)."""
    for bi, spec in enumerate(ck.layout.buffers):
        ch = mf.buffer_chunking(ck.layout, bi, ck.max_chunk_bytes, ck.block_bytes)
        listed = ck.store.list_sizes(mf.buffer_key(bi))
        for r, n in enumerate(ck.layout.rank_sizes(bi)):
            for j in range(ch.count(int(n))):
                key = mf.chunk_key(bi, r, j)
                size = listed.get(key)
                if size != ch.chunk_bytes:
                    raise IntegrityError(f"{ck.store.size_problem(key, size, ch.chunk_bytes)} (buffer '{spec.name}', "
                                         f"rank {r}): the source is damaged; nothing was written or overwritten — "
                                         "restore the object or re-save the source")


def check_destination(src_url: str, dst_url: str, to_world: int, kind: str, *,
                      overwrite: bool, storage_options: dict | None) -> None:
    """Refuse a DST that overlaps SRC, or that already holds a checkpoint, unless `overwrite`. An
    uncommitted DST left by an interrupted reshard of the same SRC to the same target is replaced
    without `overwrite`, so re-running the failed command just works."""
    require_separate(dst_url, [src_url])
    store = open_store(dst_url, storage_options)
    if not overwrite and not store.exists(mf.COMMIT_KEY) and store.exists(mf.ROOT_META_KEY):
        prov = _provenance(store) or {}
        same_source = isinstance(prov.get("from"), str) and normalize_url(prov["from"]) == normalize_url(src_url)
        if (same_source and prov.get("to_world_size") == to_world
                and prov.get("layout") == kind):
            check_checkpoint_destination(store, overwrite=True)  # replaced as --overwrite would
            return
        if same_source:
            was = f"{prov.get('to_world_size')} ranks, {prov.get('layout')}"
            raise DestinationExistsError(f"{store.url} holds an interrupted reshard of this source to another target "
                                         f"({was}, not {to_world} ranks, {kind}); pass --overwrite to replace it")
        raise DestinationExistsError(f"{store.url} holds an uncommitted checkpoint that is not an interrupted "
                                     "reshard of this source; pass --overwrite to replace it")
    check_checkpoint_destination(store, overwrite)


def prepare(src: str, dst: str, world_size: int, *, from_world_size: int | None = None, layout: str | None = None,
            granularity: GranularitySpec | None = None, align: int = 1, overwrite: bool = False,
            storage_options: dict | None = None, chunk_bytes: int = mf.DEFAULT_MAX_CHUNK_BYTES,
            checkpoint: Checkpoint | None = None, run_id: str | None = None) -> tuple[Checkpoint, CheckpointLayout]:
    """Coordinator step 1: validate, plan the destination layout, write DST's global metadata.
    `run_id`, recorded in DST's provenance, lets `finish` tell whether DST is still this run's."""
    ck = checkpoint if checkpoint is not None else open_checkpoint(src, storage_options=storage_options)
    if from_world_size is not None and from_world_size != ck.world_size:
        raise LayoutError(f"--from {from_world_size} does not match the source, which was saved by "
                          f"{ck.world_size} ranks ({ck.url})")
    kind = layout or ck.kind
    if granularity is not None and kind != "ragged":
        raise LayoutError(f"--granularity applies to the ragged planner only, and the destination layout is "
                          f"'{kind}'; drop --granularity or pass --layout ragged")
    if align > 1 and kind not in ("ragged", "element"):
        raise LayoutError(f"--align applies to flat layouts (ragged, element) only, and the destination layout "
                          f"is '{kind}'; drop --align or pass --layout ragged or element")
    dst_layout = check_align_padding(target_layout(ck.layout, world_size, layout, granularity, align), align,
                                     option="--align", what="the destination")
    check_destination(src, dst, world_size, dst_layout.kind, overwrite=overwrite,
                      storage_options=storage_options)
    user = dict(ck.user)
    user[PROVENANCE_KEY] = {"from": normalize_url(src).rstrip("/") or "/", "from_world_size": ck.world_size, "from_layout": ck.kind,
                            "to_world_size": dst_layout.world_size, "layout": dst_layout.kind}
    if run_id is not None:
        user[PROVENANCE_KEY]["run_id"] = run_id
    store = open_store(dst, storage_options)
    write_root_metadata(store, dst_layout, block_bytes=ck.block_bytes,
                        max_chunk_bytes=min(ck.max_chunk_bytes, chunk_bytes), user=user, claim=True)
    store.sync()
    return ck, dst_layout


def pin_destination(dst: str, storage_options: dict | None, run_id: str) -> tuple[int, int] | None:
    """The identity of the directory `prepare` just wrote DST's metadata into (None on object
    stores), for every writer of this run to pin: checked to hold this run's provenance, so a DST
    replaced in between is not pinned instead."""
    store = open_store(dst, storage_options)
    identity = store.pin_root()
    if identity is None:  # an object store (nothing to pin, nothing to read), or no directory at all
        return None
    prov = _provenance(store)
    if prov is None or prov.get("run_id") != run_id:
        raise DestinationReplacedError(f"{dst} was replaced by another job right after this reshard began; "
                                       "nothing of this run is there. Make sure one job at a time writes there "
                                       "(and, under torchrun across machines, that DST is storage they all share)")
    return identity


def finish(dst: str, *, storage_options: dict | None, rank_manifests: dict[int, dict] | None = None,
           run_id: str | None = None, identity: tuple[int, int] | None = None) -> None:
    """Coordinator step 3: verify every rank finished and write the commit marker last. With
    `run_id` (the one given to `prepare`), first check that DST is still this run's: a second,
    identical reshard may have taken it for an interrupted run and replaced it meanwhile, and
    this run's rank records would then describe objects that are gone."""
    if identity is not None:  # the directory this run pinned (pin_destination) is still DST
        open_store(dst, storage_options).pin_root(identity)
    if run_id is not None:
        now = _provenance(open_store(dst, storage_options))  # storage errors propagate as they are
        if now is None or now.get("run_id") != run_id:
            raise DestinationReplacedError(f"{dst} was replaced by another reshard while this one ran; this run did "
                                           "not commit it. Make sure one reshard at a time writes there, then re-run")
    commit(dst, storage_options=storage_options, rank_manifests=rank_manifests)


def peak_rss() -> tuple[int, int]:
    """(this process, largest waited-for child) peak RSS in bytes; the child figure is `ru_maxrss`
    and is only a fallback (workers report their own VmHWM)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return peak_rss_self(), int(kids)


# -- the whole job -----------------------------------------------------------------------------------------

def reshard(
    src: str,
    dst: str,
    world_size: int,
    *,
    from_world_size: int | None = None,
    layout: str | None = None,
    granularity: GranularitySpec | None = None,
    align: int = 1,
    workers: int | None = 1,
    threads: int | None = None,
    window: int = DEFAULT_WINDOW,
    overwrite: bool = False,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> ReshardStats:
    """Reshard the committed checkpoint at `src` into a new committed checkpoint at `dst` laid out
    for `world_size` ranks. `layout` keeps the source kind by default; `workers` processes each write
    a disjoint share of destination ranks (None: `auto_workers`, what the CLI does; a library call
    spawns none unless asked); peak memory stays near `window` bytes above the
    interpreter's own. `on_total(bytes)` is called once the destination size is known (for a
    progress bar), `progress(n)` as bytes are written."""
    check_flag("overwrite", overwrite)
    check_count("workers", workers, optional=True)
    check_count("threads", threads, optional=True)
    check_count("world_size", world_size)
    check_count("from_world_size", from_world_size, optional=True)
    t0 = time.perf_counter()
    storage_options = dict(storage_options or {})
    probe = open_checkpoint(src, storage_options=storage_options)
    if workers is None:
        workers = auto_workers(world_size, len(probe.layout.buffers), window, int(probe.block_bytes))
    workers = min(workers, world_size)  # a worker owns whole destination ranks: more would sit idle
    n_threads, chunk = sizing(window, workers, threads, int(probe.block_bytes))
    chunk = job_chunk(chunk, probe)
    run_id = uuid.uuid4().hex
    with replacing(src, dst, overwrite=overwrite, storage_options=storage_options, tag=run_id[:12],
                   source=probe) as leftovers:
        ck, dlay = prepare(src, dst, world_size, from_world_size=from_world_size, layout=layout,
                           granularity=granularity, align=align, overwrite=overwrite,
                           storage_options=storage_options, chunk_bytes=chunk, checkpoint=probe, run_id=run_id)
        kill_point("reshard: DST prepared")
        try:
            t_plan = time.perf_counter() - t0
            if on_total is not None:
                on_total(dlay.total_bytes())
            job = ReshardJob(src=src, dst=dst, storage_options=storage_options, threads=n_threads,
                             chunk_bytes=chunk, budget_bytes=min(chunk, ck.store.fetch_bytes),
                             dst_identity=pin_destination(dst, storage_options, run_id),
                             window_bytes=window // workers)
            if workers == 1:
                docs, counters = write_share(job, range(world_size), progress, checkpoint=ck)
            else:
                docs, counters = run_workers(job, split_ranks(dlay, workers), progress)
            finish(dst, storage_options=storage_options, rank_manifests=docs, run_id=run_id,
                   identity=job.dst_identity)
        except BaseException as e:
            if not isinstance(e, DestinationReplacedError):  # else DST, and its open uploads, are the other job's
                abort_uploads(dst, storage_options, hurried=not isinstance(e, Exception))
                if not overwrite:
                    attach_note(e, LEFT_UNCOMMITTED)
            raise
    seconds = time.perf_counter() - t0
    own, kids = peak_rss()
    kids = int(counters.get("peak_rss_bytes", kids))
    return job_stats(ck, dlay, dst, storage_options, counters, seconds, peak_rss_bytes=own,
                     peak_rss_workers_bytes=kids if workers > 1 else 0, processes=workers, threads=n_threads,
                     window_bytes=window, chunk_bytes=chunk, plan_seconds=t_plan, leftovers=leftovers)


def abort_uploads(dst: str, storage_options: dict | None, *, hurried: bool = False) -> None:
    """After a failed job, abort the multipart uploads its writers left open under DST (a worker
    process stopped mid-upload cannot abort its own): on S3 their parts are billed until a
    lifecycle rule removes them. Best effort: the job's own error is what the user must see.
    `hurried`: the job was interrupted, and a kill may follow (see `S3Store.abort_uploads`)."""
    try:
        open_store(dst, storage_options).abort_uploads(hurried=hurried)
    except BaseException:  # noqa: BLE001 - a second Ctrl-C ends the clean-up, not the job's own error
        pass


def job_stats(ck: Checkpoint, dlay: CheckpointLayout, dst: str, storage_options: dict | None, counters: dict,
              seconds: float, *, leftovers: Sequence[str] = (), extra: dict | None = None, **rest) -> ReshardStats:
    """The summary of a finished job (shared by the in-process, worker and torchrun drivers).
    `leftovers`: set-aside siblings of DST that `replacing` found (reported under `extra`)."""
    total = dlay.total_bytes()
    with_extras = ck.ranks_with_extras()
    same_world = ck.world_size == dlay.world_size
    return ReshardStats(
        src=ck.url, dst=open_store(dst, storage_options).url, from_world_size=ck.world_size,
        to_world_size=dlay.world_size, from_layout=ck.kind, to_layout=dlay.kind, tensors=len(dlay.names()),
        bytes_written=total, data_bytes=dlay.data_bytes(), bytes_read=int(counters.get("bytes_read", 0)),
        read_requests=int(counters.get("read_requests", 0)), read_calls=int(counters.get("read_calls", 0)),
        bytes_reused=int(counters.get("bytes_reused", 0)), seconds=seconds, gb_per_s=total / seconds / 1e9 if seconds else 0.0,
        extras_copied=with_extras if same_world else 0, extras_dropped=0 if same_world else with_extras,
        extra={**(extra or {}), **({"leftover_set_asides": list(leftovers)} if leftovers else {})}, **rest,
    )
