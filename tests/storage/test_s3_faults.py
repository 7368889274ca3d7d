"""Saves and loads through a fault-injecting proxy in front of moto (real s3fs/aiobotocore/aiohttp):
throttling and dropped connections are retried to a bit-exact result; an outage fails cleanly with
the URL named and leaves no committed checkpoint; a later commit recovers."""

from __future__ import annotations

import time

import pytest
import torch

import ragckpt
from ragckpt.checkpoint.writer import write_streaming
from ragckpt.errors import NotCommittedError, StorageError
from ragckpt.storage.store import open_store
from tests.helpers import assert_bit_equal, odd_state, special_tensor
from tests.storage.fault_options import _opts

MiB = 1 << 20
# chunk objects of 6-7 MiB go up as 2-part multipart uploads with `_opts`


def _state() -> dict[str, torch.Tensor]:
    state = odd_state()
    state["big"] = special_tensor((3 * 1024, 1024), torch.float32, 3)  # 12 MiB
    return state


def _load_all(url: str, opts: dict, state: dict[str, torch.Tensor]) -> None:
    ck = ragckpt.open(url, storage_options=opts)
    for k, v in state.items():
        assert_bit_equal(ck.read(k), v, k)
    rep = ck.verify()
    assert rep.ok, rep.problems


def _no_commit(direct, name: str) -> None:
    st = open_store(f"{direct.url}/{name}", direct.storage_options)
    assert not st.exists("COMMITTED"), "a failed save must not leave a committed checkpoint"
    if st.exists("zarr.json"):
        with pytest.raises(NotCommittedError):
            ragckpt.open(f"{direct.url}/{name}", storage_options=direct.storage_options)


def test_save_and_load_survive_throttling(s3_faulty):
    """503 SlowDown on 30% of requests of every kind (at most twice per request)."""
    url, opts, proxy, direct = s3_faulty
    opts = _opts(opts)
    state = _state()
    proxy.configure(error_rate=0.3, seed=1)
    ragckpt.write_global(state, f"{url}/ck", 2, storage_options=opts, max_chunk_bytes=8 * MiB)
    saved = proxy.stats
    assert saved.errors >= 5, saved
    assert saved.by_method["POST"] > 0, "expected multipart uploads"
    proxy.configure(error_rate=0.3, seed=2)
    _load_all(f"{url}/ck", opts, state)
    assert proxy.stats.errors >= 5
    proxy.configure()
    _load_all(f"{direct.url}/ck", direct.storage_options, state)  # what really got stored


def test_save_survives_connections_dropped_mid_upload(s3_faulty):
    """Uploads of 1 MiB or more lose their connection halfway through the body, twice each (the
    first three): aiohttp itself resends an idempotent PUT once after a reset, so the second drop
    is ragckpt's retry layer's to handle."""
    url, opts, proxy, direct = s3_faulty
    opts = _opts(opts)
    state = _state()
    proxy.configure(drop_rate=1.0, methods={"PUT"}, drop_min_bytes=1 * MiB, max_faults_per_request=2, max_faults=6)
    ragckpt.write_global(state, f"{url}/ck", 2, storage_options=opts, max_chunk_bytes=8 * MiB)
    assert proxy.stats.drops == 6, proxy.stats
    proxy.configure()
    _load_all(f"{direct.url}/ck", direct.storage_options, state)


def test_load_survives_responses_cut_off_mid_body(s3_faulty):
    url, opts, proxy, direct = s3_faulty
    opts = _opts(opts)
    state = _state()
    ragckpt.write_global(state, f"{direct.url}/ck", 2, storage_options=direct.storage_options)
    proxy.configure(drop_rate=0.4, methods={"GET"}, seed=4)
    _load_all(f"{url}/ck", opts, state)
    assert proxy.stats.drops >= 2, proxy.stats


