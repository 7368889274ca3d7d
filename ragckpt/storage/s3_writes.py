"""The write side of `s3.S3Store`, as a base class it inherits: single PUTs, the conditional
create-if-absent PUT of commit markers (recognising its own landed write by a token), multipart
uploads (whole, and streamed part by part for `ragckpt.storage.upload`) with their abort and
their NoSuchUpload check. Split from `s3` to keep each module readable; it holds no state of its
own and relies on the store's request plumbing (`_run`, `_call`, `_worded`, `_head`, `_key`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence

from ragckpt.errors import DestinationExistsError, StorageError
from ragckpt.storage.base import Buffer
from ragckpt.storage.config import S3_MAX_PART, part_bytes_for
from ragckpt.storage.remote_base import _views
from ragckpt.storage.s3_io import (
    _TOKEN_META,
    _all,
    _body,
    _multipart_etag,
    _precondition_failed,
)
from ragckpt.storage.upload import StreamingUpload


class S3Writes:
    """Writes of an `S3Store` (see the module docstring); not a store by itself."""

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
