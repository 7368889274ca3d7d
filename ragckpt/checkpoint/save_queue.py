"""This process's save writer: one thread that runs background saves one after another, and the
saves still in flight, by destination, so that a later save or commit into the same checkpoint
waits for them. The writer (`checkpoint.writer`) and the background saves (`checkpoint.background`)
both build on it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

from ragckpt.storage.destination import normalize_url

T = TypeVar("T")

_writer: ThreadPoolExecutor | None = None
_writer_lock = threading.Lock()


def _reset_after_fork() -> None:
    """A forked child has no writer thread, whatever the parent's executor object says, and a lock
    the parent held while forking would stay held in the child for ever."""
    global _writer, _writer_lock, _pending, _pending_lock
    _writer = None
    _writer_lock = threading.Lock()
    _pending, _pending_lock = {}, threading.Lock()  # the parent's saves are not the child's to wait for


os.register_at_fork(after_in_child=_reset_after_fork)


#: this process's background saves not yet done, by destination (see `wait_for_background_saves`)
_pending: dict[str, set[Future]] = {}
_pending_lock = threading.Lock()
_on_writer = threading.local()


def submit_save(fn: Callable[..., T], *args: object, url: str | None = None) -> Future[T]:
    """Run `fn(*args)` on this process's save writer thread, after the saves submitted before it.
    The thread is not a daemon: a script that returns while a save is running finishes the save
    before the interpreter exits (a process that leaves with `os._exit` must wait for it first).
    `url`, the checkpoint it writes, lets a later save into the same one wait for it."""
    global _writer

    def run() -> T:
        _on_writer.active = True
        try:
            return fn(*args)
        finally:
            _on_writer.active = False

    key = _key(url) if url is not None else None  # a bad url raises here, before a job is queued
    with _writer_lock:
        if _writer is None:
            _writer = ThreadPoolExecutor(1, thread_name_prefix="ragckpt-save")
        future = _writer.submit(run)
    if key is not None:
        with _pending_lock:
            _pending.setdefault(key, set()).add(future)
        # outside the lock: a future done already runs the callback here and now
        future.add_done_callback(lambda f: _done(key, f))
    return future


def _key(url: str) -> str:
    return normalize_url(url)


def _done(key: str, future: Future) -> None:
    with _pending_lock:
        left = _pending.get(key)
        if left is not None:
            left.discard(future)
            if not left:
                del _pending[key]


def wait_for_background_saves(url: str) -> None:
    """Block until this process's background saves into `url` are done (each reports its outcome
    through its own future). A save started while one into the same checkpoint still runs would
    otherwise write the same rank's objects beside it, and a commit could then record one save's
    checksums over the other's data. The writer thread itself never waits (it would wait for
    itself): its saves run one after another already."""
    if getattr(_on_writer, "active", False):
        return
    with _pending_lock:
        futures = list(_pending.get(_key(url), ()))
    if futures:
        wait(futures)
