"""The S3 store against moto's S3 server over real HTTP: byte-exact writes and reads, multipart,
conditional create, listings, errors that name the object, options, and the concurrency bound."""

from __future__ import annotations

import io
import os
import time

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from ragckpt.errors import DestinationExistsError, StorageError
from ragckpt.storage.config import IOConfig, io_config, split_storage_options
from ragckpt.storage.remote import FsspecStore, S3Store, ViewReader
from ragckpt.storage.retry import RetryPolicy, is_transient, with_retries
from ragckpt.storage.store import open_store

MiB = 1 << 20
SMALL_PARTS = {"part_size": 5 * MiB, "multipart_threshold": 8 * MiB}


def _store(s3, **io) -> S3Store:
    opts = dict(s3.storage_options)
    if io:
        opts["ragckpt"] = io
    st = open_store(s3.url, opts)
    assert isinstance(st, S3Store)
    return st


def _blob(n: int, seed: int = 0) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[:n] if seed == 0 else os.urandom(n)


# -- writes and reads --------------------------------------------------------------------------------------

def test_roundtrip_small_objects_bit_exact(s3):
    st = _store(s3)
    cases = {"a": b"", "b": b"x", "dir/c": os.urandom(1000), "dir/sub/d": os.urandom(3 * MiB)}
    for k, v in cases.items():
        st.write(k, [v])
    # a multi-buffer write is stored as the plain concatenation (what zarr and any other tool sees)
    parts = [memoryview(os.urandom(700_000)), bytearray(os.urandom(5)), bytes(123)]
    st.write("joined", parts)
    cases["joined"] = b"".join(bytes(p) for p in parts)
    raw = s3.fs()
    for k, v in cases.items():
        assert st.read(k) == v, k
        assert raw.cat_file(f"{s3.url}/{k}") == v, k
        assert st.size(k) == len(v)
    assert st.list() == sorted(cases)
    assert st.list("dir") == ["dir/c", "dir/sub/d"]


def test_large_object_uploads_in_parts_and_reads_back_exactly(s3):
    st = _store(s3, **SMALL_PARTS)
    data = os.urandom(21 * MiB + 12345)
    views = [memoryview(data)[: 7 * MiB + 3], memoryview(data)[7 * MiB + 3 :]]
    st.write("big", [*views, bytes(100)])
    want = data + bytes(100)
    head = s3.fs().info(f"{s3.url}/big")
    assert head["size"] == len(want)
    assert head["ETag"].strip('"').endswith("-5"), f"expected a 5-part multipart upload, ETag {head['ETag']}"
    assert st.read("big") == want  # several concurrent ranged GETs into one buffer
    assert st.read_range("big", 0, 1) == want[:1]
    assert st.read_range("big", 5 * MiB - 7, 19 * MiB + 1) == want[5 * MiB - 7 : 19 * MiB + 1]
    reqs = [("big", 0, 10), ("big", 11 * MiB, 11 * MiB + 1), ("big", len(want) - 100, len(want)), ("big", 7, 7)]
    assert st.read_ranges(reqs) == [want[a:b] for _, a, b in reqs]


def test_small_object_is_a_single_put(s3):
    st = _store(s3, **SMALL_PARTS)
    st.write("one", [os.urandom(8 * MiB)])
    assert "-" not in s3.fs().info(f"{s3.url}/one")["ETag"]


def test_view_reader_streams_exact_bytes_without_joining():
    a, b, c = os.urandom(10), os.urandom(7), os.urandom(20)
    views = [memoryview(a), memoryview(b), memoryview(c)]
    whole = a + b + c
    for start, stop in [(0, 37), (3, 12), (10, 17), (9, 30), (36, 37), (5, 5)]:
        r = ViewReader(views, start, stop)
        assert len(r) == stop - start
        assert r.read() == whole[start:stop]
        r.seek(0)
        got = bytearray()
        while chunk := r.read(3):
            got += chunk
        assert bytes(got) == whole[start:stop]
        r.seek(-2, io.SEEK_END)
        buf = bytearray(5)
        assert r.readinto(buf) == min(2, stop - start)
    with pytest.raises(ValueError, match=r"range \[0, 38\) is outside 37 bytes"):
        ViewReader(views, 0, 38)


