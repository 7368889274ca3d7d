"""The same offline reshard spread over many processes and machines with torchrun (gloo, CPU only).

    torchrun --nnodes 4 --nproc-per-node 8 --node-rank $NODE --master-addr $HOST --master-port 29500 \\
        -m cli.distributed s3://bucket/run/step_1000 s3://bucket/run/step_1000_w4096 --to 4096

(the same command as `ragckpt reshard --distributed ...`, which may be the torchrun program itself). Process 0 plans and writes DST's
global metadata; every process writes its share of destination ranks
(`offline.split_ranks(layout, WORLD_SIZE)[RANK]`, disjoint, so no object has two writers); process 0
commits. Each of these three phases ends with one all-gather of every process's outcome, and every
step on every process is caught (whatever the exception type) and reported through it: a failure
anywhere makes every process raise the same one-line `ReshardError` naming the failing process and
step, so every process exits non-zero instead of hanging in a collective. SRC and DST must be
storage every process can reach (an object store or a shared filesystem). If a process dies,
torchrun stops the others and DST stays uncommitted; running the same command again replaces it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from ragckpt.checkpoint.reader import open as open_checkpoint
from ragckpt.errors import DestinationReplacedError, LayoutError
from ragckpt.phases import Phase, exchange, failure_message
from ragckpt.planner.planner import GranularitySpec
from ragckpt.reshard.offline import (
    ReshardStats,
    abort_uploads,
    finish,
    job_chunk,
    job_stats,
    pin_destination,
    prepare,
    replacing,
    sizing,
    split_ranks,
)
from ragckpt.reshard.share import DEFAULT_WINDOW, ReshardError, ReshardJob, peak_rss_self, write_share
from ragckpt.storage.destination import normalize_url

_UNDER_TORCHRUN = ("run this under torchrun (torchrun --nproc-per-node K -m cli.distributed SRC DST "
                   "--to N), which sets it")


def _env_int(name: str, minimum: int = 0) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        raise LayoutError(f"environment variable {name} is not set; {_UNDER_TORCHRUN}")
    try:
        value = int(raw)
    except ValueError:
        raise LayoutError(f"environment variable {name} is {raw!r}, not an integer; {_UNDER_TORCHRUN}") from None
    if value < minimum:
        raise LayoutError(f"environment variable {name} is {value}, expected at least {minimum}; {_UNDER_TORCHRUN}")
    return value


def _check_rendezvous_env() -> None:
    """torch's env:// rendezvous fails on a missing MASTER_ADDR with a bare ValueError; say what to do."""
    if not os.environ.get("MASTER_ADDR", "").strip():
        raise LayoutError(f"environment variable MASTER_ADDR is not set; {_UNDER_TORCHRUN}")
    _env_int("MASTER_PORT", minimum=1)


class ReshardReplacedError(ReshardError, DestinationReplacedError):
    """A process found DST replaced by another job (so it is caught as either)."""


def _found_replaced(outcomes: list[dict]) -> bool:
    return any(o.get("kind") in (DestinationReplacedError.__name__, ReshardReplacedError.__name__) for o in outcomes)


def _exchange(dist, mine: Phase, suffix: Callable[[list[dict]], str] = lambda _: "", **extra: object) -> list[dict]:
    """All-gather this phase's outcomes; on any failure every process raises the same ReshardError
    (the lowest failing process's), so all of them leave in lock-step and none waits in a later
    collective for a peer that has given up."""
    outcomes, failed = exchange(dist, mine, **extra)
    if failed:
        cls = ReshardReplacedError if _found_replaced(outcomes) else ReshardError
        raise cls(failure_message(failed) + suffix(outcomes)) from mine.error
    return outcomes


_UNCOMMITTED = "; the destination was left uncommitted — re-run the same command to redo it"


def _left_uncommitted(outcomes: list[dict]) -> str:
    """The advice after a failed write or commit, unless a process found DST replaced by another job:
    then DST is that job's (committed or on its way), not this one's to redo, and when the process
    the error names failed otherwise, that is said too."""
    if not _found_replaced(outcomes):
        return _UNCOMMITTED
    named = next(r for r, o in enumerate(outcomes) if not o["ok"])
    saw = next(r for r, o in enumerate(outcomes) if _found_replaced([o]))
    return "" if saw == named else f"; process {saw} found DST replaced by another job: it is that job's now"