@pytest.mark.parametrize("target", ["data", "marker"])
def test_outage_fails_cleanly_and_leaves_no_commit(s3_faulty, target):
    """Every PUT (or only the marker's) fails: the save raises one StorageError naming the object,
    within seconds, and nothing is committed; once storage is back, `commit` completes the same
    checkpoint (data outage: a fresh save does)."""
    url, opts, proxy, direct = s3_faulty
    opts = _opts(opts, retries=3, throttle_retries=3)
    state = {"w": special_tensor((256, 64), torch.float32, 5), "b": special_tensor((10,), torch.bfloat16, 6)}
    proxy.configure(fail_all=True, methods={"PUT", "POST"}, path_regex="/COMMITTED" if target == "marker" else "")
    t = time.monotonic()
    with pytest.raises(StorageError, match=rf"^{url}/ck/\S+: giving up after 3 attempts: SlowDown") as e:
        ragckpt.write_global(state, f"{url}/ck", 2, storage_options=opts)
    assert time.monotonic() - t < 20
    if target == "marker":
        assert str(e.value).startswith(f"{url}/ck/COMMITTED:")
    proxy.configure()
    _no_commit(direct, "ck")
    if target == "marker":
        ragckpt.commit(f"{url}/ck", storage_options=opts)
    else:
        ragckpt.write_global(state, f"{url}/ck", 2, storage_options=opts, overwrite=True)
    _load_all(f"{direct.url}/ck", direct.storage_options, state)


def test_outage_midway_through_a_multipart_upload_aborts_it(s3_faulty):
    """Parts fail permanently after the upload started: the upload is aborted (no orphaned parts
    billed forever), the save fails cleanly."""
    url, opts, proxy, direct = s3_faulty
    opts = _opts(opts, retries=2, throttle_retries=2)
    state = {"big": special_tensor((4 * 1024, 1024), torch.float32, 7)}  # 16 MiB
    proxy.configure(fail_all=True, methods={"PUT"}, path_regex="partNumber=2")
    with pytest.raises(StorageError, match=r"\(part 2\): giving up after 2 attempts"):
        ragckpt.write_global(state, f"{url}/ck", 1, storage_options=opts)
    proxy.configure()
    _no_commit(direct, "ck")
    raw = direct.fs()
    assert not raw.call_s3("list_multipart_uploads", Bucket=direct.bucket).get("Uploads")


def test_uncommitted_leftovers_of_a_failed_save_are_replaced_by_overwrite(s3_faulty):
    url, opts, proxy, direct = s3_faulty
    opts = _opts(opts, retries=2, throttle_retries=2)
    lay = ragckpt.CheckpointLayout.build({"w": ((128, 8), "float32")}, 2, "row")
    w = special_tensor((128, 8), torch.float32, 8)
    raw = w.reshape(-1).view(torch.uint8).numpy().data
    per = int(lay.rank_sizes(0)[0])

    def fill_for(bi: int, r: int):
        return lambda lo, hi: raw[(r * per + lo) * 4 : (r * per + hi) * 4]

    proxy.configure(fail_all=True, methods={"PUT"}, path_regex="/ranks/1")
    with pytest.raises(StorageError, match="ranks/1"):
        write_streaming(f"{url}/ck", lay, fill_for, storage_options=opts)
    proxy.configure()
    _no_commit(direct, "ck")
    with pytest.raises(ragckpt.DestinationExistsError, match="already holds .*checkpoint"):
        ragckpt.write_global({"w": w}, f"{url}/ck", 2, layout="row", storage_options=opts)
    ragckpt.write_global({"w": w}, f"{url}/ck", 2, layout="row", storage_options=opts, overwrite=True)
    _load_all(f"{direct.url}/ck", direct.storage_options, {"w": w})