# -- commit marker: create-if-absent -----------------------------------------------------------------------

def test_create_only_is_exclusive_and_names_the_url(s3):
    st = _store(s3)
    st.write("COMMITTED", [b"first"], create_only=True)
    with pytest.raises(DestinationExistsError, match=f"{s3.url}/COMMITTED already exists"):
        st.write("COMMITTED", [b"second"], create_only=True)
    assert st.read("COMMITTED") == b"first"
    # a second store instance (another job) is refused the same way
    with pytest.raises(DestinationExistsError):
        _store(s3).write("COMMITTED", [b"third"], create_only=True)


# -- errors name the object --------------------------------------------------------------------------------

def test_missing_objects_buckets_and_short_ranges_are_one_line_errors(s3):
    st = _store(s3)
    with pytest.raises(StorageError, match=f"^object {s3.url}/nope is missing$"):
        st.read("nope")
    with pytest.raises(StorageError, match="is missing"):
        st.read_range("nope", 0, 10)
    with pytest.raises(StorageError, match="is missing"):
        st.size("nope")
    assert not st.exists("nope")
    st.write("short", [b"12345"])
    with pytest.raises(StorageError, match=rf"{s3.url}/short is truncated: wanted bytes \[2, 9\), it holds 5"):
        st.read_range("short", 2, 9)
    with pytest.raises(StorageError, match="truncated"):
        st.read_range("short", 6, 9)
    with pytest.raises(StorageError, match="truncated"):
        st.read_ranges([("short", 0, 5), ("short", 4, 6)])
    gone = open_store("s3://no-such-bucket-here/x", s3.storage_options)
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-here' does not exist"):
        gone.read("k")
    with pytest.raises(StorageError, match="does not exist"):
        gone.list()
    with pytest.raises(StorageError, match="names no bucket"):
        open_store("s3://", s3.storage_options)


