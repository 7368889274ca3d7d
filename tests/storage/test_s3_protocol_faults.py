"""S3 protocol replies that ragckpt must read right, produced by the fault proxy's canned replies in
front of moto (nothing in the client patched): NoSuchUpload to CompleteMultipartUpload with an older
object at the key, 412 replies without a <Condition> element (MinIO, Ceph RGW), 409
ConditionalRequestConflict, permanent 403s, and range reads streamed into caller memory."""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
import pytest
import s3fs
import torch

import ragckpt
from ragckpt.errors import DestinationExistsError, StorageError
from ragckpt.storage.store import open_store
from tests.s3_fault_proxy import (
    ACCESS_DENIED,
    CONDITIONAL_CONFLICT,
    FORBIDDEN,
    INVALID_ACCESS_KEY,
    NO_SUCH_UPLOAD,
)
from tests.storage.fault_options import _opts

MiB = 1 << 20
# with `_opts`, objects above 5 MiB go up as multipart uploads of 5 MiB parts; reads split into 5 MiB pieces

#: CompleteMultipartUpload is the only POST whose query names an upload id
COMPLETE = r"\?uploadId="


# -- 1. CompleteMultipartUpload answers NoSuchUpload ----------------------------------------------------

@pytest.mark.parametrize("stale", ["same size", "other size", "none"])
def test_upload_aborted_behind_our_back_is_not_taken_for_our_object(s3_faulty, stale):
    """The upload was aborted by someone else (an overwrite aborting the uploads under the prefix, a
    lifecycle rule), so the complete answers NoSuchUpload. An object of the same size already at the
    key (an earlier save's chunk) must not pass for this write's: its ETag is not the one our parts
    compose to. The write fails with one line that says what happened, not "is missing"."""
    url, opts, proxy, direct = s3_faulty
    raw = direct.fs()
    key = "ck/buffers/0/c.0.0"
    old = os.urandom(12 * MiB if stale == "same size" else 11 * MiB)
    if stale != "none":
        raw.pipe_file(f"{direct.bucket}/run/{key}", old)
    st = open_store(url, _opts(opts))
    proxy.configure(reply=NO_SUCH_UPLOAD, methods={"POST"}, path_regex=COMPLETE, max_faults_per_request=10)
    with pytest.raises(StorageError) as e:
        st.write(key, [os.urandom(12 * MiB)])
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"cannot write {url}/{key}: its multipart upload was aborted by another writer"), msg
    assert msg.endswith("retry the save"), msg
    assert "missing" not in msg
    assert proxy.stats.canned == 1, proxy.stats
    if stale == "none":
        assert "no object is there" in msg
        assert not raw.exists(f"{direct.bucket}/run/{key}")
    else:
        assert f"({len(old)} bytes, ETag " in msg
        assert raw.cat_file(f"{direct.bucket}/run/{key}") == old  # nothing of ours landed


def test_complete_whose_reply_was_lost_is_recognised_by_its_etag(s3_faulty):
    """The complete lands but the client only hears NoSuchUpload (its reply was lost and the retry
    found the upload gone): the object at the key carries the ETag our parts compose to, so the
    write succeeded, even with an older object of the same size there before."""
    url, opts, proxy, direct = s3_faulty
    raw = direct.fs()
    key = "ck/buffers/0/c.0.0"
    raw.pipe_file(f"{direct.bucket}/run/{key}", os.urandom(12 * MiB))
    new = os.urandom(12 * MiB)
    st = open_store(url, _opts(opts))
    proxy.configure(reply=dataclasses.replace(NO_SUCH_UPLOAD, forward=True), methods={"POST"},
                    path_regex=COMPLETE, max_faults_per_request=1)
    st.write(key, [new])
    assert proxy.stats.canned == 1, proxy.stats
    assert raw.cat_file(f"{direct.bucket}/run/{key}") == new


# -- 2. 412 without <Condition> -------------------------------------------------------------------------

def test_412_without_condition_element_means_the_object_exists(s3_faulty):
    """MinIO-style 412 replies carry no <Condition>If-None-Match</Condition>, so s3fs does not make
    them a FileExistsError. A commit whose reply was lost (the retry meets 412 for our own marker)
    still succeeds, and the loser of a commit race gets DestinationExistsError."""
    url, opts, proxy, direct = s3_faulty
    # the proxy really strips the element: s3fs alone no longer reports "exists"
    raw = s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": proxy.url})
    raw.pipe_file(f"{direct.bucket}/probe", b"1")
    proxy.configure(strip_412_condition=True)
    with pytest.raises(OSError) as probe:
        raw.call_s3("put_object", Bucket=direct.bucket, Key="probe", Body=b"2", IfNoneMatch="*")
    assert not isinstance(probe.value, FileExistsError)

    st = open_store(f"{url}/ck", opts)
    proxy.configure(strip_412_condition=True, lose_reply=True, methods={"PUT"}, path_regex="/COMMITTED",
                    max_faults_per_request=1)
    st.write("COMMITTED", [b"ours"], create_only=True)
    assert proxy.stats.lost_replies == 1, proxy.stats
    assert proxy.stats.by_method["PUT"] == 2, proxy.stats
    assert direct.fs().cat_file(f"{direct.bucket}/run/ck/COMMITTED") == b"ours"

    proxy.configure(strip_412_condition=True)
    with pytest.raises(DestinationExistsError, match=r"COMMITTED already exists; another writer committed first"):
        open_store(f"{url}/ck", opts).write("COMMITTED", [b"theirs"], create_only=True)
    assert direct.fs().cat_file(f"{direct.bucket}/run/ck/COMMITTED") == b"ours"


# -- 3. 409 ConditionalRequestConflict --------------------------------------------------------------------

