"""A thread pool for tasks that write (objects, files), which must all be stopped before the caller
cleans up after a failure.

`concurrent.futures.ThreadPoolExecutor` alone does not do that: leaving its `with` block after a
failure or Ctrl-C waits for every queued task to run to the end (an export of a thousand files
finishes all of them before its clean-up deletes them), and a Ctrl-C that lands inside `submit()`
can come after a worker thread started and before the pool recorded it, so `shutdown(wait=True)`
returns while that thread still writes, into a destination the caller is already putting back.

Here every task passes a gate. Once any task fails or the caller leaves the `with` block on an
exception, tasks not yet started never start, running ones stop at their next `stop_point()`, and
the block is left only when none is running. The caller sees the first real failure, not the
`Stopped` of the tasks it cut short.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")


#: tasks in flight in `bounded_map`: at least this many (a future is ~1.5 KB, so 1.5 MB), so that
#: threads go on past one slow task at the front for a long while; and a few per thread
MIN_AHEAD = 1024
AHEAD_PER_THREAD = 4


def bounded_map(submit: Callable[[Any], Future[T]], items: Iterable[Any], threads: int,
                result: Callable[[Future[T]], T] = Future.result) -> Iterator[T]:
    """`submit(item)` for each item with at most `ahead(threads)` futures outstanding,
    yielding `result(future)` in the items' order. The first window is submitted before this
    returns, as `Executor.map` would; the rest as results are consumed. Memory stays bounded by the
    window however many items there are (one per rank at a million ranks)."""
    it = iter(items)
    window: deque[Future[T]] = deque(submit(x) for x in itertools.islice(it, ahead(threads)))

    def results() -> Iterator[T]:
        try:
            while window:
                fut = window.popleft()
                value = result(fut)
                nxt = next(it, _END)
                if nxt is not _END:
                    window.append(submit(nxt))
                yield value
        finally:  # the caller stopped early (or a task failed): what was queued and not started never runs
            for f in window:
                f.cancel()

    return results()


_END = object()


def ahead(threads: int) -> int:
    """How many tasks `bounded_map` keeps in flight for `threads` threads."""
    return max(MIN_AHEAD, AHEAD_PER_THREAD * max(1, threads))


class Stopped(Exception):
    """Raised in a task of a pool that is stopping; the pool's caller gets the failure that
    stopped it instead."""


_running = threading.local()  # the pool whose task this thread is running, if any


def task_stopping() -> bool:
    """Whether this thread runs a task of a pool that is stopping (a task failed, or the caller left
    on Ctrl-C or SIGTERM). Code that waits on something slow inside a task (a request to a store
    that stopped answering) polls this to give up within a second rather than wait out its
    retries: only the caller's thread receives the signal, and the pool's exit waits for every
    running task."""
    pool = getattr(_running, "pool", None)
    return pool is not None and pool.stopping


class StoppablePool:
    """`with StoppablePool(threads) as pool: for r in pool.map(fn, items): ...`; long tasks call
    `pool.stop_point()` between their steps (between files' items, objects' chunks)."""

    def __init__(self, threads: int):
        self.threads = max(1, threads)
        self._ex = ThreadPoolExecutor(self.threads)
        self._gate = threading.Condition()
        self._active = 0
        self._stopping = False
        self._failure: BaseException | None = None

    def stop_point(self) -> None:
        """Raise `Stopped` when the pool is stopping (a task failed, or the caller gave up)."""
        if self._stopping:
            raise Stopped

    @property
    def stopping(self) -> bool:
        return self._stopping

    def _gated(self, fn: Callable[..., T]) -> Callable[..., T]:
        def run(*args: Any) -> T:
            with self._gate:
                if self._stopping:
                    raise Stopped
                self._active += 1
            outer, _running.pool = getattr(_running, "pool", None), self
            try:
                return fn(*args)
            except Stopped:
                raise
            except BaseException as e:
                with self._gate:
                    if self._failure is None:
                        self._failure = e
                    self._stopping = True
                raise
            finally:
                _running.pool = outer
                with self._gate:
                    self._active -= 1
                    self._gate.notify_all()

        return run

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._ex.submit(self._gated(fn), *args)

    def result(self, fut: Future[T]) -> T:
        """`fut.result()`, with a task cut short by the pool's stop reported as the failure that
        caused it."""
        try:
            return fut.result()
        except Stopped:
            if self._failure is not None:
                raise self._failure from None
            raise

    def map(self, fn: Callable[[Any], T], items: Iterable[Any]) -> Iterator[T]:
        """Like `Executor.map`, results in order, with a bounded window of items in flight
        (`bounded_map`; the first of them submitted now): a future costs about 1.5 KB, and one per
        rank for a million ranks held gigabytes before the first one finished."""
        return bounded_map(lambda it: self.submit(fn, it), items, self.threads, self.result)

    def __enter__(self) -> StoppablePool:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if et is not None:
            with self._gate:
                self._stopping = True
                self._gate.wait_for(lambda: self._active == 0)
            self._ex.shutdown(wait=True, cancel_futures=True)
        else:
            self._ex.shutdown(wait=True)
