"""Any fsspec filesystem other than S3 (memory://, gcs://, az://, ...) behind the `Store` interface,
through fsspec's generic API."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec

from ragckpt.errors import BadObjectError, DestinationExistsError, StorageError
from ragckpt.storage.base import Buffer
from ragckpt.storage.remote_base import RemoteStore, T, _views
from ragckpt.storage.retry import (
    describe,
    with_retries,
)

#: fsspec protocols whose `pipe_file(mode="create")` is an atomic create-if-absent
ATOMIC_CREATE_PROTOCOLS = frozenset({"memory"})


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

