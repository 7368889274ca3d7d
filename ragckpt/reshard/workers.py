"""`--workers K`: K spawned processes on one machine, each writing a disjoint share of destination ranks.

Processes (not threads) because checksumming, scattering and Python bookkeeping hold the GIL part of
the time; spawn (not fork) because the parent may hold threads and open object-store clients. The
parent has already written DST's global metadata; each child runs `share.write_share` for its
share and sends back its rank manifests. The parent watches every child's pipe and process
sentinel: if a child raises, or dies (killed, out of memory), the others are terminated at once and
a one-line `ReshardError` says which share failed. The destination is then left without a commit
marker, and a re-run replaces it.

Children are started with a blank `__main__` so spawn does not re-run the parent's main script (the
`ragckpt` console script would import every CLI command, seconds per child), and they leave with
`os._exit` once their result is sent: their objects are written and fsynced by then, and skipping
interpreter teardown saves more seconds.

A child never outlives the parent: if the parent is killed outright (SIGKILL, the OOM killer, a
preempted job), its `finally` never runs, so each child arranges its own end at start. On Linux it
asks the kernel for SIGKILL when the parent dies (`prctl(PR_SET_PDEATHSIG)`), elsewhere a watcher
thread polls `getppid()`; either way it then checks that the parent it was given is still its
parent, in case the parent died before that. Otherwise orphans would keep writing DST while the
re-run the docs advise deletes and rewrites it.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ragckpt.errors import DestinationReplacedError, RagckptError
from ragckpt.reshard.share import ReshardError, ReshardJob, peak_rss_self, write_share

_POLL_S = 0.2
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: exit status of a worker that found its parent gone (nobody is left to read it)
ORPHAN_EXIT = 3


def _set_pdeathsig() -> bool:
    """Linux: have the kernel SIGKILL this process when its parent dies. False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int, interval: float = _POLL_S) -> threading.Thread:
    """Portable fallback: a daemon thread that ends the process once `parent_pid` is no longer
    its parent (the orphan was re-parented to init or a subreaper)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(ORPHAN_EXIT)

    t = threading.Thread(target=watch, name="ragckpt-parent-watch", daemon=True)
    t.start()
    return t


def _die_with_parent(parent_pid: int, *, use_prctl: bool = True) -> None:
    """Make sure this process ends promptly, writing nothing more, once `parent_pid` is gone."""
    armed = use_prctl and _set_pdeathsig()
    if os.getppid() != parent_pid:  # the parent died before we were armed
        os._exit(ORPHAN_EXIT)
    if not armed:
        _watch_parent(parent_pid)


def _child(job: ReshardJob, ranks: list[int], conn: Any, counter: Any, parent_pid: int) -> None:
    """Worker process body: write the share, report progress through a shared counter."""
    _die_with_parent(parent_pid)

    def progress(n: int) -> None:
        with counter.get_lock():
            counter.value += n

    try:
        docs, stats = write_share(job, ranks, progress)
        stats["peak_rss_bytes"] = peak_rss_self()
        conn.send(("ok", docs, stats))
    except BaseException as e:  # noqa: BLE001 - everything must reach the parent as one line
        try:
            conn.send(("error", e, None))
        except Exception:  # the exception itself does not pickle
            conn.send(("error", ReshardError(f"{type(e).__name__}: {e}"), None))
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@contextmanager
def _blank_main() -> Iterator[None]:
    """Hide the parent's `__main__` while children are spawned, so they import only ragckpt; and
    spawn them with SIGINT blocked (the mask is kept across fork and exec), so a Ctrl-C in the
    terminal, which reaches the whole process group, interrupts only the parent, which stops its
    workers itself, instead of each worker printing its own traceback from wherever it was (often
    still importing torch). Blocked, not ignored: a Ctrl-C that arrives meanwhile is not lost (the
    job would then run to the end), only held back until the block is done, since the parent must
    not be interrupted half way through starting a worker either (it could not stop that worker)."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    held: list[int] = []
    in_main_thread = threading.current_thread() is threading.main_thread()
    # another thread of this process may still take the signal: record it rather than raise mid-start
    handler = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum)) if in_main_thread else None
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending Ctrl-C arrives here, and is held
        if in_main_thread:
            signal.signal(signal.SIGINT, handler)
        if main is not None:
            sys.modules["__main__"] = main
    if held:
        raise KeyboardInterrupt


def _describe(exitcode: int | None) -> str:
    if exitcode is None:
        return "vanished"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


def run_workers(job: ReshardJob, shares: Sequence[Sequence[int]], progress: Callable[[int], None] | None = None
                ) -> tuple[dict[int, dict], dict]:
    """Run one spawned process per non-empty share; returns merged rank manifests and counters."""
    ctx = mp.get_context("spawn")
    with _blank_main():  # the first shared value spawns multiprocessing's resource tracker
        counter = ctx.Value("q", 0)
    procs: list[tuple[Any, Any, list[int]]] = []
    docs: dict[int, dict] = {}
    totals: dict[str, int] = {}
    try:
        for share in shares:
            if not share:
                continue
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(job, list(share), send, counter, os.getpid()),
                           daemon=True)
            with _blank_main():
                p.start()
                procs.append((p, recv, list(share)))  # before a held Ctrl-C is raised: it gets stopped
            send.close()
        pending = {id(r): (p, r, share) for p, r, share in procs}
        seen = 0
        while pending:
            waitables = [r for _, r, _ in pending.values()] + [p.sentinel for p, _, _ in pending.values()]
            ready = mpc.wait(waitables, timeout=_POLL_S)
            if progress is not None:
                now = counter.value
                if now > seen:
                    progress(now - seen)
                    seen = now
            for key, (p, r, share) in list(pending.items()):
                if r in ready or (p.sentinel in ready and r.poll()):
                    try:
                        status, payload, stats = r.recv()
                    except EOFError:
                        status, payload, stats = "died", None, None
                elif p.sentinel in ready:
                    status, payload, stats = "died", None, None
                else:
                    continue
                span = f"destination ranks {share[0]}-{share[-1]}"
                if status == "ok":
                    docs.update(payload)
                    for k, v in stats.items():
                        # sums, except the peak: the largest worker's
                        totals[k] = max(totals.get(k, 0), int(v)) if k == "peak_rss_bytes" else totals.get(k, 0) + int(v)
                    p.join()
                    del pending[key]
                elif status == "error":
                    if isinstance(payload, DestinationReplacedError):  # DST is another job's now: not "left"
                        raise type(payload)(f"{payload} ({span})") from None
                    if isinstance(payload, RagckptError):
                        raise type(payload)(f"{payload} ({span}); the destination was left uncommitted") from None
                    raise ReshardError(f"worker for {span} failed: {type(payload).__name__}: {payload}; "
                                       "the destination was left uncommitted") from None
                else:
                    p.join(1)
                    raise ReshardError(f"worker process {p.pid} for {span} {_describe(p.exitcode)}; the "
                                       "destination was left uncommitted — re-run the same command to redo it")
        if progress is not None and counter.value > seen:
            progress(counter.value - seen)
        return docs, totals
    finally:
        for p, _, _ in procs:
            if p.is_alive():
                p.terminate()
        for p, r, _ in procs:
            p.join(5)
            r.close()
