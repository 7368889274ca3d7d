"""The S3 backend's building blocks, apart from the store itself: request bodies streamed out of the
caller's buffers (`ViewReader`), the classification of S3 failures (missing, denied, no
credentials, a lost conditional-PUT race), the composite ETag of a multipart upload, the bridge
that runs coroutines on s3fs's I/O loop and cancels them on an interrupt, and the per-process
cache of S3FileSystem clients."""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import json
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import fsspec

from ragckpt.storage.base import Buffer
from ragckpt.storage.remote_base import T
from ragckpt.storage.retry import (
    TRANSIENT_CODES,
    error_code,
    exception_chain,
    http_status,
)
from ragckpt.storage.seekable import SeekableReader
from ragckpt.workpool import Stopped, task_stopping

#: below this, joining a multi-part body costs less than streaming it through a file-like view
_SMALL_BODY = 1 << 20
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
#: S3 error codes of requests refused for their credentials or permissions (permanent)
_DENIED_CODES = frozenset({"403", "AccessDenied", "AllAccessDisabled", "AccountProblem", "InvalidAccessKeyId",
                           "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired",
                           "InvalidSecurity"})
#: what a user can do about access denied
_DENIED_HINT = ("check the credentials (AWS_* variables / profile / -o key=... -o secret=...) and that they allow "
                "s3:GetObject, s3:PutObject, s3:DeleteObject and s3:ListBucket on the bucket")
#: user-metadata key (x-amz-meta-...) that identifies the writer of a create-if-absent object
_TOKEN_META = "ragckpt-writer"


class ViewReader(SeekableReader):
    """A seekable read-only file over bytes [start, stop) of the concatenation of `views`.

    botocore accepts bytes or a file-like object as a request body, not a memoryview; this lets an
    upload (or one part of it) stream straight out of a tensor's memory. Seekable, so botocore can
    compute the body's length and checksum and rewind."""

    def __init__(self, views: Sequence[memoryview], start: int = 0, stop: int | None = None):
        total = sum(len(v) for v in views)
        stop = total if stop is None else stop
        if not 0 <= start <= stop <= total:
            raise ValueError(f"range [{start}, {stop}) is outside {total} bytes")
        super().__init__(stop - start)
        self._segs: list[memoryview] = []
        self._offs: list[int] = []
        pos = 0
        at = 0
        for v in views:
            a, b = max(start, pos), min(stop, pos + len(v))
            if b > a:
                self._offs.append(at)
                self._segs.append(v[a - pos : b - pos])
                at += b - a
            pos += len(v)

    def _pieces(self, n: int) -> list[memoryview]:
        out = []
        i = bisect.bisect_right(self._offs, self._pos) - 1
        pos, end = self._pos, self._pos + n
        while pos < end:
            seg, off = self._segs[i], self._offs[i]
            take = min(end, off + len(seg)) - pos
            out.append(seg[pos - off : pos - off + take])
            pos += take
            i += 1
        return out

    def read(self, size: int | None = -1) -> bytes:
        n = self._size - self._pos if size is None or size < 0 else min(size, self._size - self._pos)
        if n <= 0:
            return b""
        pieces = self._pieces(n)
        self._pos += n
        return bytes(pieces[0]) if len(pieces) == 1 else b"".join(pieces)

    def readinto(self, b: Any) -> int:
        dst = memoryview(b).cast("B")
        n = min(len(dst), self._size - self._pos)
        at = 0
        for piece in self._pieces(n):
            dst[at : at + len(piece)] = piece
            at += len(piece)
        self._pos += n
        return n


def _body(parts: Sequence[Buffer], views: list[memoryview], start: int, stop: int) -> bytes | bytearray | ViewReader:
    """A request body for bytes [start, stop) without copying more than needed."""
    if len(parts) == 1 and isinstance(parts[0], bytes | bytearray) and (start, stop) == (0, len(parts[0])):
        return parts[0]
    if stop - start <= _SMALL_BODY:
        r = ViewReader(views, start, stop)
        return r.read()
    return ViewReader(views, start, stop)


_NO_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"})


def _no_credentials(e: BaseException) -> bool:
    """True when botocore found no usable credentials at all: the request was never sent."""
    return any(type(x).__name__ in _NO_CREDENTIALS for x in exception_chain(e))


def _denied(e: BaseException) -> bool:
    """True for a request refused for its credentials or permissions (403, bad key, expired token),
    not for a 403 that means "try again" (RequestTimeTooSkewed)."""
    code = error_code(e)
    if code in TRANSIENT_CODES:
        return False
    return isinstance(e, PermissionError) or code in _DENIED_CODES or http_status(e) == 403


