"""fsspec-backed store for object storage (`s3://` via s3fs) and any other fsspec protocol.

Object stores give whole-object atomicity for free (a PUT is all or nothing), so writes go straight
to the final key. The commit marker uses a conditional put (`mode="create"`, If-None-Match) so two
jobs racing to commit the same checkpoint cannot both win.
"""

from __future__ import annotations

from collections.abc import Sequence

import fsspec

from ragckpt.errors import DestinationExistsError, StorageError
from ragckpt.storage.retry import with_retries
from ragckpt.storage.store import Buffer, Store


class FsspecStore(Store):
    def __init__(self, url: str, storage_options: dict):
        self.url = url.rstrip("/")
        opts = dict(storage_options)
        protocol = url.split("://", 1)[0]
        if protocol in ("s3", "s3a"):
            opts.setdefault("skip_instance_cache", True)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **opts)
        except (ImportError, ValueError) as e:
            raise StorageError(f"cannot open storage for {url}: {e}") from e
        self.root = self.root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def write(self, key: str, parts: Sequence[Buffer], *, create_only: bool = False) -> None:
        path = self._path(key)
        data = b"".join(memoryview(p).cast("B") for p in parts) if len(parts) != 1 else bytes(memoryview(parts[0]).cast("B"))
        if create_only:
            try:
                with_retries(lambda: self.fs.pipe_file(path, data, mode="create"), self.child(key))
            except (FileExistsError, DestinationExistsError):
                raise DestinationExistsError(f"{self.child(key)} already exists; another writer committed first") from None
            return
        with_retries(lambda: self.fs.pipe_file(path, data), self.child(key))

    def read(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return with_retries(lambda: self.fs.cat_file(path), self.child(key))
        except FileNotFoundError:
            raise StorageError(f"object {self.child(key)} is missing") from None

    def read_range(self, key: str, start: int, stop: int) -> bytes:
        path = self._path(key)
        try:
            data = with_retries(lambda: self.fs.cat_file(path, start=start, end=stop), self.child(key))
        except FileNotFoundError:
            raise StorageError(f"object {self.child(key)} is missing") from None
        if len(data) != stop - start:
            raise StorageError(f"object {self.child(key)} is truncated: wanted bytes [{start}, {stop}), got {len(data)}")
        return data

    def read_ranges(self, reqs: Sequence[tuple[str, int, int]]) -> list[bytes]:
        if not reqs:
            return []
        paths = [self._path(k) for k, _, _ in reqs]
        starts = [a for _, a, _ in reqs]
        ends = [b for _, _, b in reqs]
        out = with_retries(lambda: self.fs.cat_ranges(paths, starts, ends, on_error="return"), self.url)
        for (k, a, b), data in zip(reqs, out, strict=True):
            if isinstance(data, FileNotFoundError):
                raise StorageError(f"object {self.child(k)} is missing")
            if isinstance(data, BaseException):
                data = self.read_range(k, a, b)  # retried individually
            if len(data) != b - a:
                raise StorageError(f"object {self.child(k)} is truncated: wanted bytes [{a}, {b}), got {len(data)}")
        return out

    def exists(self, key: str) -> bool:
        return bool(with_retries(lambda: self.fs.exists(self._path(key)), self.child(key)))

    def size(self, key: str) -> int:
        try:
            return int(with_retries(lambda: self.fs.size(self._path(key)), self.child(key)))
        except FileNotFoundError:
            raise StorageError(f"object {self.child(key)} is missing") from None

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix)
        try:
            found = with_retries(lambda: self.fs.find(base), self.child(prefix))
        except FileNotFoundError:
            return []
        n = len(self.root) + 1
        return sorted(p[n:] for p in found)

    def delete_all(self) -> None:
        try:
            self.fs.rm(self.root, recursive=True)
        except FileNotFoundError:
            pass
