"""Object storage behind the `Store` interface: `s3://` through s3fs, other protocols through fsspec.

Why S3 gets its own backend instead of fsspec's generic calls:

* **Crash-safe commit.** A PUT is all-or-nothing, so data objects go straight to their final keys;
  the commit marker is a conditional PUT (`If-None-Match: *`) so that of two jobs committing one
  checkpoint exactly one wins. A retried conditional PUT whose first attempt landed but whose reply
  was lost comes back "412 Precondition Failed"; the marker carries a per-write token in its user
  metadata, so we recognise our own landed write instead of wrongly reporting a lost race.
* **One retry layer.** botocore and s3fs each retry on their own and the counts multiply; both are
  switched off here (unless the caller configures botocore's retries explicitly) and every request
  goes through `ragckpt.storage.retry` with a bounded number of attempts.
* **Throughput with bounded memory.** Every request of a store (part uploads, range reads, deletes)
  passes one semaphore of `ragckpt.concurrency` slots. Objects above `multipart_threshold` upload
  in parts read straight out of the caller's buffers (a file-like view, never one joined copy of
  the object); large reads are split into concurrent ranged GETs into one preallocated buffer.
* **Precise errors.** Every failure becomes one StorageError line naming the object's URL.

Everything runs as coroutines on s3fs's I/O loop; the synchronous `Store` methods are safe to call
from many threads at once (the checkpoint writer does).
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import hashlib
import json
import os
import threading
import uuid
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import fsspec

from ragckpt.errors import AccessDeniedError, BadObjectError, DestinationExistsError, StorageError
from ragckpt.storage.base import Buffer, Store, split_views
from ragckpt.storage.config import S3_MAX_PART, S3_MAX_PARTS, IOConfig, part_bytes_for, split_storage_options
from ragckpt.storage.retry import (
    TRANSIENT_CODES,
    RetryPolicy,
    TransientIOError,
    describe,
    error_code,
    exception_chain,
    http_status,
    retry_async,
    with_retries,
)
from ragckpt.storage.seekable import SeekableReader
from ragckpt.storage.upload import StreamingUpload
from ragckpt.workpool import Stopped, task_stopping

T = TypeVar("T")

S3_PROTOCOLS = ("s3", "s3a")
#: fsspec protocols whose `pipe_file(mode="create")` is an atomic create-if-absent
ATOMIC_CREATE_PROTOCOLS = frozenset({"memory"})
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


def open_remote(url: str, storage_options: dict | None) -> Store:
    """The store for a non-local URL: `S3Store` for s3:// (and s3a://), `FsspecStore` otherwise."""
    protocol = url.split("://", 1)[0].lower()
    if protocol in S3_PROTOCOLS:
        return S3Store(url, storage_options or {})
    return FsspecStore(url, storage_options or {})


# -- buffers ------------------------------------------------------------------------------------------

def _views(parts: Sequence[Buffer]) -> list[memoryview]:
    out = []
    for p in parts:
        mv = memoryview(p)
        if not mv.c_contiguous:
            raise ValueError("storage writes need C-contiguous buffers")
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        if len(mv):
            out.append(mv)
    return out


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


#: fsspec/s3fs options whose value is a mapping of settings (with a typical key, for the error message):
#: a plain string there (`-o client_kwargs=http://...`) would otherwise fail deep inside s3fs
_MAPPING_OPTIONS = {"client_kwargs": "endpoint_url", "config_kwargs": "connect_timeout",
                    "s3_additional_kwargs": "ServerSideEncryption"}


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