def test_overwrite_that_fails_half_way_leaves_no_committed_checkpoint(s3_faulty):
    """Overwrite deletes the old commit marker before any other object: when the bulk delete then
    fails, what is left is an uncommitted checkpoint that readers refuse, never a committed one with
    objects missing."""
    url, opts, proxy, direct = s3_faulty
    opts = _opts(opts, retries=2, throttle_retries=2)
    state = {"w": special_tensor((64, 8), torch.float32, 9)}
    ragckpt.write_global(state, f"{url}/ck", 2, storage_options=opts)
    proxy.configure(fail_all=True, methods={"POST"}, path_regex=r"\?delete")
    with pytest.raises(StorageError, match="delete"):
        ragckpt.write_global(state, f"{url}/ck", 3, storage_options=opts, overwrite=True)
    proxy.configure()
    _no_commit(direct, "ck")
    ragckpt.write_global(state, f"{url}/ck", 3, storage_options=opts, overwrite=True)
    _load_all(f"{direct.url}/ck", direct.storage_options, state)


def test_commit_reads_the_rank_documents_in_one_concurrent_batch(s3_faulty):
    """A commit without the ranks' documents in hand (every rank saved on its own) lists `ranks/`
    once and GETs the documents concurrently: no HEAD per rank, no rank after rank."""
    url, opts, proxy, direct = s3_faulty
    W = 48
    lay = ragckpt.CheckpointLayout.build({"w": ((W * 3, 5), "float32")}, W, "row")
    for r in range(W):
        ragckpt.save_shard(f"{url}/ck", r, {"float32": torch.full((15,), float(r))}, lay, storage_options=opts)
    proxy.configure()
    ragckpt.commit(f"{url}/ck", storage_options=opts)
    st = proxy.stats
    assert st.by_method["HEAD"] <= 4, st  # the marker and the root document, not one per rank
    assert W <= st.by_method["GET"] <= W + 20, st
    assert st.max_inflight > 2, "the rank documents should be fetched concurrently"
    assert torch.equal(ragckpt.open(f"{url}/ck", storage_options=opts).read("w")[:3], torch.zeros(3, 5))


# -- a store that does not answer is not a damaged checkpoint ----------------------------------------------

