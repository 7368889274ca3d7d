"""One large S3 object written front to back from a few reused part buffers.

Converters that produce a file in order (export-hf writes each safetensors file header first, then
tensor after tensor) cannot hand the store the whole object: it may be tens of GiB. fsspec's
buffered writer keeps a growing `BytesIO` and copies each part out of it before sending it, so its
peak is several times the part size, and every part is a fresh allocation that glibc's heap keeps:
an export with a 32 MiB budget peaked 210 MiB above its start for a 192 MiB file, 326 MiB when it
cast to fp32. Here the bytes go into at most `buffers` part buffers allocated once; a full buffer is
uploaded in the background (through the store's retried, concurrency-bounded requests, streamed
out of the buffer without a copy) while the caller fills the next one, and is reused once its
upload is done. A caller's memory is therefore `buffers * part` bytes whatever the object's size.

Nothing is visible at the key until `close` completes the upload (or, for an object that fits one
part, its single PUT); `abort` discards the parts already sent. With `defer_complete`, `close` only
sends every part and `complete` makes the object visible later: a writer that must check its input
before anything it wrote may be seen (export-hf verifies the source blocks its files share only at
the end) holds no buffer meanwhile, just the parts' ETags; an object that fits one part is then a
one-part multipart upload, so that its buffer is not kept either.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ragckpt.errors import StorageError
from ragckpt.storage.config import part_bytes_for

if TYPE_CHECKING:
    from ragckpt.storage.remote import S3Store


#: seconds `abort` waits for parts in flight to stop
_STOP_WAIT_S = 10.0


@dataclass(eq=False)
class _Part:
    """A part in flight: its buffer, the future of its ETag, and whether its coroutine has started
    and finished (a cancelled future says neither)."""

    buf: bytearray
    fut: concurrent.futures.Future = field(default=None)  # type: ignore[assignment]
    started: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)


class StreamingUpload:
    """`write` bytes in order, then `close` (or `abort`). Not thread-safe: one writer.
    Made by `S3Store.upload_stream`."""

    def __init__(self, store: S3Store, key: str, size: int, *, part_bytes: int, buffers: int = 2,
                 defer_complete: bool = False):
        if size < 0:
            raise ValueError(f"object size must be >= 0, got {size}")
        self.store, self.key, self.size = store, key, int(size)
        self.url = store.child(key)
        self.part = part_bytes_for(size, part_bytes)
        self.defer = bool(defer_complete)
        # one PUT, no multipart upload; deferred, only an empty object (a PUT of nothing, at `complete`)
        self.single = self.size == 0 if self.defer else self.size <= self.part
        self.sent = False  # every part sent (`close` under `defer_complete`), the object not yet visible
        self.max_buffers = 1 if self.single else max(2, int(buffers))
        self._allocated = 0
        self._cur: bytearray | None = None
        self._fill = 0
        self.written = 0
        self._upload_id: str | None = None
        self._etags: list[str] = []  # of parts 1, 2, ... (parts finish oldest first)
        self._pending: deque[_Part] = deque()
        self._next_part = 1
        self.closed = False
        self.aborted = False

    # -- writing --------------------------------------------------------------------------------------------
    def write(self, data: memoryview | bytes | bytearray) -> None:
        if self.closed or self.sent:
            raise StorageError(f"cannot write {self.url}: the upload was already closed")
        mv = memoryview(data).cast("B")
        if self.written + len(mv) > self.size:
            self.abort()
            raise StorageError(f"cannot write {self.url}: {self.written + len(mv)} bytes written to an object "
                               f"declared as {self.size} bytes")
        try:
            while len(mv):
                if self._cur is None:
                    self._cur = self._take_buffer()
                    self._fill = 0
                n = min(len(mv), len(self._cur) - self._fill)
                self._cur[self._fill : self._fill + n] = mv[:n]
                self._fill += n
                self.written += n
                mv = mv[n:]
                if self._fill == len(self._cur) and not self.single:
                    self._send()
        except BaseException:  # a part failed for good (or an interrupt): nothing is to be stored
            self.abort()
            raise

    def _take_buffer(self) -> bytearray:
        if self._allocated < self.max_buffers:
            self._allocated += 1
            return bytearray(min(self.size, self.part))  # an object under one part needs no more
        return self._finish_oldest()  # wait for the oldest part in flight, then reuse its buffer

    def _finish_oldest(self) -> bytearray:
        # taken off the queue only once done: a wait interrupted here (Ctrl-C) leaves the part for
        # `abort` to stop, instead of uploading on after the upload was aborted
        part = self._pending[0]
        self._etags.append(self._wait(part.fut))
        self._pending.popleft()
        return part.buf

    def _send(self) -> None:
        """Upload the current buffer as the next part, in the background."""
        buf, n = self._cur, self._fill
        self._cur, self._fill = None, 0
        if self._upload_id is None:
            self._upload_id = self.store.start_multipart(self.key)
        number = self._next_part
        self._next_part += 1
        body = memoryview(buf)[:n]
        part = _Part(buf)

        async def send() -> str:
            part.started.set()
            try:
                return await self.store.upload_part(self.key, self._upload_id, number, [body])
            finally:
                part.finished.set()

        part.fut = asyncio.run_coroutine_threadsafe(send(), self.store.fs.loop)
        self._pending.append(part)

    @staticmethod
    def _wait(fut: concurrent.futures.Future) -> str:
        while True:  # timed waits, so Ctrl-C interrupts the wait
            try:
                return fut.result(timeout=1)
            except concurrent.futures.TimeoutError:
                continue

    # -- finishing ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Send what is left and make the object visible (under `defer_complete`, only send it:
        `complete` makes it visible); it must have exactly `size` bytes."""
        if self.aborted:
            raise StorageError(f"cannot write {self.url}: the upload was aborted after an earlier failure; "
                               "nothing was stored")
        if self.closed or self.sent:
            return
        if self.written != self.size:
            self.abort()
            raise StorageError(f"cannot write {self.url}: {self.written} of its {self.size} bytes were written; "
                               "nothing was stored")
        try:
            if self.single:
                if not self.defer:
                    body = memoryview(self._cur)[: self._fill] if self._cur is not None else memoryview(b"")
                    self.store.write(self.key, [body])
            else:
                if self._fill:
                    self._send()
                while self._pending:
                    self._finish_oldest()
                if not self.defer:
                    self.store.complete_multipart(self.key, self._upload_id, self._etags, self.size)
        except BaseException:
            self.abort()
            raise
        self._cur = None
        if self.defer:
            self.sent = True
        else:
            self.closed = True

    def complete(self) -> None:
        """Make a `defer_complete` upload visible, once `close` has sent it."""
        if self.aborted or not (self.sent or self.closed):
            raise StorageError(f"cannot complete {self.url}: the upload was aborted or not closed; nothing was stored")
        if self.closed:
            return
        try:
            if self.single:
                self.store.write(self.key, [memoryview(b"")])
            else:
                self.store.complete_multipart(self.key, self._upload_id, self._etags, self.size)
        except BaseException:
            self.abort()
            raise
        self.closed = True

    def abort(self) -> None:
        """Discard the upload: cancel parts in flight and abort the multipart upload (best effort)."""
        if self.closed:
            return
        self.closed = self.aborted = True
        if self._pending:
            for part in self._pending:
                part.fut.cancel()
            # one trip through the loop: the cancellations above have then reached every part, so a
            # part not started by now never starts, and a started one stops at its next await. A
            # cancelled future returns at once, so wait for the parts themselves to stop sending:
            # a part that lands after the abort would stay stored
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.store.fs.loop).result(timeout=_STOP_WAIT_S)
            deadline = time.monotonic() + _STOP_WAIT_S
            for part in self._pending:
                if part.started.is_set():
                    part.finished.wait(max(0.0, deadline - time.monotonic()))
            self._pending.clear()
        if self._upload_id is not None:
            self.store.abort_multipart(self.key, self._upload_id)
        self._cur = None
