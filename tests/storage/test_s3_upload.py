"""Streamed S3 uploads (`S3Store.upload_stream`, used by export-hf): an object written in order from
a few reused part buffers against moto's real S3 server, directly and through the fault proxy.
The bytes read back are the bytes written; nothing is visible before `close`; a short, long or
failed upload stores nothing and leaves no multipart upload behind."""

from __future__ import annotations

import os
import random

import pytest

from ragckpt.errors import StorageError
from ragckpt.storage.config import S3_MIN_PART, part_bytes_for
from ragckpt.storage.store import open_store

MiB = 1 << 20


def _uploads_left(target) -> list:
    return target.fs().call_s3("list_multipart_uploads", Bucket=target.bucket).get("Uploads") or []


def _write_in_pieces(up, data: bytes, seed: int) -> None:
    rng = random.Random(seed)
    pos = 0
    while pos < len(data):
        n = rng.choice([1, 7, 4096, 300_001, 3 * MiB, 6 * MiB])
        up.write(memoryview(data)[pos : pos + n])
        pos += n


@pytest.mark.parametrize("size", [0, 1, 5 * MiB, 5 * MiB + 1, 16 * MiB + 12_345])
def test_streamed_upload_stores_exactly_the_bytes_written(s3, size):
    store = open_store(s3.url, s3.storage_options)
    data = os.urandom(size)
    up = store.upload_stream("obj.bin", size, part_bytes=S3_MIN_PART, buffers=2)
    _write_in_pieces(up, data, size)
    assert not s3.fs().exists(f"{s3.url}/obj.bin"), "visible before close"
    up.close()
    assert s3.fs().cat_file(f"{s3.url}/obj.bin") == data
    # at most `buffers` part buffers ever existed (a 16 MiB object in 5 MiB parts needs 4 parts)
    assert up._allocated <= (1 if size <= S3_MIN_PART else 2)
    etag = s3.fs().info(f"{s3.url}/obj.bin")["ETag"]
    assert ("-" in etag) == (size > S3_MIN_PART), etag  # multipart exactly when it needs more than one part
    assert not _uploads_left(s3)


