"""ragckpt's own I/O settings, kept apart from fsspec's storage options.

Users pass one `storage_options` dict (or `-o key=value` flags) per URL. Everything in it goes to
fsspec unchanged, except the nested `ragckpt` entry, which tunes ragckpt's I/O:

    storage_options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"},
                       "ragckpt": {"concurrency": 32, "retries": 5, "part_size": 16 << 20}}
    ragckpt verify s3://b/ckpt -o ragckpt.concurrency=32

The same settings can come from environment variables (`RAGCKPT_IO_CONCURRENCY`, ...), so a
training job can be tuned without code changes; an explicit storage option wins over the
environment. Keeping them out of fsspec's kwargs matters because s3fs forwards unknown kwargs to
botocore, which would reject them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from ragckpt.errors import StorageError
from ragckpt.sizes import parse_size

MiB = 1 << 20

#: S3 refuses multipart parts under 5 MiB (except the last) and uploads of more than 10,000 parts.
S3_MIN_PART = 5 * MiB
#: S3's largest part, and its largest single PUT
S3_MAX_PART = 5 << 30
S3_MAX_PARTS = 10_000


def part_bytes_for(size: int, preferred: int) -> int:
    """The part size for an object of `size` bytes: `preferred`, raised to S3's minimum part and to
    what keeps the object within S3's 10,000 parts (a 100 GiB file needs parts of 10.3 MiB)."""
    part = max(int(preferred), S3_MIN_PART, -(-int(size) // S3_MAX_PARTS))
    if part > S3_MAX_PART:
        raise StorageError(f"an object of {size} bytes does not fit S3's {S3_MAX_PARTS} parts of at most 5 GiB")
    return part

_ENV = {
    "concurrency": "RAGCKPT_IO_CONCURRENCY",
    "retries": "RAGCKPT_IO_RETRIES",
    "retry_delay": "RAGCKPT_IO_RETRY_DELAY",
    "throttle_retries": "RAGCKPT_IO_THROTTLE_RETRIES",
    "request_timeout": "RAGCKPT_IO_REQUEST_TIMEOUT",
    "part_size": "RAGCKPT_IO_PART_SIZE",
    "multipart_threshold": "RAGCKPT_IO_MULTIPART_THRESHOLD",
    "direct_io": "RAGCKPT_IO_DIRECT",
}


#: settings in bytes, which take units (`64MiB`)
_SIZES = frozenset({"part_size", "multipart_threshold"})


@dataclass(frozen=True)
class IOConfig:
    """I/O tuning (all but `direct_io` concern remote stores). Defaults suit S3 from one host: 16 requests in flight fill a 10-25 Gbit/s
    NIC. Objects up to 100 MiB go up in one PUT (as s3fs does: per-object parallelism matters little
    when every rank's objects are in flight at once, and a multipart upload costs three extra
    requests); larger ones, i.e. the 256 MiB chunk objects of big ranks, in 32 MiB parts that
    upload concurrently and are retried one by one, so a dropped connection costs one part."""

    #: requests in flight per store (part uploads, range reads, deletes); bounds memory and sockets
    concurrency: int = 16
    #: attempts per request, the first included (1 = never retry)
    retries: int = 5
    #: first backoff in seconds; doubles per attempt, with jitter
    retry_delay: float = 0.2
    #: backoff cap in seconds
    retry_max_delay: float = 5.0
    #: attempts per request while the store answers SlowDown / 429 / 503 (the first included): about
    #: a minute of backoff by default, the time S3 takes to scale a prefix for a burst of ranks
    throttle_retries: int = 10
    #: backoff cap in seconds while throttled; a longer Retry-After from the server is honoured up to it
    throttle_max_delay: float = 20.0
    #: seconds one attempt of a request may take, plus 1 s per MiB it moves, before it is abandoned
    #: and retried (a stalled connection otherwise hangs a save for good: S3 requests have no
    #: deadline of their own once the request is sent)
    request_timeout: float = 60.0
    #: multipart part size and the size of concurrent range reads of one large object
    part_size: int = 32 * MiB
    #: objects larger than this upload in parts (smaller ones with one PUT)
    multipart_threshold: int = 100 * MiB
    #: local paths: write large data objects with O_DIRECT, bypassing the page cache
    #: (ragckpt.storage.direct); falls back to buffered writes where the file system refuses it
    direct_io: bool = True

    def validate(self) -> IOConfig:
        if self.concurrency < 1:
            raise StorageError(f"ragckpt.concurrency must be >= 1, got {self.concurrency}")
        if self.retries < 1:
            raise StorageError(f"ragckpt.retries must be >= 1 (1 = no retry), got {self.retries}")
        if self.throttle_retries < 1:
            raise StorageError(f"ragckpt.throttle_retries must be >= 1 (1 = no retry), got {self.throttle_retries}")
        if min(self.retry_delay, self.retry_max_delay, self.throttle_max_delay) < 0:
            raise StorageError("ragckpt.retry_delay, retry_max_delay and throttle_max_delay must be >= 0")
        if not self.request_timeout > 0:
            raise StorageError(f"ragckpt.request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.part_size < S3_MIN_PART:
            raise StorageError(f"ragckpt.part_size must be >= {S3_MIN_PART} (S3's minimum part), got {self.part_size}")
        if self.part_size > S3_MAX_PART:
            raise StorageError(f"ragckpt.part_size must be <= {S3_MAX_PART} (S3's largest part), got {self.part_size}")
        if self.multipart_threshold > S3_MAX_PART:
            raise StorageError(f"ragckpt.multipart_threshold must be <= {S3_MAX_PART} (S3's largest single PUT), "
                               f"got {self.multipart_threshold}")
        if self.multipart_threshold < self.part_size:
            raise StorageError("ragckpt.multipart_threshold must be >= ragckpt.part_size")
        return self


def _coerce(name: str, value: Any) -> Any:
    want = {f.name: f.type for f in fields(IOConfig)}[name]
    if want in ("bool", bool):
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off"):
            return False
        raise StorageError(f"ragckpt.{name}: cannot use {value!r} (expected true or false)")
    try:
        if want in ("int", int):
            if isinstance(value, str):  # a size with its unit, or a plain count (0 included, for validate() to word)
                text = value.strip()
                if text.isdigit():  # not int(): it also takes "8_0" and "+8"
                    return int(text)
                if name in _SIZES:
                    return parse_size(text)
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        return float(value)
    except (TypeError, ValueError):
        kind = ("size such as 32MiB" if name in _SIZES
                else {"int": "whole number", "float": "number"}.get(str(getattr(want, "__name__", want)), str(want)))
        raise StorageError(f"ragckpt.{name}: cannot use {value!r} (expected a {kind})") from None


def io_config(storage_options: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None) -> IOConfig:
    """The effective IOConfig: defaults, then environment variables, then `storage_options['ragckpt']`."""
    env = os.environ if environ is None else environ
    cfg = IOConfig()
    updates: dict[str, Any] = {}
    from_env: list[str] = []  # named in any error: the user may not know they are set
    for name, var in _ENV.items():
        if env.get(var):
            try:
                updates[name] = _coerce(name, env[var])
            except StorageError as e:
                raise StorageError(f"environment variable {var}={env[var]!r}: {e}") from None
            from_env.append(f"{var}={env[var]}")
    own = (storage_options or {}).get("ragckpt") or {}
    if not isinstance(own, Mapping):
        raise StorageError(f"storage option 'ragckpt' must be a mapping of settings, got {own!r}")
    known = {f.name for f in fields(IOConfig)}
    for k, v in own.items():
        if k not in known:
            raise StorageError(f"unknown storage option 'ragckpt.{k}'; known: {', '.join(sorted(known))}")
        updates[k] = _coerce(k, v)
    try:
        return replace(cfg, **updates).validate()
    except StorageError as e:
        if not from_env:
            raise
        raise StorageError(f"{e} (the environment sets {', '.join(from_env)})") from None


def split_storage_options(storage_options: Mapping[str, Any] | None) -> tuple[dict[str, Any], IOConfig]:
    """(options for fsspec, ragckpt's IOConfig)."""
    opts = dict(storage_options or {})
    cfg = io_config(opts)
    opts.pop("ragckpt", None)
    return opts, cfg


def default_io_concurrency() -> int:
    """Objects/requests in flight when nothing else says: `RAGCKPT_IO_CONCURRENCY` or 16. Writers
    and readers that run their own thread pools over a store use this as their default width."""
    return io_config({}).concurrency