def test_conditional_request_conflict_is_retried(s3_faulty):
    """AWS answers a conditional PUT racing another operation on the key with 409
    ConditionalRequestConflict and asks for a retry."""
    url, opts, proxy, direct = s3_faulty
    st = open_store(f"{url}/ck", opts)
    proxy.configure(reply=CONDITIONAL_CONFLICT, methods={"PUT"}, path_regex="/COMMITTED", max_faults_per_request=2)
    st.write("COMMITTED", [b"m"], create_only=True)
    assert proxy.stats.canned == 2 and proxy.stats.by_method["PUT"] == 3, proxy.stats
    assert direct.fs().cat_file(f"{direct.bucket}/run/ck/COMMITTED") == b"m"


def test_conditional_request_conflict_that_persists_gives_up_with_the_url(s3_faulty):
    url, opts, proxy, _ = s3_faulty
    st = open_store(f"{url}/ck", _opts(opts, retries=3))
    proxy.configure(reply=CONDITIONAL_CONFLICT, methods={"PUT"}, path_regex="/COMMITTED", max_faults_per_request=100)
    with pytest.raises(StorageError, match=rf"^{url}/ck/COMMITTED: giving up after 3 attempts: "
                                           r"ConditionalRequestConflict"):
        st.write("COMMITTED", [b"m"], create_only=True)
    assert proxy.stats.by_method["PUT"] == 3


# -- 4. permanent 403s ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["head without ListBucket", "put denied", "bad access key"])
def test_access_denied_fails_fast_with_the_url_and_a_remedy(s3_faulty, case):
    url, opts, proxy, direct = s3_faulty
    direct.fs().pipe_file(f"{direct.bucket}/run/ck/obj", b"x" * 100)
    st = open_store(f"{url}/ck", opts)
    reply, method = {"head without ListBucket": (FORBIDDEN, "HEAD"), "put denied": (ACCESS_DENIED, "PUT"),
                     "bad access key": (INVALID_ACCESS_KEY, "GET")}[case]
    proxy.configure(reply=reply, methods={method}, max_faults_per_request=100)
    with pytest.raises(StorageError) as e:
        if case == "head without ListBucket":  # S3's answer to a HEAD of a missing key without s3:ListBucket
            ragckpt.write_global({"w": torch.ones(4)}, f"{url}/ck2", 1, storage_options=opts)
        elif case == "put denied":
            st.write("new", [b"y"])
        else:
            st.read("obj")
    msg = str(e.value)
    what, key = {"head without ListBucket": ("check", "ck2/COMMITTED"), "put denied": ("write", "ck/new"),
                 "bad access key": ("read", "ck/obj")}[case]
    assert "\n" not in msg
    assert re.fullmatch(
        rf"cannot {what} {re.escape(url)}/{key}: access denied \(.+\); check the credentials \(AWS_\* variables / "
        r"profile / -o key=\.\.\. -o secret=\.\.\.\) and that they allow s3:GetObject, s3:PutObject, "
        rf"s3:DeleteObject and s3:ListBucket on the bucket '{direct.bucket}'", msg), msg
    if case == "bad access key":
        assert "InvalidAccessKeyId" in msg
    assert proxy.stats.requests == 1, proxy.stats  # not retried


# -- 5. range reads stream into caller memory ---------------------------------------------------------------

def test_range_reads_into_caller_memory_are_bit_exact_through_dropped_bodies(s3_faulty):
    """`read_range_into` streams GET bodies straight into the caller's view: one GET up to two parts,
    concurrent part-sized GETs beyond, a body cut off halfway retried over the same bytes. Checks the
    bytes (the memory saving is measured, not tested)."""
    url, opts, proxy, direct = s3_faulty
    n = 23 * MiB + 12345
    data = os.urandom(n)
    direct.fs().pipe_file(f"{direct.bucket}/run/ck/obj", data)
    st = open_store(f"{url}/ck", _opts(opts))
    cases = [(0, 1), (7, MiB + 3), (1, 10 * MiB), (MiB - 1, 10 * MiB + 2), (3, n - 3), (0, n)]
    # faults are counted per method+path (the Range header is not part of it): at most 4 in all, fewer than
    # the 6 attempts one request gets
    proxy.configure(drop_rate=0.5, methods={"GET"}, seed=5, max_faults_per_request=100, max_faults=4)
    for start, length in cases:
        backing = bytearray(length + 16)
        out = memoryview(backing)[8 : 8 + length]
        st.read_range_into("obj", start, out)
        assert out == data[start : start + length], (start, length)
        assert backing[:8] == bytearray(8) and backing[-8:] == bytearray(8), "wrote outside the view"
        assert st.read_range("obj", start, start + length) == data[start : start + length]
    assert proxy.stats.drops >= 3, proxy.stats  # some of them mid-way through a streamed body
    proxy.configure()
    # a typed, multi-dimensional destination (a tensor's memory)
    arr = np.zeros((3, MiB // 4), np.float32)
    st.read_range_into("obj", 100, memoryview(arr))
    assert arr.tobytes() == data[100 : 100 + 3 * MiB]
    # block-by-block reads, as verify and read_rank(out=) do them
    out = memoryview(bytearray(n))
    blocks = [bytes(p) for p in st.read_range_pieces("obj", 0, out, MiB)]
    assert b"".join(blocks) == data and bytes(out) == data
    # ranges past the end
    for start, length in [(n - 10, 20), (n - 10, 11 * MiB), (n + 5, 10)]:
        with pytest.raises(StorageError, match=rf"object {re.escape(url)}/ck/obj is truncated: .* it holds {n}"):
            st.read_range_into("obj", start, memoryview(bytearray(length)))