def test_part_size_grows_to_keep_within_s3s_part_count():
    assert part_bytes_for(10, 1) == S3_MIN_PART
    assert part_bytes_for(100 << 30, 5 * MiB) == -(-(100 << 30) // 10_000)
    assert part_bytes_for(1 << 30, 64 * MiB) == 64 * MiB
    with pytest.raises(StorageError, match="10000 parts"):
        part_bytes_for(60_000 << 30, 5 * MiB)


def test_a_short_or_long_upload_stores_nothing(s3):
    store = open_store(s3.url, s3.storage_options)
    data = os.urandom(12 * MiB)
    up = store.upload_stream("short.bin", len(data) + 1, part_bytes=S3_MIN_PART)
    up.write(data)  # two parts sent already
    with pytest.raises(StorageError, match=r"short\.bin: 12582912 of its 12582913 bytes were written; nothing"):
        up.close()
    up = store.upload_stream("long.bin", len(data) - 1, part_bytes=S3_MIN_PART)
    with pytest.raises(StorageError, match=r"long\.bin: 12582912 bytes written to an object declared as 12582911"):
        up.write(data)
    assert up.closed
    fs = s3.fs()
    assert not fs.exists(f"{s3.url}/short.bin") and not fs.exists(f"{s3.url}/long.bin")
    assert not _uploads_left(s3)


def test_throttled_and_dropped_parts_are_retried_to_the_exact_bytes(s3_faulty):
    url, opts, proxy, direct = s3_faulty
    store = open_store(url, opts)
    data = os.urandom(21 * MiB + 3)
    proxy.configure(error_rate=0.4, drop_rate=0.3, methods={"PUT", "POST"}, seed=3)
    up = store.upload_stream("obj.bin", len(data), part_bytes=S3_MIN_PART, buffers=3)
    _write_in_pieces(up, data, 1)
    up.close()
    assert proxy.stats.faults >= 2, proxy.stats
    proxy.configure()
    assert direct.fs().cat_file(f"{direct.url}/obj.bin") == data
    assert not _uploads_left(direct)


def test_a_part_that_keeps_failing_names_it_and_aborts_the_upload(s3_faulty):
    url, opts, proxy, direct = s3_faulty
    opts = {**opts, "ragckpt": {**opts["ragckpt"], "retries": 2, "throttle_retries": 2}}
    store = open_store(url, opts)
    data = os.urandom(16 * MiB)
    proxy.configure(fail_all=True, methods={"PUT"}, path_regex="partNumber=2")
    up = store.upload_stream("obj.bin", len(data), part_bytes=S3_MIN_PART, buffers=2)
    with pytest.raises(StorageError, match=r"obj\.bin \(part 2\): giving up after 2 attempts"):
        up.write(data)  # the fourth part needs part 2's buffer back
        up.close()
    assert up.closed  # aborted by the failure itself
    proxy.configure()
    assert not direct.fs().exists(f"{direct.url}/obj.bin")
    assert not _uploads_left(direct)


def test_an_interrupt_while_waiting_for_a_part_stops_every_part_before_the_abort(s3_faulty, monkeypatch):
    """Ctrl-C while the writer waits for its oldest part (to reuse the buffer): every part that had
    started sending has stopped when `abort` returns, the one waited for included (it used to be
    off the queue already, and went on uploading against the aborted upload for seconds)."""
    from ragckpt.storage import upload as upload_mod

    url, opts, proxy, direct = s3_faulty
    store = open_store(url, opts)
    parts: list = []

    class Recorded(upload_mod._Part):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            parts.append(self)

    def interrupted(fut):
        raise KeyboardInterrupt

    monkeypatch.setattr(upload_mod, "_Part", Recorded)
    monkeypatch.setattr(upload_mod.StreamingUpload, "_wait", staticmethod(interrupted))
    proxy.configure(stall=True, stall_s=20, methods={"PUT"}, path_regex="partNumber=1")
    up = store.upload_stream("obj.bin", 16 * MiB, part_bytes=S3_MIN_PART, buffers=2)
    with pytest.raises(KeyboardInterrupt):
        up.write(os.urandom(16 * MiB))  # parts 1 and 2 sent; the third needs part 1's buffer
    assert len(parts) == 2 and parts[0].started.is_set(), parts
    assert all(p.finished.is_set() for p in parts if p.started.is_set())
    with pytest.raises(StorageError, match="aborted after an earlier failure"):
        up.close()
    proxy.configure()
    assert not direct.fs().exists(f"{direct.url}/obj.bin")
    assert not _uploads_left(direct)


@pytest.mark.parametrize("size", [0, 3, 5 * MiB, 11 * MiB + 5])
def test_a_deferred_upload_is_sent_by_close_and_visible_only_after_complete(s3, size):
    """`defer_complete`: `close` sends every part (an object under one part as a one-part multipart
    upload, so no buffer is kept), nothing is visible until `complete`, and `abort` after `close`
    still stores nothing."""
    store = open_store(s3.url, s3.storage_options)
    data = os.urandom(size)
    up = store.upload_stream("d.bin", size, part_bytes=S3_MIN_PART, defer_complete=True)
    _write_in_pieces(up, data, size)
    up.close()
    assert up._cur is None and not up._pending  # no part buffer held while it waits
    assert not s3.fs().exists(f"{s3.url}/d.bin"), "visible before complete"
    assert bool(_uploads_left(s3)) == (size > 0)  # the parts wait on the server
    up.complete()
    s3.fs().invalidate_cache()
    assert s3.fs().cat_file(f"{s3.url}/d.bin") == data
    assert not _uploads_left(s3)

    gone = store.upload_stream("gone.bin", size, part_bytes=S3_MIN_PART, defer_complete=True)
    _write_in_pieces(gone, data, size + 1)
    gone.close()
    gone.abort()
    s3.fs().invalidate_cache()
    assert not s3.fs().exists(f"{s3.url}/gone.bin")
    assert not _uploads_left(s3)
    with pytest.raises(StorageError, match="aborted or not closed"):
        gone.complete()
