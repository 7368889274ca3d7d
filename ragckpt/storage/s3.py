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

The store is in this module; its write side in `s3_writes`, its helpers in `s3_io`, what it
shares with `fsspec_store.FsspecStore` in `remote_base`.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ragckpt.errors import AccessDeniedError, BadObjectError, DestinationExistsError, StorageError
from ragckpt.storage.config import S3_MAX_PART, S3_MAX_PARTS
from ragckpt.storage.remote_base import RemoteStore, T
from ragckpt.storage.retry import (
    TransientIOError,
    describe,
    error_code,
    retry_async,
)
from ragckpt.storage.s3_io import (
    _DENIED_HINT,
    _MISSING_CODES,
    _all,
    _denied,
    _no_credentials,
    _read_body_into,
    _run_on_loop,
    _s3_filesystem,
)
from ragckpt.storage.s3_writes import S3Writes

S3_PROTOCOLS = ("s3", "s3a")


class S3Store(S3Writes, RemoteStore):
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