def test_an_outage_is_never_reported_as_damage(s3_faulty, tmp_path):
    """Found by a hunt through the S3 paths: while the server answered 500 (or refused a HEAD),
    `verify` listed the healthy objects as BAD (exit 1: restore or re-save), reads raised
    IntegrityError ("incomplete or damaged ... re-save the checkpoint"), `ls` listed the checkpoint as
    DAMAGED (exit 0), and import-hf called the file missing. Now each is a StorageError naming the
    object and the server's answer (exit 2), and real damage still reads as damage."""
    from safetensors.torch import save

    from ragckpt.errors import BadObjectError, IntegrityError
    from tests.conftest import cli_storage_args
    from tests.helpers import cli_run
    from tests.s3_fault_proxy import CannedReply

    url, opts, proxy, direct = s3_faulty
    opts = _opts(opts, retries=2, throttle_retries=2)
    flags = cli_storage_args(opts)
    state = {"w": special_tensor((300, 10), torch.float32, 1)}
    ragckpt.write_global(state, f"{url}/ck", 2, storage_options=opts)
    direct.fs().pipe_file(f"{direct.url}/hf/model.safetensors", save(state))
    internal = CannedReply(500, "InternalError", "We encountered an internal error. Please try again.")

    proxy.configure(reply=internal, methods={"GET"}, path_regex=r"/ck/buffers/0/c\.", max_faults=10**6,
                    max_faults_per_request=10**6)
    ck = ragckpt.open(f"{url}/ck", storage_options=opts)
    for call in (lambda: ck.verify(), lambda: ck.read("w")):
        with pytest.raises(StorageError, match=r"buffers/0/c\.\d\.0: giving up after 2 attempts: InternalError") as e:
            call()
        assert not isinstance(e.value, (BadObjectError, IntegrityError)), e.value
    code, out, err = cli_run("verify", f"{url}/ck", *flags)
    assert code == 2 and "InternalError" in err and "the store did not answer" in err and "BAD" not in out, (out, err)
    proxy.configure(reply=internal, methods={"GET"}, path_regex=r"/ck/zarr\.json$", max_faults=10**6,
                    max_faults_per_request=10**6)
    with pytest.raises(StorageError, match=r"ck/zarr\.json: giving up after 2 attempts") as e:
        ragckpt.open(f"{url}/ck", storage_options=opts)
    assert not isinstance(e.value, (BadObjectError, IntegrityError)), e.value

    proxy.configure(reply=internal, methods={"GET"}, path_regex=r"/ck/(zarr\.json|COMMITTED)$", max_faults=10**6,
                    max_faults_per_request=10**6)
    direct.fs().pipe_file(f"{direct.url}/other/zarr.json", (direct.fs().cat_file(f"{direct.url}/ck/zarr.json")))
    code, out, err = cli_run("ls", url, *flags)  # the others are still listed; the listing says which failed
    assert code == 2 and "InternalError" in err and "DAMAGED" not in out, (out, err)
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"UNREADABLE  {url}/ck  (") and "InternalError" in lines[0], out
    assert lines[1] == f"INCOMPLETE  {url}/other", out

    proxy.configure(reply=CannedReply(403), methods={"HEAD"}, path_regex="/hf/model.safetensors", max_faults=10**6,
                    max_faults_per_request=10**6)
    code, out, err = cli_run("import-hf", f"{url}/hf", str(tmp_path / "imp"), "-w", "2", *flags)
    assert code == 2 and "access denied" in err and "no such file" not in err, err

    proxy.configure()  # the server is back: the same checkpoint is fine; real damage reads as damage
    _load_all(f"{url}/ck", opts, state)
    direct.fs().rm_file(f"{direct.url}/ck/buffers/0/c.1.0")
    rep = ragckpt.open(f"{url}/ck", storage_options=opts).verify()
    assert not rep.ok and any("c.1.0" in p and "missing" in p for p in rep.problems), rep.problems
    with pytest.raises(IntegrityError, match="c.1.0 is missing.*incomplete or damaged"):
        ragckpt.open(f"{url}/ck", storage_options=opts).read("w")


def _open_uploads(direct) -> list[str]:
    return sorted(u["Key"] for u in direct.fs().call_s3("list_multipart_uploads", Bucket=direct.bucket)
                  .get("Uploads", []))


def test_a_lost_reply_to_create_multipart_leaves_no_open_upload(s3_faulty, tmp_path):
    """The server created the upload but its reply was lost: the retry created a second one, and the
    first, whose id was never seen, stayed open (its parts billed for good) after a save and an
    export-hf that both succeeded."""
    from ragckpt.convert.hf_export import export_hf

    url, opts, proxy, direct = s3_faulty
    opts = _opts(opts)
    state = {"w": special_tensor((3 * 1024, 1024), torch.float32, 8)}  # 12 MiB: one multipart object
    proxy.configure(lose_reply=True, methods={"POST"}, path_regex=r"\?uploads", max_faults=1)
    ragckpt.write_global(state, f"{url}/ck", 1, storage_options=opts)
    assert proxy.stats.lost_replies == 1
    proxy.configure(lose_reply=True, methods={"POST"}, path_regex=r"\?uploads", max_faults=1)
    export_hf(f"{url}/ck", f"{url}/hf", memory_bytes=64 << 20, storage_options=opts, write_config=False)
    assert proxy.stats.lost_replies == 1  # counted afresh by configure
    proxy.configure()
    assert _open_uploads(direct) == []
    _load_all(f"{url}/ck", opts, state)