def test_dead_endpoint_fails_fast_with_one_retry_layer(s3):
    """Nothing listens on the port: the error must come after ragckpt's few attempts, not after
    botocore x s3fs x ragckpt retries multiplied (minutes)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    opts = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
            "config_kwargs": {"connect_timeout": 1, "read_timeout": 2},
            "ragckpt": {"retries": 3, "retry_delay": 0.05}}
    st = open_store("s3://bkt/x", opts)
    t = time.monotonic()
    with pytest.raises(StorageError, match=r"^s3://bkt/x/k: giving up after 3 attempts: EndpointConnectionError"):
        st.write("k", [b"data"])
    assert time.monotonic() - t < 10


# -- listing and deletion -------------------------------------------------------------------------------------

def test_list_is_scoped_to_the_prefix_and_paginates(s3):
    st = _store(s3)
    sibling = open_store(s3.url + "2", s3.storage_options)  # s3://bucket/run2 shares the text prefix
    sibling.write("keep", [b"k"])
    st.list_page_size = 10  # several listing pages (S3 pages hold up to 1000 keys)
    keys = [f"d/{i:04d}" for i in range(35)]
    st.write_many((k, [b""]) for k in keys)
    assert st.list() == keys
    assert st.list("d") == keys
    assert sibling.list() == ["keep"]
    st.delete_all()
    assert st.list() == []
    assert sibling.list() == ["keep"], "delete_all must not touch a sibling prefix"
    st.delete_all()  # idempotent


def test_delete_all_aborts_unfinished_multipart_uploads(s3):
    st = _store(s3)
    raw = s3.fs()
    bucket, key = s3.bucket, "run/half"
    raw.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    assert raw.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")
    st.delete_all()
    assert not raw.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")


def test_abort_uploads_sweeps_only_a_checkpoints_data_and_a_lost_upload_is_no_missing_object(s3):
    """After a failed job, `abort_uploads` aborts what is open under the destination's buffers/ and
    meta/, and nothing beside them (at a bucket's root that is every other job's upload). A part sent
    to an upload aborted meanwhile fails as a storage error, not as a missing object (s3fs raises
    NoSuchUpload as FileNotFoundError)."""
    from ragckpt.errors import BadObjectError, StorageError

    raw = s3.fs()
    bucket = s3.bucket
    root_store = S3Store(f"s3://{bucket}", s3.storage_options)
    prefix = s3.url.split("://", 1)[1].partition("/")[2]
    ours = [f"{prefix}/dst/buffers/0/c.0.0", f"{prefix}/dst/meta/units/0/c/0", "buffers/1/c.0.0"]
    others = [f"{prefix}/other/buffers/0/c.0.0", f"{prefix}/dst-old/buffers/0/c.0.0", "job7/buffers/0/c.0.0"]
    for k in ours + others:
        raw.call_s3("create_multipart_upload", Bucket=bucket, Key=k)
    S3Store(f"{s3.url}/dst", s3.storage_options).abort_uploads()
    root_store.abort_uploads()
    left = sorted(u["Key"] for u in raw.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []))
    assert left == sorted(others)

    # moto answers a part for an aborted upload with a 500; S3 with NoSuchUpload, as built here
    import botocore.exceptions
    from s3fs.errors import translate_boto_error

    gone = translate_boto_error(botocore.exceptions.ClientError(
        {"Error": {"Code": "NoSuchUpload", "Message": "The specified upload does not exist."}}, "UploadPart"))
    assert isinstance(gone, FileNotFoundError)
    err = root_store._error("write", "s3://b/k (part 3)", gone)
    assert type(err) is StorageError and not isinstance(err, BadObjectError)
    assert "its multipart upload no longer exists" in str(err)


# -- options -----------------------------------------------------------------------------------------------

def test_ragckpt_options_are_split_from_fsspec_options(monkeypatch):
    monkeypatch.setenv("RAGCKPT_IO_CONCURRENCY", "7")
    monkeypatch.setenv("RAGCKPT_IO_RETRIES", "2")
    opts, cfg = split_storage_options({"anon": False, "ragckpt": {"retries": "9", "part_size": "8MiB"}})
    assert opts == {"anon": False}
    assert cfg == IOConfig(concurrency=7, retries=9, part_size=8 * MiB)
    assert io_config({"ragckpt": {"retry_delay": "0.5"}}).retry_delay == 0.5
    with pytest.raises(StorageError, match="unknown storage option 'ragckpt.concurency'"):
        io_config({"ragckpt": {"concurency": 3}})
    with pytest.raises(StorageError, match="part_size must be >= 5242880"):
        io_config({"ragckpt": {"part_size": 1024}})
    # counts from the environment are whole numbers (0 gets the range message, not a parse error);
    # only byte settings take units
    for value, message in [("0", r"concurrency must be >= 1, got 0"),
                           ("1.5", r"concurrency: cannot use '1.5' \(expected a whole number\)"),
                           ("4k", r"concurrency: cannot use '4k' \(expected a whole number\)")]:
        with pytest.raises(StorageError, match=message):
            io_config(environ={"RAGCKPT_IO_CONCURRENCY": value})
    with pytest.raises(StorageError, match=r"retries must be >= 1 \(1 = no retry\), got 0"):
        io_config(environ={"RAGCKPT_IO_RETRIES": "0"})
    assert io_config(environ={"RAGCKPT_IO_PART_SIZE": "8MiB"}).part_size == 8 * MiB
    with pytest.raises(StorageError, match=r"part_size: cannot use 'big' \(expected a size such as 32MiB\)"):
        io_config(environ={"RAGCKPT_IO_PART_SIZE": "big"})
    # S3 refuses parts and single PUTs over 5 GiB (EntityTooLarge) only after the upload started
    with pytest.raises(StorageError, match="part_size must be <= 5368709120"):
        io_config({"ragckpt": {"part_size": "6GiB", "multipart_threshold": "6GiB"}})
    with pytest.raises(StorageError, match="multipart_threshold must be <= 5368709120"):
        io_config({"ragckpt": {"multipart_threshold": "8GiB"}})
    assert io_config({"ragckpt": {"part_size": "5GiB", "multipart_threshold": "5GiB"}}).part_size == 5 << 30
    with pytest.raises(StorageError, match="ragckpt.retries"):
        io_config({"ragckpt": {"retries": "many"}})


def test_other_fsspec_protocols_use_the_generic_store():
    import uuid

    url = f"memory://ragckpt-test-{uuid.uuid4().hex}"
    st = open_store(url, {"ragckpt": {"concurrency": 3}})
    assert isinstance(st, FsspecStore) and st.cfg.concurrency == 3
    st.write("a/b", [memoryview(b"hello "), b"world"])
    assert st.read("a/b") == b"hello world"
    assert st.read_ranges([("a/b", 0, 5), ("a/b", 6, 11)]) == [b"hello", b"world"]
    st.write("COMMITTED", [b"1"], create_only=True)
    with pytest.raises(DestinationExistsError):
        st.write("COMMITTED", [b"2"], create_only=True)
    with pytest.raises(StorageError, match="is missing"):
        st.read("zz")
    assert st.list() == ["COMMITTED", "a/b"]
    st.delete_all()
    assert st.list() == []


# -- retry classification -----------------------------------------------------------------------------------

def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


@pytest.mark.parametrize(("exc", "transient"), [
    (_client_error("SlowDown", 503), True),
    (_client_error("InternalError", 500), True),
    (_client_error("Whatever", 502), True),
    (_client_error("TooManyRequests", 429), True),
    (_client_error("AccessDenied", 403), False),
    (_client_error("NoSuchKey", 404), False),
    (_client_error("PreconditionFailed", 412), False),
    (_client_error("NotImplemented", 501), False),
    (EndpointConnectionError(endpoint_url="http://x"), True),
    (ConnectionResetError(), True),
    (TimeoutError(), True),
    (FileNotFoundError(), False),
    (ValueError("bad"), False),
])
def test_transient_classification(exc, transient):
    assert is_transient(exc) is transient
    # s3fs re-raises ClientErrors as OSErrors with the original as __cause__
    wrapped = OSError(5, "wrapped")
    wrapped.__cause__ = exc
    assert is_transient(wrapped) is (transient and not isinstance(exc, FileNotFoundError))


def test_with_retries_retries_transient_then_names_the_object():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise _client_error("SlowDown", 503)
        return "ok"

    assert with_retries(flaky, "s3://b/k", policy=RetryPolicy(5, 0.0)) == "ok" and len(calls) == 3
    with pytest.raises(StorageError, match=r"^s3://b/k: giving up after 2 attempts: SlowDown"):
        with_retries(lambda: (_ for _ in ()).throw(_client_error("SlowDown", 503)), "s3://b/k",
                     policy=RetryPolicy(2, 0.0, throttle_attempts=2))
    n = []
    with pytest.raises(PermissionError):
        with_retries(lambda: n.append(1) or (_ for _ in ()).throw(PermissionError("denied")), "x")
    assert len(n) == 1, "permanent errors are not retried"


# -- concurrency bound ------------------------------------------------------------------------------------

@pytest.mark.parametrize("concurrency", [2, 8])
def test_requests_in_flight_are_bounded_by_the_concurrency_setting(s3_faulty, concurrency):
    url, opts, proxy, direct = s3_faulty
    _store(direct).write("obj", [os.urandom(2 * MiB)])
    st = open_store(url, {**opts, "ragckpt": {**opts["ragckpt"], "concurrency": concurrency}})
    reqs = [("obj", i * 65536, (i + 1) * 65536) for i in range(32)]
    proxy.configure()
    want = _store(direct).read("obj")
    assert st.read_ranges(reqs) == [want[a:b] for _, a, b in reqs]
    assert proxy.stats.requests == 32
    assert proxy.stats.max_inflight <= concurrency
    if concurrency > 2:
        assert proxy.stats.max_inflight > 2, "range reads should actually overlap"
    proxy.configure()
    blobs = {f"many/{i}": os.urandom(100_000) for i in range(24)}
    st.write_many((k, [v]) for k, v in blobs.items())
    assert proxy.stats.requests == 24 and proxy.stats.max_inflight <= concurrency
    if concurrency > 2:
        assert proxy.stats.max_inflight > 2, "write_many should upload objects concurrently"
    assert {k: _store(direct).read(k) for k in blobs} == blobs


def test_range_reads_into_memory_are_exact_and_never_stale(s3_faulty):
    """Reads into caller memory: one GET for a range up to two parts, concurrent parts beyond,
    truncation named, and a rewrite seen at once (nothing is cached between calls)."""
    url, opts, proxy, direct = s3_faulty
    data = os.urandom(12 * MiB + 300)
    _store(direct).write("obj", [data])
    st = open_store(url, {**opts, "ragckpt": {**opts["ragckpt"], "part_size": 5 * MiB}})
    proxy.configure()
    small = bytearray(MiB)
    st.read_range_into("obj", 7, memoryview(small))
    assert bytes(small) == data[7 : MiB + 7]
    assert proxy.stats.by_method["GET"] == 1, proxy.stats
    big = bytearray(len(data) - 1)
    st.read_range_into("obj", 1, memoryview(big))
    assert bytes(big) == data[1:]
    with pytest.raises(StorageError, match=f"{url}/obj is truncated"):
        st.read_range_into("obj", len(data) - 10, memoryview(bytearray(20)))
    st.write("obj", [b"x" * 100])
    got = bytearray(10)
    st.read_range_into("obj", 0, memoryview(got))
    assert bytes(got) == b"x" * 10


def test_range_pieces_come_from_large_requests(s3_faulty):
    """A reader verifying block by block gets 1 MiB pieces, but the GETs behind them are large."""
    url, opts, proxy, direct = s3_faulty
    data = os.urandom(3 * MiB + 123)
    _store(direct).write("obj", [data])
    st = open_store(url, opts)
    out = memoryview(bytearray(len(data) - 100))
    proxy.configure()
    pieces = [bytes(p) for p in st.read_range_pieces("obj", 100, out, MiB)]
    assert [len(p) for p in pieces] == [MiB, MiB, MiB, 23]
    assert b"".join(pieces) == data[100:] == bytes(out)
    assert proxy.stats.by_method["GET"] == 1, proxy.stats
    with pytest.raises(StorageError, match=f"{url}/obj is truncated"):
        list(st.read_range_pieces("obj", 200, memoryview(bytearray(len(data))), MiB))


def test_fsspec_listing_gives_sizes_without_a_request_per_object(monkeypatch):
    """gs://, az:// and other fsspec stores answer sizes from the listing itself (one request per
    page), as S3 does: verify and import-dcp list thousands of objects."""
    import uuid

    from ragckpt.storage.store import open_store

    url = f"memory://sizes-{uuid.uuid4().hex[:8]}/ck"
    store = open_store(url)
    store.write("a/x", [b"12345"])
    store.write("a/b/y", [b""])
    store.write("z", [b"1"])
    monkeypatch.setattr(type(store.fs), "size", lambda *a, **k: pytest.fail("a size request per object"))
    assert store.list_sizes("a") == {"a/x": 5, "a/b/y": 0}
    assert store.list() == ["a/b/y", "a/x", "z"] and store.list_sizes("nothing") == {}