class RemoteStore(Store):
    """What every object-store backend shares: ragckpt's I/O settings, split off the fsspec options,
    and the retry policy built from them."""

    cfg: IOConfig
    policy: RetryPolicy
    concurrent_reads = True

    def _configure(self, storage_options: dict) -> dict:
        """Take ragckpt's own settings out of `storage_options`; returns the options for fsspec."""
        opts, self.cfg = split_storage_options(storage_options)
        for name, example in _MAPPING_OPTIONS.items():
            value = opts.get(name)
            if value is not None and not isinstance(value, Mapping):
                raise StorageError(f"storage option '{name}' must be a mapping of settings, got {value!r}; give "
                                   f"each setting on its own: -o {name}.{example}=... on the command line, "
                                   f"{{'{name}': {{'{example}': ...}}}} in Python")
        self.policy = RetryPolicy(self.cfg.retries, self.cfg.retry_delay, self.cfg.retry_max_delay,
                                  self.cfg.throttle_retries, self.cfg.throttle_max_delay)
        return opts

    def read_scatter_blocks(self, items: Sequence[tuple[str, int, Sequence[memoryview]]],
                            piece_bytes: int) -> Iterator[list[memoryview]]:
        """As `Store.read_scatter_blocks`, but in GETs of `part_size`, up to `ragckpt.concurrency` of
        them in flight together across objects, each streaming straight into its own view.
        An object store answers a request only after a round trip and moves one request's bytes at one
        connection's speed (about 100 MB/s on S3), so reading fetch after fetch, as local files do,
        held a restore to that: 60 MB/s per process against a server with S3's latency and
        per-connection rate (`latency_s`/`bandwidth` in tests/s3_fault_proxy.py), 140 MB/s with this,
        where the local S3 server itself tops out. Against that server with no latency the same
        restore went from 157 to 199 MB/s: 32 MiB GETs beat 64 MiB ones (its cost per GET grows with
        the object's size, not the range's, yet the smaller ones still won). All GETs are issued at
        once (the store's semaphore keeps `concurrency` of them going, a new one as soon as one
        ends) and the pieces are handed out once all have landed: verifying them then costs a pass
        over memory, nothing next to the network. A fetch that spans two views (none of ragckpt's
        readers asks for one) is read on its own through a staging buffer, so this allocates no
        memory."""
        span = max(piece_bytes, (self.cfg.part_size // piece_bytes) * piece_bytes)
        fetches = [(key, start + i * span, fetched) for key, start, views in items
                   for i, fetched in enumerate(split_views(views, span))]
        self.read_ranges_into([(key, start, fetched[0]) for key, start, fetched in fetches if len(fetched) == 1])
        for key, start, fetched in fetches:
            if len(fetched) > 1:
                self.read_into_views(key, start, fetched)
        for _, _, fetched in fetches:
            yield from split_views(fetched, piece_bytes)

    @property
    def fetch_bytes(self) -> int:
        # two parts per batch: enough GETs in flight to fill the link. Measured on a local S3 server,
        # load-time resharding ran 2-5x faster than with 4 MiB batches (and no slower than with four
        # parts), offline resharding 2x
        return 2 * self.cfg.part_size


class S3Store(RemoteStore):
    """`s3://bucket/prefix` via s3fs's authenticated aiobotocore client (credentials, endpoint,
    region, SSE settings all come from the usual AWS configuration or storage options)."""

    #: keys per listing request (S3's maximum); tests lower it to exercise pagination cheaply
    list_page_size = 1000

    #: largest object copied with one CopyObject (S3's limit), and the part size of larger copies;
    #: tests lower both to exercise multipart copies cheaply
    copy_whole_limit = S3_MAX_PART
    copy_part_bytes = 1 << 30

    def __init__(self, url: str, storage_options: dict):
        self._given = dict(storage_options)
        opts = self._configure(storage_options)
        protocol, _, path = url.partition("://")
        opts.setdefault("skip_instance_cache", True)
        config_kwargs = dict(opts.get("config_kwargs") or {})
        config_kwargs.setdefault("retries", {"total_max_attempts": 1})  # ragckpt.retries is the one retry layer
        config_kwargs.setdefault("max_pool_connections", max(10, self.cfg.concurrency))
        opts["config_kwargs"] = config_kwargs
        self._opts = opts
        try:
            self.fs = _s3_filesystem(opts)
        except (ImportError, ValueError, TypeError) as e:
            raise StorageError(f"cannot open storage for {url}: {e}") from e
        self._pid = os.getpid()
        if path.startswith("/"):
            # s3:///run/ck is "s3://$BUCKET/run/ck" with BUCKET unset: read as bucket 'run', an
            # --overwrite would empty that bucket's root
            raise StorageError(f"{url} names no bucket (nothing between s3:// and the next '/': an unset "
                               "variable?); use s3://bucket/prefix")
        bucket, _, prefix = path.strip("/").partition("/")
        if not bucket:
            raise StorageError(f"{url} names no bucket; use s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"{protocol}://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self._sem = asyncio.Semaphore(self.cfg.concurrency)

    # -- plumbing -------------------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _run(self, what: str, url: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run a coroutine on s3fs's loop and turn any failure into one StorageError line."""
        if os.getpid() != self._pid:  # forked: the parent's client, loop and semaphore are unusable
            self.fs = _s3_filesystem(self._opts)
            self._sem = asyncio.Semaphore(self.cfg.concurrency)
            self._pid = os.getpid()
        try:
            return _run_on_loop(self.fs.loop, fn)
        except (StorageError, DestinationExistsError):
            raise
        except Exception as e:  # noqa: BLE001 - worded for the user with the URL
            raise self._error(what, url, e) from e

    def _error(self, what: str, url: str, e: BaseException) -> StorageError:
        if isinstance(e, StorageError):
            return e
        if error_code(e) == "NoSuchBucket":
            return StorageError(f"cannot {what} {url}: bucket '{self.bucket}' does not exist")
        if error_code(e) == "NoSuchUpload":  # s3fs raises it as a FileNotFoundError: no missing object
            return StorageError(f"cannot {what} {url}: its multipart upload no longer exists (aborted meanwhile: "
                                "by another writer's clean-up, or a lifecycle rule)")
        if isinstance(e, FileNotFoundError) or error_code(e) in _MISSING_CODES:
            return BadObjectError(f"object {url} is missing")
        if _no_credentials(e):
            return AccessDeniedError(f"cannot {what} {url}: no S3 credentials found ({describe(e)}); set "
                                     "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), pass -o key=... "
                                     "-o secret=..., or -o anon=true for a public bucket")
        if _denied(e):
            return AccessDeniedError(f"cannot {what} {url}: access denied ({describe(e)}); {_DENIED_HINT} '{self.bucket}'")
        return StorageError(f"cannot {what} {url}: {describe(e)}")

    async def _worded(self, what: str, key: str, aw: Awaitable[T]) -> T:
        """Await one step of a batch, wording its failure with that object's own URL."""
        try:
            return await aw
        except (StorageError, DestinationExistsError):
            raise
        except Exception as e:  # noqa: BLE001 - worded for the user with the URL
            raise self._error(what, self.child(key), e) from e

    async def _call(self, url: str, method: str, make_body: Callable[[], Any] | None = None, *, moves: int = 0,
                    on_attempt: Callable[[], None] | None = None, **kw: Any) -> Any:
        """One S3 request under the store's concurrency bound, retried. `make_body` builds a fresh
        body per attempt (a half-read stream cannot be resent). `moves`: the bytes a request without
        a body moves all the same (a server-side copy), for its deadline. `on_attempt` is called as
        each attempt starts."""

        async def once() -> Any:
            if on_attempt is not None:
                on_attempt()
            args = dict(kw)
            nbytes = moves
            if make_body is not None:
                args["Body"] = make_body()
                nbytes = len(args["Body"])
            async with self._sem:
                return await self._deadline(self.fs._call_s3(method, Bucket=self.bucket, **args), nbytes)

        return await retry_async(once, url, self.policy)

    async def _deadline(self, aw: Awaitable[T], nbytes: int) -> T:
        """Await one request attempt for at most `request_timeout` + 1 s per MiB it moves; past
        that the connection is dropped and the attempt counts as a transient failure. Neither
        botocore nor aiohttp bound a request whose upload stopped draining."""
        limit = self.cfg.request_timeout + nbytes / (1 << 20)
        deadline = asyncio.timeout(limit)
        try:
            async with deadline:
                return await aw
        except TimeoutError:
            if not deadline.expired():  # the client's own timeout (aiohttp's), not ours
                raise
            raise TransientIOError(f"no reply within {limit:.0f} s (ragckpt.request_timeout)") from None

    async def _get(self, key: str, start: int | None = None, stop: int | None = None,
                   into: memoryview | None = None) -> tuple[bytes | memoryview, int]:
        """GET the object or bytes [start, stop) of it: (data, total object size). With `into`
        (a writable byte view of stop - start bytes), a body of exactly that length is streamed
        straight into it chunk by chunk and `into` is returned as the data: no joined copy of the
        body, and no second copy into the caller's memory. A body of another length (the object
        ends inside the range) is returned as bytes, for the caller to report."""
        kw: dict[str, Any] = {"Key": self._key(key)}
        if start is not None:
            kw["Range"] = f"bytes={start}-{stop - 1}"  # type: ignore[operator]

        async def fetch() -> tuple[dict, bytes | memoryview, int]:
            resp = await self.fs._call_s3("get_object", Bucket=self.bucket, **kw)
            body = resp["Body"]
            want = resp.get("ContentLength")
            try:
                if into is not None and want is not None and int(want) == len(into):
                    return resp, into, await _read_body_into(body, into)
                data = await body.read()
                return resp, data, len(data)
            finally:
                body.close()

        async def once() -> tuple[bytes | memoryview, int]:
            async with self._sem:
                resp, data, got = await self._deadline(fetch(), 0 if stop is None else stop - start)  # type: ignore[operator]
            want = resp.get("ContentLength")
            if want is not None and got != int(want):
                raise TransientIOError(f"connection ended after {got} of {want} bytes")
            total = got
            cr = resp.get("ContentRange")  # "bytes 0-99/1234"
            if cr and "/" in cr and cr.rsplit("/", 1)[1].isdigit():
                total = int(cr.rsplit("/", 1)[1])
            return data, total

        return await retry_async(once, self.child(key), self.policy)

    def _pieces(self, start: int, stop: int) -> list[tuple[int, int]]:
        p = self.cfg.part_size
        return [(a, min(stop, a + p)) for a in range(start, stop, p)]

    async def _read_range(self, key: str, start: int, stop: int) -> bytes | bytearray:
        """Bytes [start, stop) in a new buffer, the GET bodies streamed into it."""
        if stop <= start:
            return b""
        out = bytearray(stop - start)
        await self._read_range_into(key, start, memoryview(out))
        return out

    async def _get_range(self, key: str, start: int, stop: int, into: memoryview | None = None) -> bytes | memoryview:
        """One GET of bytes [start, stop) (into `into` when given); a StorageError when the object
        ends before `stop`."""
        try:
            data, total = await self._get(key, start, stop, into)
        except OSError as e:
            if error_code(e) != "InvalidRange":
                raise
            data, total = b"", await self._size(key)
        if len(data) != stop - start:
            raise BadObjectError(f"object {self.child(key)} is truncated: wanted bytes [{start}, {stop}), "
                               f"it holds {total}")
        return data

    async def _read_range_into(self, key: str, start: int, mv: memoryview) -> None:
        """Fill `mv` with the bytes at `start`: one GET up to two parts, else concurrent GETs of
        `part_size` pieces, each streamed into its slice of `mv`."""
        stop = start + len(mv)
        if stop <= start:
            return
        if len(mv) <= 2 * self.cfg.part_size:
            data = await self._get_range(key, start, stop, mv)
            if data is not mv:
                mv[:] = data
            return

        async def piece(a: int, b: int) -> None:
            await self._read_range_into(key, a, mv[a - start : b - start])

        await _all([piece(a, b) for a, b in self._pieces(start, stop)])

    def read_range_into(self, key: str, start: int, out: memoryview) -> None:
        """The GET bodies stream straight into `out` (see `_get`): a fetch costs the caller's
        buffer and aiohttp's small read buffer, not two more copies of the range."""
        mv = memoryview(out)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        self._run("read", self.child(key), lambda: self._read_range_into(key, start, mv))

    async def _read(self, key: str) -> bytes | bytearray:
        first = 2 * self.cfg.part_size
        try:
            data, total = await self._get(key, 0, first)
        except OSError as e:
            if error_code(e) != "InvalidRange":  # a ranged GET of an empty object
                raise
            data, total = await self._get(key)
        if total <= len(data):
            return data
        out = bytearray(total)
        out[: len(data)] = data
        await self._read_range_into(key, len(data), memoryview(out)[len(data) :])
        return out

    async def _head(self, key: str) -> dict | None:
        try:
            return await self._call(self.child(key), "head_object", Key=self._key(key))
        except FileNotFoundError:
            return None
        except OSError as e:
            if error_code(e) in _MISSING_CODES:
                return None
            raise

    async def _size(self, key: str) -> int:
        head = await self._head(key)
        if head is None:
            raise BadObjectError(f"object {self.child(key)} is missing")
        return int(head["ContentLength"])

    # -- writes -------------------------------------------------------------------------------------------
    def write(self, key: str, parts: Sequence[Buffer], *, create_only: bool = False, atomic: bool = False) -> None:
        # a PUT replaces an object whole: every write is atomic
        self._run("write", self.child(key), lambda: self._write(key, parts, create_only))

    def write_many(self, items: Iterable[tuple[str, Sequence[Buffer]]]) -> None:
        """All objects at once, under the store's concurrency bound."""
        todo = list(items)
        if todo:
            self._run("write", self.url, lambda: _all([self._worded("write", k, self._write(k, p, False))
                                                       for k, p in todo]))

    async def _write(self, key: str, parts: Sequence[Buffer], create_only: bool) -> None:
        views = _views(parts)
        n = sum(len(v) for v in views)
        url = self.child(key)
        if create_only:
            if n > S3_MAX_PART:
                raise StorageError(f"cannot write {url}: a create-if-absent object must fit one PUT (5 GiB)")
            data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(views)
            await self._put_create(key, data)
        elif n > self.cfg.multipart_threshold:
            await self._put_multipart(key, views, n)
        else:
            await self._call(url, "put_object", lambda: _body(parts, views, 0, n), Key=self._key(key))

    async def _put_create(self, key: str, data: bytes) -> None:
        """Conditional PUT tagged with a random token in the object's user metadata. '412
        Precondition Failed' means the object exists; it is still our write when it carries our
        token: an earlier attempt landed and only its reply was lost (retried by us, or silently by
        aiohttp on a reset pooled connection). Comparing bytes would not do: two jobs committing
        the same checkpoint in the same second write identical markers."""
        url = self.child(key)
        token = uuid.uuid4().hex

        try:
            await self._call(url, "put_object", lambda: data, Key=self._key(key), Metadata={_TOKEN_META: token},
                             IfNoneMatch="*")
        except Exception as e:  # noqa: BLE001 - only "the object exists" is handled here
            if not _precondition_failed(e):
                raise
            head = await self._head(key)
            if head is not None and (head.get("Metadata") or {}).get(_TOKEN_META) == token:
                return
            raise DestinationExistsError(f"{url} already exists; another writer committed first") from None

    async def _put_multipart(self, key: str, views: list[memoryview], n: int) -> None:
        async def one(k: str, uid: str, i: int, a: int, b: int) -> str:
            return await self.upload_part(key, uid, i, views, a, b)

        await self._multipart(key, n, part_bytes_for(n, self.cfg.part_size), one)

    async def _multipart(self, key: str, n: int, part: int,
                         send: Callable[[str, str, int, int, int], Awaitable[str]]) -> None:
        """A multipart upload of `n` bytes in parts of `part` bytes sent concurrently by
        `send(s3_key, upload_id, part_number, start, stop) -> ETag`; aborted on any failure."""
        k = self._key(key)
        uid = await self._create_multipart(key)
        try:
            starts = range(0, n, part)
            etags = await _all([send(k, uid, i + 1, a, min(n, a + part)) for i, a in enumerate(starts)])
            await self._complete_multipart(key, uid, etags, n)
        except BaseException:
            await self._abort(k, uid)
            raise

    async def _create_multipart(self, key: str) -> str:
        """A new upload's id. Creating is not idempotent: when an attempt fails after the server
        created its upload (a lost reply, a timeout), the retry creates a second one, and the first,
        whose id was never seen, would stay open for good. So after a retried create, the key's other
        unfinished uploads are aborted (no two writers ever write one object)."""
        attempts = []
        mpu = await self._call(self.child(key), "create_multipart_upload", on_attempt=lambda: attempts.append(1),
                               Key=self._key(key))
        if len(attempts) > 1:
            await self._abort_uploads(self._key(key), key=self._key(key), keep=mpu["UploadId"])
        return mpu["UploadId"]

    async def _complete_multipart(self, key: str, uid: str, etags: Sequence[str], n: int) -> None:
        done = [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]
        try:
            await self._call(self.child(key), "complete_multipart_upload", Key=self._key(key), UploadId=uid,
                             MultipartUpload={"Parts": done})
        except FileNotFoundError:
            await self._check_completed(key, n, list(etags))

    # -- streamed multipart uploads (ragckpt.storage.upload): one step at a time, from the writer's thread
    def upload_stream(self, key: str, size: int, *, part_bytes: int | None = None, buffers: int = 2,
                      defer_complete: bool = False) -> StreamingUpload:
        """An object of `size` bytes written in order from at most `buffers` reused part buffers of
        about `part_bytes` (default `ragckpt.part_size`), so memory does not grow with the object.
        `defer_complete`: `close` sends it, `complete` makes it visible."""
        return StreamingUpload(self, key, size, part_bytes=part_bytes or self.cfg.part_size, buffers=buffers,
                               defer_complete=defer_complete)

    def start_multipart(self, key: str) -> str:
        return self._run("write", self.child(key), lambda: self._create_multipart(key))

    async def upload_part(self, key: str, uid: str, number: int, views: Sequence[memoryview], start: int = 0,
                          stop: int | None = None) -> str:
        """Send bytes [start, stop) of the concatenated `views` as part `number` (a coroutine for the
        store's loop); its ETag. The body is streamed out of the views without a joined copy."""
        stop = sum(len(v) for v in views) if stop is None else stop
        url = self.child(key)
        out = await self._worded("write", key, self._call(f"{url} (part {number})", "upload_part",
                                                          lambda: _body(views, views, start, stop),
                                                          Key=self._key(key), UploadId=uid, PartNumber=number))
        return out["ETag"]

    def complete_multipart(self, key: str, uid: str, etags: Sequence[str], size: int) -> None:
        self._run("write", self.child(key), lambda: self._complete_multipart(key, uid, etags, size))

    def abort_multipart(self, key: str, uid: str) -> None:
        """Best effort, never raises: see `_abort`."""
        try:
            self._run("abort the upload of", self.child(key), lambda: self._abort(self._key(key), uid))
        except Exception:  # noqa: BLE001 - the caller is already handling the failure that led here
            pass

    async def _check_completed(self, key: str, n: int, part_etags: list[str]) -> None:
        """CompleteMultipartUpload answered NoSuchUpload. Either our own earlier attempt completed
        it and only the reply was lost, or the upload was aborted behind our back (another job's
        overwrite aborting the uploads under the prefix, a lifecycle rule) and whatever sits at the
        key is older: a previous save's object of the same size, say. Only an object whose ETag is
        the one these parts compose to is ours."""
        url = self.child(key)
        head = await self._head(key)
        expected = _multipart_etag(part_etags)
        found = str((head or {}).get("ETag") or "").strip().strip('"').lower()
        if head is not None and expected is not None and found == expected.lower() and int(head["ContentLength"]) == n:
            return
        if head is None:
            there = "no object is there"
        elif expected is None:
            there = "the server's part ETags are not MD5s, so the object there cannot be told from an older one"
        else:
            there = f"the object there ({int(head['ContentLength'])} bytes, ETag {found or '?'}) is not this write's"
        raise StorageError(f"cannot write {url}: its multipart upload was aborted by another writer before it "
                           f"completed (NoSuchUpload) and {there}; retry the save")

    async def _abort(self, k: str, uid: str) -> None:
        """Best effort: an upload left behind costs storage until a lifecycle rule removes it. Tried
        three times, since a server can fail the abort while the upload's other parts still land
        (moto answered 500 in about one Ctrl-C test run in four); not through `_call`, whose
        concurrency slots the interrupted parts may still hold."""
        for attempt in range(3):
            try:
                await asyncio.shield(self.fs._call_s3("abort_multipart_upload", Bucket=self.bucket, Key=k,
                                                      UploadId=uid))
                return
            except Exception:  # noqa: BLE001 - the original error matters more
                await asyncio.sleep(0.2 * (attempt + 1))

    # -- server-side copies: setting a destination aside ------------------------------------------------
    def sibling(self, suffix: str) -> S3Store:
        """The store whose prefix is this one's with `suffix` appended (`s3://b/ck` + `.old` ->
        `s3://b/ck.old`): same bucket, same settings."""
        if not self.prefix:
            raise StorageError(f"{self.url} is a bucket's root and has no sibling prefix")
        return S3Store(self.url + suffix, self._given)

    def siblings(self, infix: str) -> list[str]:
        """URLs of the prefixes beside this one whose names are this one's followed by `infix` and
        more (`s3://b/ck.replaced-1f2e...` for `.replaced-`). A bucket's root has none."""
        if not self.prefix:
            return []
        scheme = self.url.partition("://")[0]

        async def listing() -> list[str]:
            out: list[str] = []
            kw: dict[str, Any] = {"Prefix": self.prefix + infix, "Delimiter": "/", "MaxKeys": self.list_page_size}
            while True:
                resp = await self._call(f"{self.url} (listing)", "list_objects_v2", **kw)
                out.extend(p["Prefix"].rstrip("/") for p in resp.get("CommonPrefixes", []))
                if not resp.get("IsTruncated"):
                    return out
                kw["ContinuationToken"] = resp["NextContinuationToken"]

        return [f"{scheme}://{self.bucket}/{p}" for p in sorted(self._run("list", self.url, listing))]

    def copy_in(self, src: S3Store, sizes: Mapping[str, int], *, last: Sequence[str] = ()) -> None:
        """Copy `src`'s objects (key -> size, keys relative to each store's prefix) to the same keys
        here, server-side: no bytes pass through this host. Those in `last` are copied after all
        the others, so a commit marker lands only once what it covers is there."""
        first = [k for k in sizes if k not in last]
        then = [k for k in last if k in sizes]

        async def run() -> None:
            await _all([self._worded("copy", k, self._copy(src, k, sizes[k])) for k in first])
            for k in then:
                await self._worded("copy", k, self._copy(src, k, sizes[k]))

        self._run("copy", self.url, run)

    async def _copy(self, src: S3Store, key: str, n: int) -> None:
        source = {"Bucket": src.bucket, "Key": src._key(key)}
        if n <= self.copy_whole_limit:
            await self._call(self.child(key), "copy_object", Key=self._key(key), CopySource=source, moves=n)
            return

        part = max(self.copy_part_bytes, -(-n // S3_MAX_PARTS))
        await self._multipart(key, n, part, functools.partial(self._copy_part, key, source))

    async def _copy_part(self, key: str, source: dict, k: str, uid: str, i: int, a: int, b: int) -> str:
        out = await self._call(f"{self.child(key)} (part {i})", "upload_part_copy", Key=k, UploadId=uid,
                               PartNumber=i, CopySource=source, CopySourceRange=f"bytes={a}-{b - 1}", moves=b - a)
        return out["CopyPartResult"]["ETag"]

    # -- reads ---------------------------------------------------------------------------------------------
    def read(self, key: str) -> bytes:
        return self._run("read", self.child(key), lambda: self._read(key))  # type: ignore[return-value]

    def read_range(self, key: str, start: int, stop: int) -> bytes:
        return self._run("read", self.child(key), lambda: self._read_range(key, start, stop))  # type: ignore[return-value]

    def _ranges_url(self, reqs: Sequence[tuple[str, Any, Any]]) -> str:
        """What a failed batch of range reads names: its object, or the store and the count."""
        return self.child(reqs[0][0]) if len({k for k, _, _ in reqs}) == 1 else f"{self.url} ({len(reqs)} ranges)"

    def read_ranges_into(self, reqs: Sequence[tuple[str, int, memoryview]]) -> None:
        if not reqs:
            return
        what = self._ranges_url(reqs)
        self._run("read", what, lambda: _all([self._worded("read", k, self._read_range_into(k, a, v))
                                              for k, a, v in reqs]))

    def read_ranges(self, reqs: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """All ranges concurrently (bounded by `ragckpt.concurrency`); results in request order."""
        if not reqs:
            return []
        what = self._ranges_url(reqs)
        return self._run("read", what, lambda: _all([self._worded("read", k, self._read_range(k, a, b))
                                                      for k, a, b in reqs]))  # type: ignore[return-value]

    def read_many(self, keys: Sequence[str]) -> list[bytes]:
        if not keys:
            return []
        return self._run("read", f"{self.url} ({len(keys)} objects)",
                         lambda: _all([self._worded("read", k, self._read(k)) for k in keys]))  # type: ignore[return-value]

    def exists(self, key: str) -> bool:
        return self._run("check", self.child(key), lambda: self._head(key)) is not None

    def size(self, key: str) -> int:
        return self._run("stat", self.child(key), lambda: self._size(key))

    def check_root(self) -> None:
        async def head_bucket() -> None:
            try:
                await self._call(self.url, "head_bucket")
            except OSError as e:
                if isinstance(e, FileNotFoundError) or error_code(e) in _MISSING_CODES | {"NoSuchBucket"}:
                    raise StorageError(f"cannot open {self.url}: bucket '{self.bucket}' does not exist") from None
                raise

        self._run("check", self.url, head_bucket)

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self.list_sizes(prefix))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        root = f"{self.prefix}/" if self.prefix else ""
        base = f"{root}{prefix.strip('/')}/" if prefix else root
        objs = self._run("list", self.child(prefix) if prefix else self.url, lambda: self._list_objects(base))
        return {k[len(root):]: n for k, n in objs if not k.endswith("/")}

    async def _list_objects(self, base: str) -> list[tuple[str, int]]:
        """(key, size) of every object under `base`, page by page."""
        out: list[tuple[str, int]] = []
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Prefix": base, "MaxKeys": self.list_page_size}
            if token:
                kw["ContinuationToken"] = token
            resp = await self._call(f"{self.url} (listing)", "list_objects_v2", **kw)
            out.extend((o["Key"], int(o["Size"])) for o in resp.get("Contents", []))
            if not resp.get("IsTruncated"):
                return out
            token = resp["NextContinuationToken"]

    def delete(self, key: str) -> None:
        # a missing key is no error for DeleteObject
        self._run("delete", self.child(key), lambda: self._call(self.child(key), "delete_object", Key=self._key(key)))

    def _delete_rest(self, keep: set[str]) -> None:
        """Delete every object under the prefix but `keep` (and abort unfinished multipart uploads)."""
        root = f"{self.prefix}/" if self.prefix else ""
        self._run("delete", self.url, lambda: self._delete_listed(root, {self._key(k) for k in keep}))

    def delete_many(self, keys: Sequence[str]) -> None:
        if keys:
            self._run("delete", self.url, lambda: self._delete_keys([self._key(k) for k in keys]))

    async def _delete_keys(self, keys: list[str]) -> None:
        """DeleteObjects, 1,000 keys a request (S3's maximum), the requests concurrent."""

        async def batch(ks: list[str]) -> None:
            resp = await self._call(f"{self.url} (delete)", "delete_objects",
                                    Delete={"Objects": [{"Key": k} for k in ks], "Quiet": True})
            errs = resp.get("Errors") or []
            if errs:
                e = errs[0]
                raise StorageError(f"cannot delete s3://{self.bucket}/{e.get('Key')}: {e.get('Code')}: "
                                   f"{e.get('Message')} ({len(errs)} objects failed)")

        await _all([batch(keys[i : i + 1000]) for i in range(0, len(keys), 1000)])

    async def _delete_listed(self, root: str, keep: set[str]) -> None:
        try:
            keys = [k for k, _ in await self._list_objects(root) if k not in keep]
        except FileNotFoundError:
            return
        await self._delete_keys(keys)
        await self._abort_uploads(root)

    async def _abort_uploads(self, prefix: str, *, key: str | None = None, keep: str | None = None) -> None:
        """Abort the unfinished multipart uploads under full key `prefix` (only those of `key`, if
        given; never upload `keep`). Best effort: a leftover costs storage, not correctness."""
        try:  # page by page: a prefix that many killed saves wrote into can hold thousands
            kw: dict[str, Any] = {"Prefix": prefix, "MaxUploads": self.list_page_size}
            while True:
                resp = await self._call(f"{self.url} (uploads)", "list_multipart_uploads", **kw)
                await _all([self._abort(u["Key"], u["UploadId"]) for u in resp.get("Uploads", [])
                            if (key is None or u["Key"] == key) and u["UploadId"] != keep])
                if not resp.get("IsTruncated") or not resp.get("NextKeyMarker"):
                    break
                kw.update(KeyMarker=resp["NextKeyMarker"], UploadIdMarker=resp.get("NextUploadIdMarker", ""))
        except Exception:  # noqa: BLE001 - leftovers are harmless to correctness
            pass

    def _tuned(self, **io: object) -> S3Store:
        """This store with other `ragckpt.*` I/O settings."""
        given = dict(self._given)
        given["ragckpt"] = {**dict(given.get("ragckpt") or {}), **io}
        return S3Store(self.url, given)

    def hurried(self) -> S3Store:
        return self._tuned(retries=1, throttle_retries=1, request_timeout=5)

    def abort_uploads(self, *, hurried: bool = False) -> None:
        """Abort the unfinished multipart uploads of a checkpoint's data under this store's prefix
        (`buffers/`, `meta/`; at a bucket's root, nothing beside them): what the writers of a failed
        job (a worker process stopped mid-upload) left behind, or earlier interrupted jobs into the
        same destination. Only for a destination no one else is writing into. Quick (two attempts,
        15 s each): it runs after a failure, which may well be the store's, and the user is waiting
        for that error; `hurried` (after a Ctrl-C or SIGTERM, which a kill may follow within
        seconds) makes it one attempt of 5 s."""
        root = f"{self.prefix}/" if self.prefix else ""
        quick = self.hurried() if hurried else self._tuned(retries=2, throttle_retries=2, request_timeout=15)

        async def sweep() -> None:
            await _all([quick._abort_uploads(root + sub) for sub in ("buffers/", "meta/")])

        quick._run("abort the uploads under", self.url, sweep)


# -- any other fsspec protocol --------------------------------------------------------------------------

class FsspecStore(RemoteStore):
    """Any fsspec filesystem (memory://, gcs://, az://, ...) through fsspec's generic API. Writes
    join their parts into one buffer (the generic API has no streaming body); the commit marker uses
    `pipe_file(mode="create")`, which is atomic only where the filesystem makes it so."""

    _warned: set[str] = set()

    def __init__(self, url: str, storage_options: dict):
        opts = self._configure(storage_options)
        self.url = url.rstrip("/")
        self.protocol = url.split("://", 1)[0].lower()
        self.atomic_create = self.protocol in ATOMIC_CREATE_PROTOCOLS
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **opts)
        except (ImportError, ValueError, TypeError) as e:
            raise StorageError(f"cannot open storage for {url}: {e}") from e
        self.root = self.root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _do(self, what: str, key: str, fn: Callable[[], T]) -> T:
        url = self.child(key) if key else self.url
        try:
            return with_retries(fn, url, policy=self.policy)
        except (StorageError, DestinationExistsError):
            raise
        except FileNotFoundError as e:
            raise BadObjectError(f"object {url} is missing") from e
        except Exception as e:  # noqa: BLE001 - worded for the user with the URL
            raise StorageError(f"cannot {what} {url}: {describe(e)}") from e

    def write(self, key: str, parts: Sequence[Buffer], *, create_only: bool = False, atomic: bool = False) -> None:
        # pipe_file sends the object whole (`atomic` holds wherever the filesystem's own write does)
        path = self._path(key)
        views = _views(parts)
        data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(views)
        parent = path.rsplit("/", 1)[0]
        if parent and parent != path:
            try:
                self.fs.makedirs(parent, exist_ok=True)
            except Exception:  # noqa: BLE001 - object stores have no directories
                pass
        if not create_only:
            self._do("write", key, lambda: self.fs.pipe_file(path, data))
            return
        if self.protocol not in ATOMIC_CREATE_PROTOCOLS and self.protocol not in FsspecStore._warned:
            FsspecStore._warned.add(self.protocol)
            warnings.warn(f"{self.protocol}:// has no known atomic create-if-absent in fsspec: two jobs committing "
                          "the same checkpoint at the same moment might both succeed", stacklevel=2)
        try:
            self._do("write", key, lambda: self.fs.pipe_file(path, data, mode="create"))
        except StorageError as e:
            if isinstance(e.__cause__, FileExistsError):
                raise DestinationExistsError(f"{self.child(key)} already exists; another writer committed first") from None
            raise

    def read(self, key: str) -> bytes:
        return self._do("read", key, lambda: self.fs.cat_file(self._path(key)))

    def read_range(self, key: str, start: int, stop: int) -> bytes:
        if stop <= start:
            return b""
        data = self._do("read", key, lambda: self.fs.cat_file(self._path(key), start=start, end=stop))
        if len(data) != stop - start:
            raise BadObjectError(f"object {self.child(key)} is truncated: wanted bytes [{start}, {stop}), got {len(data)}")
        return data

    def _concurrently(self, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        """`fn` over `items` with up to `ragckpt.concurrency` requests in flight, results in order."""
        if len(items) <= 1:
            return [fn(x) for x in items]
        with ThreadPoolExecutor(min(self.cfg.concurrency, len(items))) as ex:
            return list(ex.map(fn, items))

    def read_ranges(self, reqs: Sequence[tuple[str, int, int]]) -> list[bytes]:
        return self._concurrently(lambda r: self.read_range(*r), reqs)

    def read_ranges_into(self, reqs: Sequence[tuple[str, int, memoryview]]) -> None:
        self._concurrently(lambda r: self.read_range_into(*r), reqs)

    def read_many(self, keys: Sequence[str]) -> list[bytes]:
        return self._concurrently(self.read, keys)

    def exists(self, key: str) -> bool:
        return bool(self._do("check", key, lambda: self.fs.exists(self._path(key))))

    def size(self, key: str) -> int:
        return int(self._do("stat", key, lambda: self.fs.size(self._path(key))))

    def check_root(self) -> None:
        # fsspec's exists() answers False for any failure (an HTTP server that is down, say); listing
        # the root raises the real error
        try:
            self.fs.ls(self.root)
        except FileNotFoundError:
            return
        except Exception as e:  # noqa: BLE001 - worded for the user with the URL
            raise StorageError(f"cannot reach {self.url}: {describe(e)}") from e

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self.list_sizes(prefix))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """One listing with sizes (`find(detail=True)`), not a size request per object."""
        base = self._path(prefix.strip("/"))
        try:
            found = self._do("list", prefix, lambda: self.fs.find(base, detail=True))
        except StorageError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                return {}
            raise
        n = len(self.root) + 1
        return {p[n:]: int(info.get("size") or 0) for p, info in found.items() if p.startswith(self.root + "/")}

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            if self.fs.exists(path):
                self._do("delete", key, lambda: self.fs.rm_file(path))
        except StorageError as e:
            if not isinstance(e.__cause__, FileNotFoundError):
                raise

    def _delete_rest(self, keep: set[str]) -> None:
        # kept keys are top-level objects: everything else at the top goes, recursively
        try:
            if not self.fs.exists(self.root):
                return
            for entry in self._do("list", "", lambda: self.fs.ls(self.root, detail=False)):
                path = entry.rstrip("/")
                if path.rsplit("/", 1)[-1] not in keep:
                    self._do("delete", "", lambda path=path: self.fs.rm(path, recursive=True))
        except StorageError as e:
            if not isinstance(e.__cause__, FileNotFoundError):
                raise


__all__ = ["FsspecStore", "IOConfig", "S3Store", "ViewReader", "open_remote"]
