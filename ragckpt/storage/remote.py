"""Object storage behind the `Store` interface: `s3://` through s3fs (`ragckpt.storage.s3`: why S3
gets its own backend is told there), other protocols through fsspec
(`ragckpt.storage.fsspec_store`). This module picks between them (`open_remote`) and keeps the
names other modules import from it.
"""

from __future__ import annotations

from ragckpt.storage.base import Store
from ragckpt.storage.config import IOConfig
from ragckpt.storage.fsspec_store import ATOMIC_CREATE_PROTOCOLS, FsspecStore
from ragckpt.storage.remote_base import RemoteStore
from ragckpt.storage.s3 import S3_PROTOCOLS, S3Store
from ragckpt.storage.s3_io import ViewReader


def open_remote(url: str, storage_options: dict | None) -> Store:
    """The store for a non-local URL: `S3Store` for s3:// (and s3a://), `FsspecStore` otherwise."""
    protocol = url.split("://", 1)[0].lower()
    if protocol in S3_PROTOCOLS:
        return S3Store(url, storage_options or {})
    return FsspecStore(url, storage_options or {})


__all__ = ["ATOMIC_CREATE_PROTOCOLS", "S3_PROTOCOLS", "FsspecStore", "IOConfig", "RemoteStore", "S3Store", "ViewReader",
           "open_remote"]