def run(
    src: str,
    dst: str,
    world_size: int,
    *,
    from_world_size: int | None = None,
    layout: str | None = None,
    granularity: GranularitySpec | None = None,
    align: int = 1,
    threads: int | None = None,
    window: int = DEFAULT_WINDOW,
    overwrite: bool = False,
    storage_options: dict | None = None,
    progress: Callable[[int], None] | None = None,
    timeout_s: float = 3600.0,
) -> ReshardStats | None:
    """One torchrun process's part of a distributed reshard. Returns the job's stats on process 0
    (None elsewhere). `window` is per process here: every process runs on its own budget.

    Three phases, each ended by one all-gather of every process's outcome (ok, or the failed step
    and a one-line error): prepare (all open SRC; process 0 writes DST's metadata), write (all write
    their shares), commit (process 0 commits and computes the stats). Every step on every process
    runs inside a try, so a failure anywhere makes every process raise the same `ReshardError`,
    naming the process and the step, right after that phase's all-gather; nobody is left in a
    collective waiting for the group's timeout."""
    import torch.distributed as dist  # loads torch: only a distributed run needs it (see ragckpt.lazy)

    rank, procs = _env_int("RANK"), _env_int("WORLD_SIZE", minimum=1)
    if rank >= procs:
        raise LayoutError(f"environment variable RANK is {rank}, but WORLD_SIZE is {procs}: RANK must be below it; "
                          f"{_UNDER_TORCHRUN}")
    storage_options = dict(storage_options or {})
    created = not dist.is_initialized()
    if created:
        _check_rendezvous_env()
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    in_step = False  # every process is past the same collective: a barrier cannot hang
    try:
        stats = _phases(dist, rank, procs, src, dst, world_size, from_world_size=from_world_size, layout=layout,
                        granularity=granularity, align=align, threads=threads, window=window, overwrite=overwrite,
                        storage_options=storage_options, progress=progress)
        in_step = True
        return stats
    except ReshardError:  # raised by every process after the same all-gather
        in_step = True
        raise
    finally:
        if created:
            if in_step:  # gloo aborts a process that tears down while a peer still talks to it
                with contextlib.suppress(Exception):  # a peer gone by now changes nothing here
                    dist.barrier()
            dist.destroy_process_group()


