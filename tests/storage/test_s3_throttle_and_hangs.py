"""What a save on thousands of ranks meets on S3 besides errors: sustained throttling (a longer
budget than for broken connections, Retry-After honoured), hung connections (abandoned after
`request_timeout` and retried), and Ctrl-C in the middle of a multipart upload (the upload is
aborted, not left billed). Real s3fs/aiobotocore/aiohttp against moto behind the fault proxy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from botocore.exceptions import ClientError

from ragckpt.errors import StorageError
from ragckpt.storage.retry import RetryPolicy, retry_after, with_retries
from ragckpt.storage.store import open_store
from tests.s3_fault_proxy import CannedReply

MiB = 1 << 20
SLOW_DOWN = CannedReply(503, "SlowDown", "Please reduce your request rate.")


def _opts(opts: dict, **io) -> dict:
    return {**opts, "ragckpt": {**opts["ragckpt"], **io}}


def _error(code: str, status: int, headers: dict | None = None) -> ClientError:
    meta = {"HTTPStatusCode": status, "HTTPHeaders": headers or {}}
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": meta}, "PutObject")


def _failing(exc: BaseException, calls: list[int]):
    def fn():
        calls.append(1)
        raise exc
    return fn


# -- the policy ------------------------------------------------------------------------------------------

def test_throttling_gets_its_own_longer_budget():
    policy = RetryPolicy(attempts=2, base_delay=0.0, throttle_attempts=5)
    calls: list[int] = []
    with pytest.raises(StorageError, match=r"^s3://b/k: giving up after 5 attempts: SlowDown.*the store kept "
                                           r"throttling .*ragckpt.concurrency"):
        with_retries(_failing(_error("SlowDown", 503), calls), "s3://b/k", policy=policy)
    assert len(calls) == 5
    calls.clear()
    with pytest.raises(StorageError, match=r"giving up after 2 attempts: ConnectionResetError") as e:
        with_retries(_failing(ConnectionResetError("reset"), calls), "s3://b/k", policy=policy)
    assert len(calls) == 2 and "throttl" not in str(e.value)
    calls.clear()  # the two budgets are independent: fewer throttle attempts than others is honoured
    with pytest.raises(StorageError, match="giving up after 2 attempts: SlowDown"):
        with_retries(_failing(_error("SlowDown", 503), calls), "s3://b/k",
                     policy=RetryPolicy(attempts=5, base_delay=0.0, throttle_attempts=2))
    calls.clear()  # a bare 503 (a HEAD has no error body) and 429 are throttling too
    with pytest.raises(StorageError, match="giving up after 5 attempts"):
        with_retries(_failing(_error("", 429), calls), "s3://b/k", policy=policy)


def test_retry_after_is_read_in_both_forms_and_capped():
    assert retry_after(_error("SlowDown", 503, {"retry-after": "3"})) == 3.0
    date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 <= retry_after(_error("SlowDown", 503, {"Retry-After": date})) <= 31
    assert retry_after(_error("SlowDown", 503)) is None
    zoneless = time.strftime("%a, %d %b %Y %H:%M:%S -0000", time.gmtime(time.time() + 30))  # RFC 5322: UTC
    assert 25 <= retry_after(_error("SlowDown", 503, {"Retry-After": zoneless})) <= 31
    assert retry_after(_error("SlowDown", 503, {"retry-after": "soon"})) is None
    policy = RetryPolicy(base_delay=0.01, max_delay=0.1, throttle_max_delay=4.0)
    asked = _error("SlowDown", 503, {"retry-after": "3"})
    assert all(3.0 <= policy.delay(0, asked) <= 4.0 * 1.5 for _ in range(20))
    assert all(policy.delay(0, _error("SlowDown", 503, {"retry-after": "100"})) <= 4.0 for _ in range(20))
    # a Retry-After on a non-throttle reply is honoured up to the ordinary cap
    assert all(policy.delay(0, _error("InternalError", 500, {"retry-after": "3"})) <= 0.1 for _ in range(20))


# -- through the proxy -------------------------------------------------------------------------------------

def test_server_retry_after_is_waited_for(s3_faulty):
    url, opts, proxy, direct = s3_faulty
    st = open_store(f"{url}/ck", _opts(opts, throttle_max_delay=5))
    proxy.configure(reply=CannedReply(503, "SlowDown", "Please reduce your request rate.",
                                      headers=(("Retry-After", "1"),)), methods={"PUT"}, max_faults_per_request=1)
    t = time.monotonic()
    st.write("obj", [b"payload"])
    assert time.monotonic() - t >= 0.95, "the retry did not wait for the server's Retry-After"
    assert proxy.stats.canned == 1
    assert direct.fs().cat_file(f"{direct.bucket}/run/ck/obj") == b"payload"


def test_sustained_throttling_outlasts_the_connection_budget(s3_faulty):
    """Four SlowDowns in a row for every request: a store with 2 attempts for broken connections
    still gets through, on its throttle budget; with a throttle budget of 3 it fails in one line
    that says what to change."""
    url, opts, proxy, direct = s3_faulty
    proxy.configure(reply=SLOW_DOWN, methods={"PUT"}, max_faults_per_request=4)
    open_store(f"{url}/ck", _opts(opts, retries=2, throttle_retries=6)).write("obj", [b"x" * 100])
    assert proxy.stats.canned == 4
    proxy.configure(reply=SLOW_DOWN, methods={"PUT"}, max_faults_per_request=4)
    with pytest.raises(StorageError, match=rf"^{url}/ck/obj2: giving up after 3 attempts: SlowDown: Please reduce "
                                           r"your request rate.; the store kept throttling .*throttle_retries"):
        open_store(f"{url}/ck", _opts(opts, retries=2, throttle_retries=3)).write("obj2", [b"x"])


@pytest.mark.parametrize("method", ["PUT", "GET"])
def test_hung_request_is_abandoned_after_the_timeout_and_retried(s3_faulty, method):
    url, opts, proxy, direct = s3_faulty
    st = open_store(f"{url}/ck", _opts(opts, request_timeout=1))
    if method == "GET":
        st.write("obj", [b"payload" * 1000])
    proxy.configure(stall=True, methods={method}, max_faults_per_request=1)
    t = time.monotonic()
    if method == "PUT":
        st.write("obj", [b"payload" * 1000])
    else:
        assert st.read_range("obj", 7, 6007) == (b"payload" * 1000)[7:6007]
    assert 0.95 <= time.monotonic() - t < 10
    assert proxy.stats.stalls == 1
    assert direct.fs().cat_file(f"{direct.bucket}/run/ck/obj") == b"payload" * 1000


def test_a_connection_that_stays_hung_fails_in_one_line(s3_faulty):
    url, opts, proxy, _ = s3_faulty
    st = open_store(f"{url}/ck", _opts(opts, request_timeout=0.5, retries=2))
    proxy.configure(stall=True, methods={"PUT"}, max_faults_per_request=10)
    t = time.monotonic()
    with pytest.raises(StorageError, match=rf"^{url}/ck/obj: giving up after 2 attempts: TransientIOError: no reply "
                                           r"within 1 s \(ragckpt.request_timeout\)"):
        st.write("obj", [b"data"])
    assert time.monotonic() - t < 10


_CHILD = """
import json, sys
from ragckpt.storage.store import open_store
st = open_store(sys.argv[1], json.loads(sys.argv[2]))
st.write("big", [bytes(16 << 20)])
"""


def test_ctrl_c_during_a_multipart_upload_aborts_it(s3_faulty):
    """SIGINT while part 2 of an upload hangs: the process exits with KeyboardInterrupt within the
    grace period and no multipart upload is left on the bucket."""
    url, opts, proxy, direct = s3_faulty
    io = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB, "request_timeout": 60}
    proxy.configure(stall=True, methods={"PUT"}, path_regex="partNumber=2", stall_s=60, max_faults_per_request=5)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, f"{url}/ck", json.dumps(_opts(opts, **io))],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while proxy.stats.stalls == 0:
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the upload never reached part 2"
            time.sleep(0.05)
        raw = direct.fs()
        assert raw.call_s3("list_multipart_uploads", Bucket=direct.bucket).get("Uploads"), "no upload in flight"
        t = time.monotonic()
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=30)
        assert time.monotonic() - t < 15
    finally:
        if child.poll() is None:
            child.kill()
    assert b"KeyboardInterrupt" in err
    assert not raw.call_s3("list_multipart_uploads", Bucket=direct.bucket).get("Uploads")


@pytest.mark.parametrize("how", ["another task fails", "the caller is interrupted"])
def test_a_stopping_pool_cancels_its_tasks_hung_requests(s3_faulty, how):
    """Only the caller's thread gets a Ctrl-C or SIGTERM, and the pool's exit waits for every running
    task: tasks hung on a store that stopped answering waited out their retries (5 x 60 s by
    default), so a SIGTERM took minutes and Slurm's kill came first. Now such requests are
    cancelled within a second of the pool stopping, whatever stopped it, and abort their uploads."""
    from ragckpt.workpool import StoppablePool

    url, opts, proxy, direct = s3_faulty
    st = open_store(f"{url}/ck", _opts(opts, request_timeout=60, retries=5, part_size=5 * MiB,
                                       multipart_threshold=5 * MiB))
    proxy.configure(stall=True, methods={"PUT"}, stall_s=120, max_faults_per_request=100)
    t = None
    with pytest.raises((RuntimeError, KeyboardInterrupt)) as e:
        with StoppablePool(3) as pool:
            hung = [pool.submit(st.write, f"obj{i}", [bytes((6 << 20) if i else 100)]) for i in range(2)]
            deadline = time.monotonic() + 60
            while proxy.stats.stalls < 2:
                assert time.monotonic() < deadline, "the writes never reached the server"
                time.sleep(0.05)
            t = time.monotonic()
            if how == "another task fails":
                pool.result(pool.submit(_failing(RuntimeError("injected"), [])))
            raise KeyboardInterrupt
    assert time.monotonic() - t < 20, "the hung requests were waited out"
    assert isinstance(e.value, RuntimeError if how == "another task fails" else KeyboardInterrupt)
    assert all(f.done() for f in hung)
    proxy.configure()  # answering again: what the cancelled multipart upload left is gone
    assert not direct.fs().call_s3("list_multipart_uploads", Bucket=direct.bucket).get("Uploads")


@pytest.mark.slow
def test_clean_up_after_an_interrupt_does_not_wait_out_a_hung_store(s3_faulty):
    """After SIGTERM the overwrite guard asked the store whether DST was committed with the full
    retry budget: 85 s against a server that stopped answering, past Slurm's 30 s grace. Now one
    short attempt; on failure the old contents' place is named (here there were none). The writer
    lock's S3 lease is released with one short DELETE, not read back first while it cannot have
    been taken over: that GET waited out the client's 30 s read timeout."""
    from ragckpt.storage.destination import replacing

    url, opts, proxy, _ = s3_faulty
    slow = _opts(opts, request_timeout=60, retries=5)
    assert open_store(f"{url}/dst", slow).hurried().cfg.request_timeout == 5  # one try of 5 s
    t = None
    with pytest.raises(KeyboardInterrupt):
        with replacing(f"{url}/dst", (), overwrite=False, storage_options=slow, tag="t", new_bytes=0):
            proxy.configure(stall=True, stall_s=120, max_faults_per_request=100)
            t = time.monotonic()
            raise KeyboardInterrupt
    assert time.monotonic() - t < 20