def _precondition_failed(e: BaseException) -> bool:
    """True when a conditional PUT (`If-None-Match: *`) was refused because the object exists.
    s3fs makes that a FileExistsError only when the error body names the condition
    (`<Condition>If-None-Match</Condition>`, as AWS sends it); MinIO, Ceph RGW and others send a
    bare 412 PreconditionFailed, which s3fs leaves a plain OSError."""
    return isinstance(e, FileExistsError) or error_code(e) in ("PreconditionFailed", "412") or http_status(e) == 412


def _multipart_etag(part_etags: Sequence[str]) -> str | None:
    """The ETag S3 gives an object completed from these parts: the hex MD5 of the concatenated
    binary part MD5s, "-", the number of parts. None when a part ETag is not a hex MD5 (then the
    composite cannot be predicted)."""
    try:
        digests = b"".join(bytes.fromhex(t.strip().strip('"')) for t in part_etags)
    except ValueError:
        return None
    if len(digests) != 16 * len(part_etags):
        return None
    return f"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(part_etags)}"


async def _read_body_into(body: Any, dst: memoryview) -> int:
    """Stream a response body into `dst` until it is full or the body ends; returns the bytes read.
    Each network chunk is copied once, straight into place (aiobotocore's `readinto`, else `read(n)`)."""
    got = 0
    readinto = getattr(body, "readinto", None)
    while got < len(dst):
        if readinto is not None:
            n = await readinto(dst[got:])
        else:
            chunk = await body.read(min(len(dst) - got, 1 << 20))
            n = len(chunk)
            dst[got : got + n] = chunk
        if not n:
            break
        got += n
    return got


#: seconds an interrupted call gets to clean up (abort its multipart uploads) before the interrupt
#: propagates
_CANCEL_GRACE_S = 10.0


def _run_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], Awaitable[T]]) -> T:
    """Run `fn()` on the I/O loop's thread and wait for it here. Unlike fsspec's `sync`, an
    interrupt while waiting (Ctrl-C, SystemExit) cancels the coroutine and gives it a moment to
    clean up: an upload in progress aborts its parts instead of leaving them stored and billed. In a
    task of a pool that is stopping (`workpool.task_stopping`: the caller's thread got the Ctrl-C or
    SIGTERM, or another task failed) the call is cancelled the same way within a second: against a
    store that stopped answering, it would otherwise wait out its retries, minutes with the defaults,
    and the job would outlive Slurm's grace period before its kill."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:  # waiting here would block the very loop that has to do the work
        raise RuntimeError("a synchronous S3 store method was called from its own I/O loop; call it from a thread")
    finished = threading.Event()

    async def runner() -> T:
        try:
            return await fn()
        finally:
            finished.set()

    fut = asyncio.run_coroutine_threadsafe(runner(), loop)
    try:
        while not finished.wait(1):  # a timed wait, so a signal interrupts it
            if task_stopping():
                raise Stopped
    except BaseException:
        fut.cancel()
        finished.wait(_CANCEL_GRACE_S)
        raise
    return fut.result()


async def _all(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run coroutines concurrently; on the first failure cancel the rest and raise that failure
    (not an ExceptionGroup), so callers word one error."""
    if not coros:
        return []
    if len(coros) == 1:
        return [await coros[0]]
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except BaseExceptionGroup as eg:
        first = eg.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return [t.result() for t in tasks]


# -- S3 -------------------------------------------------------------------------------------------------

_FS_CACHE: dict[tuple[int, str], Any] = {}
_FS_CACHE_LOCK = threading.Lock()
_FS_CACHE_SIZE = 16


def _s3_filesystem(opts: dict) -> Any:
    """An S3FileSystem for `opts`, shared by the stores of this process that use the same options.
    Creating one costs 0.1-0.5 s on the first request (botocore loads the S3 service model) and
    throws away the connection pool; a checkpoint save or load opens several stores. Keyed by pid
    because a forked child must not reuse its parent's client and event loop."""
    try:
        token = json.dumps(opts, sort_keys=True)
    except TypeError:  # e.g. a caller-provided session object: do not share
        token = None
    key = (os.getpid(), token or "")
    if token is not None:
        with _FS_CACHE_LOCK:
            fs = _FS_CACHE.get(key)
        if fs is not None:
            return fs
    fs = fsspec.filesystem("s3", **opts)
    fs.retries = 1  # s3fs's own retry loop: off, see the module docstring
    if token is not None:
        with _FS_CACHE_LOCK:
            fs = _FS_CACHE.setdefault(key, fs)
            while len(_FS_CACHE) > _FS_CACHE_SIZE:
                _FS_CACHE.pop(next(iter(_FS_CACHE)))
    return fs