def _phases(dist: Any, rank: int, procs: int, src: str, dst: str, world_size: int, *, from_world_size: int | None,
            layout: str | None, granularity: GranularitySpec | None, align: int, threads: int | None, window: int,
            overwrite: bool, storage_options: dict, progress: Callable[[int], None] | None) -> ReshardStats | None:
    """The three phases of `run`, inside the process group. Process 0 holds an old DST that
    --overwrite replaces aside (see `offline.replacing`) until the job has committed."""
    with contextlib.ExitStack() as keep:
        t0 = time.perf_counter()
        # -- phase 0: every process was given the same job ------------------------------------------------
        args = {"SRC": normalize_url(src), "DST": normalize_url(dst), "--to": world_size, "--from": from_world_size,
                "--layout": layout, "--granularity": None if granularity is None else repr(granularity),
                "--align": align, "--overwrite": overwrite}
        outcomes = _exchange(dist, Phase(), args=args)
        _require_same_args(outcomes)
        # -- phase 1: prepare -------------------------------------------------------------------------------
        run_id = uuid.uuid4().hex  # process 0's: it alone prepares and commits
        here = Phase()
        prepared = False
        try:
            here.step = "open the source"
            ck = open_checkpoint(src, storage_options=storage_options)
            here.step = "size the job"
            n_threads, chunk = sizing(window, 1, threads, int(ck.block_bytes))
            chunk = job_chunk(chunk, ck)
            if rank == 0:
                here.step = "check the destination"
                leftovers = keep.enter_context(replacing(src, dst, overwrite=overwrite,
                                                         storage_options=storage_options, tag=run_id[:12], source=ck))
                here.step = "prepare the destination"
                prepare(src, dst, world_size, from_world_size=from_world_size, layout=layout, granularity=granularity,
                        align=align, overwrite=overwrite, storage_options=storage_options, chunk_bytes=chunk,
                        checkpoint=ck, run_id=run_id)
                prepared = True
                t_plan = time.perf_counter() - t0  # as the in-process job counts it: up to the prepared DST
        except Exception as e:  # noqa: BLE001 - reported to every process by the all-gather
            here.error = e
        # once process 0 has written DST's metadata, a failure leaves an uncommitted DST behind
        outcomes = _exchange(dist, here, lambda outs: _UNCOMMITTED if outs[0].get("prepared") else "",
                             prepared=prepared, run_id=run_id)
        run_id = outcomes[0]["run_id"]  # the run process 0 prepared DST for
        # -- phase 2: every process writes its share ----------------------------------------------------------
        here = Phase()
        counters: dict = {}
        share: list[int] = []
        try:
            # each process pins the directory it sees (its own device and inode on a shared file system)
            # once it has checked that the directory holds process 0's run, so its writes stop if
            # another job's --overwrite replaces DST meanwhile
            here.step = "pin the destination"
            identity = pin_destination(dst, storage_options, run_id)
            here.step = "read the destination layout"
            job = ReshardJob(src=src, dst=dst, storage_options=storage_options, threads=n_threads,
                             chunk_bytes=chunk, budget_bytes=min(chunk, ck.store.fetch_bytes), dst_identity=identity,
                             window_bytes=window)
            dlay = open_checkpoint(dst, storage_options=storage_options, allow_uncommitted=True).layout
            share = split_ranks(dlay, procs)[rank]
            here.step = (f"write destination ranks {share[0]}-{share[-1]}" if share
                         else "write its share (no destination ranks)")
            _, counters = write_share(job, share, progress, checkpoint=ck)
            counters["peak_rss_bytes"] = peak_rss_self()  # travels to process 0 in the exchange below
        except Exception as e:  # noqa: BLE001
            here.error = e
        try:
            outcomes = _exchange(dist, here, _left_uncommitted, counters=counters)
        except ReshardError as e:
            # every process is past its writes: what is still open under DST is left over, unless DST
            # is another job's now (its uploads are its own)
            if rank == 0 and not isinstance(e, DestinationReplacedError):
                abort_uploads(dst, storage_options)
            raise
        # -- phase 3: process 0 commits; the final all-gather keeps everyone until the commit is written -----
        here = Phase()
        stats = None
        committed = False
        if rank == 0:
            try:
                here.step = "commit the destination"
                finish(dst, storage_options=storage_options, run_id=run_id, identity=job.dst_identity)
                committed = True
                here.step = "collect the job's statistics"
                seconds = time.perf_counter() - t0
                own = peak_rss_self()
                largest = max(int(o["counters"].get("peak_rss_bytes", 0)) for o in outcomes)
                summed = {k: sum(int(o["counters"].get(k, 0)) for o in outcomes)
                          for k in ("bytes_read", "read_requests", "read_calls", "bytes_reused")}
                stats = job_stats(ck, dlay, dst, storage_options, summed, seconds, peak_rss_bytes=own,
                                  peak_rss_workers_bytes=max(own, largest), processes=procs, threads=n_threads,
                                  window_bytes=window, chunk_bytes=chunk, plan_seconds=t_plan,
                                  extra={"distributed": True}, leftovers=leftovers)
            except Exception as e:  # noqa: BLE001
                here.error = e
        _exchange(dist, here, lambda outs: ("; the destination was committed" if outs[0].get("committed")
                                                   else _left_uncommitted(outs)), committed=committed)
        return stats


def _require_same_args(outcomes: list[dict]) -> None:
    """Every process plans from process 0's arguments: one given another SRC would write its share
    of another checkpoint's data into DST, and DST would commit mixed and pass `verify`."""
    first = outcomes[0]["args"]
    for p, o in enumerate(outcomes[1:], start=1):
        for name, value in o["args"].items():
            if value != first[name]:
                raise ReshardError(f"process {p} was given {name} {value!r}, process 0 {first[name]!r}: every process "
                                   "of a distributed reshard must run the same command; nothing was written")