def test_a_failed_reshard_aborts_the_uploads_left_under_its_destination(s3_faulty):
    """A worker process stopped mid-upload (the parent terminates the others when one fails) cannot
    abort its own upload: the failed job aborts what is left open under DST (here an upload of the
    same run standing in for it, and the failing worker's own)."""
    url, opts, proxy, direct = s3_faulty
    opts = _opts(opts, retries=2, throttle_retries=2)
    state = {"w": special_tensor((3 * 1024, 1024), torch.float32, 9)}
    ragckpt.write_global(state, f"{url}/src", 1, storage_options=opts)
    raw = direct.fs()
    key = f"{direct.url.split('://', 1)[1].partition('/')[2]}/dst/buffers/0/c.0.0".lstrip("/")
    uid = raw.call_s3("create_multipart_upload", Bucket=direct.bucket, Key=key)["UploadId"]
    raw.call_s3("upload_part", Bucket=direct.bucket, Key=key, UploadId=uid, PartNumber=1, Body=b"x" * (5 << 20))
    assert _open_uploads(direct) == [key]
    proxy.configure(fail_all=True, methods={"PUT"}, path_regex=r"/dst/buffers/0/c\.1\.0\?.*partNumber=2")
    with pytest.raises(StorageError, match=r"c\.1\.0 \(part 2\): giving up after 2 attempts"):
        ragckpt.reshard.reshard(f"{url}/src", f"{url}/dst", 2, workers=2, storage_options=opts)
    proxy.configure()
    assert _open_uploads(direct) == []


@pytest.mark.slow
def test_a_worker_stopped_mid_upload_leaves_no_open_upload(s3_faulty):
    """The case a hunt found: `reshard --workers 2` to S3, one worker's parts fail for good while the
    other is inside a multipart upload. The parent stops the survivor (SIGTERM: no chance to abort),
    which left its upload open with a part stored; the failed job now aborts it. In order, not by
    timing: a second proxy in front stalls both workers' part 2 for 8 s; once both are held, rank 1's
    parts are made to fail (500 behind the stall) and rank 0's part 2 to stall again for a minute, so
    rank 1's retry fails while rank 0 is still mid-upload."""
    import threading

    from tests.s3_fault_proxy import CannedReply, FaultProxy

    url, opts, proxy, direct = s3_faulty
    state = {"w": special_tensor((6 * 1024, 1024), torch.float32, 10)}  # 2 ranks of 12 MiB: 3 parts each
    ragckpt.write_global(state, f"{url}/src", 1, storage_options=_opts(opts))
    outer = FaultProxy(int(proxy.url.rsplit(":", 1)[1]))
    outer.start()
    part2 = r"/dst/buffers/0/c\.{}\.0\?.*partNumber=2"
    outer.configure(stall=True, stall_s=8, methods={"PUT"}, path_regex=part2.format("[01]"),
                    max_faults_per_request=10**6)
    both_held = threading.Event()

    def then_fail_rank_1() -> None:
        deadline = time.monotonic() + 60
        while outer.stats.stalls < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        proxy.configure(reply=CannedReply(500, "InternalError", "We encountered an internal error."),
                        methods={"PUT"}, path_regex=r"/dst/buffers/0/c\.1\.0\?.*partNumber",
                        max_faults=10**6, max_faults_per_request=10**6)
        outer.configure(stall=True, stall_s=60, methods={"PUT"}, path_regex=part2.format("0"),
                        max_faults_per_request=10**6)
        both_held.set()

    watcher = threading.Thread(target=then_fail_rank_1, daemon=True)
    watcher.start()
    try:
        o = {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint_url": outer.url}}
        with pytest.raises(StorageError, match=r"c\.1\.0 \(part \d\): giving up after 2 attempts: InternalError"):
            ragckpt.reshard.reshard(f"{url}/src", f"{url}/dst", 2, workers=2,
                                    storage_options=_opts(o, retries=2, throttle_retries=2))
        assert both_held.is_set(), "the workers were not both caught mid-upload"
    finally:
        watcher.join(timeout=70)
        outer.stop()
        proxy.configure()
    assert _open_uploads(direct) == []
