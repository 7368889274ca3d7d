"""Durability, crash windows and colliding writers: what is fsynced before a rank counts as done,
what an earlier attempt leaves behind, how a failed flush and a crash while deleting end, and what
two jobs started into one destination at once do to each other."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest
import torch

import ragckpt
from ragckpt import FormatError, NotCommittedError, StorageError
from ragckpt.storage import store as store_mod
from tests.helpers import assert_bit_equal, fill_failing_at, special_tensor


def _layout(W: int = 3) -> tuple[ragckpt.CheckpointLayout, torch.Tensor]:
    t = special_tensor((40, 6), torch.float32)
    return ragckpt.CheckpointLayout.build({"w": ((40, 6), "float32")}, W, "row"), t


def _rank_buffer(lay: ragckpt.CheckpointLayout, t: torch.Tensor, r: int) -> torch.Tensor:
    start = int(lay.rank_sizes(0)[:r].sum())
    return t.reshape(-1)[start : start + int(lay.rank_sizes(0)[r])].clone()


def _record_fsyncs(monkeypatch) -> list[str]:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_rank_record_and_new_parent_directories_are_made_durable(tmp_path, monkeypatch):
    """When save_shard returns, its rank record is on disk, and so are the entries of every directory
    it had to create, above the checkpoint root too (a power loss must not drop the whole save)."""
    lay, t = _layout()
    url = tmp_path / "run7" / "step_10" / "ck"
    synced = _record_fsyncs(monkeypatch)
    ragckpt.save_shard(str(url), 1, {"float32": _rank_buffer(lay, t, 1)}, lay)
    assert str(url / "ranks" / "1.json") in synced
    for d in (url / "ranks", url, tmp_path / "run7" / "step_10", tmp_path / "run7", tmp_path):
        assert str(d) in synced, d


def test_resaving_a_rank_removes_its_old_record_before_its_objects(tmp_path, monkeypatch):
    """A retry into the same directory that dies half way through a rank must leave that rank
    unfinished: its record from the earlier attempt used to survive, and commit then committed
    the torn objects."""
    lay, t = _layout()
    url = str(tmp_path / "ck")
    for r in range(3):
        ragckpt.save_shard(url, r, {"float32": _rank_buffer(lay, t, r)}, lay, save_id="step-5")
    real = store_mod.LocalStore.write

    def write(self, key, parts, **kw):
        if key.startswith("buffers/0/c.1."):
            raise OSError("simulated crash while rank 1 rewrites its objects")
        return real(self, key, parts, **kw)

    monkeypatch.setattr(store_mod.LocalStore, "write", write)
    with pytest.raises(OSError, match="simulated crash"):
        ragckpt.save_shard(url, 1, {"float32": _rank_buffer(lay, t, 1)}, lay, save_id="step-5")
    monkeypatch.undo()
    with pytest.raises(FormatError, match=r"1 of 3 ranks have not finished saving \(ranks 1\)"):
        ragckpt.commit(url)
    ragckpt.save_shard(url, 1, {"float32": _rank_buffer(lay, t, 1)}, lay, save_id="step-5")
    ragckpt.commit(url)
    assert_bit_equal(ragckpt.open(url).read("w"), t)


def test_a_rank_record_cut_short_counts_as_unfinished(tmp_path):
    lay, t = _layout()
    url = tmp_path / "ck"
    for r in range(3):
        ragckpt.save_shard(str(url), r, {"float32": _rank_buffer(lay, t, r)}, lay)
    rec = url / "ranks" / "2.json"
    rec.write_bytes(rec.read_bytes()[:10])  # what a power loss before the record was synced leaves
    with pytest.raises(FormatError, match=r"1 of 3 ranks have not finished saving \(ranks 2\)"):
        ragckpt.commit(str(url))


class _FailingSyncfs:
    """A libc whose syncfs reports a write-back error, as Linux does after EIO or ENOSPC."""

    def __init__(self, err: int):
        self.err = err

    def syncfs(self, fd: int) -> int:
        ctypes.set_errno(self.err)
        return -1


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_a_failed_file_system_flush_fails_the_save_before_the_marker(tmp_path, monkeypatch, err):
    """More objects than are fsynced one by one go through one syncfs; when it reports a write-back
    error the save fails (it used to fall back to sync(), which reports nothing, and commit)."""
    monkeypatch.setattr(store_mod, "_libc", _FailingSyncfs(err))
    state = {"w": special_tensor((200, 3), torch.float32)}
    url = str(tmp_path / "ck")
    with pytest.raises(StorageError, match=rf"cannot flush .*{os.strerror(err)}.*not committed"):
        ragckpt.write_global(state, url, 100, "row")  # 100 ranks: hundreds of objects, one syncfs
    assert not os.path.exists(tmp_path / "ck" / "COMMITTED")
    monkeypatch.setattr(store_mod, "_libc", _FailingSyncfs(errno.ENOSYS))  # no syncfs: sync() instead
    ragckpt.write_global(state, url, 100, "row", overwrite=True)
    assert_bit_equal(ragckpt.open(url).read("w"), state["w"])


def test_interrupted_rerun_of_an_interrupted_reshard_can_still_be_rerun(tmp_path, monkeypatch):
    """A reshard re-run replaces the uncommitted remainder of its own earlier run without
    --overwrite, recognising it by the root document. A re-run that itself died while deleting
    used to take that document with it, and every later run then demanded --overwrite."""
    from ragckpt.reshard.offline import reshard

    state = {"a": special_tensor((64, 5), torch.float32), "b": special_tensor((33,), torch.bfloat16)}
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    ragckpt.write_global(state, src, 4)
    reshard(src, dst, 2)
    os.unlink(os.path.join(dst, "COMMITTED"))  # what an interrupted run leaves: no marker
    real = store_mod.LocalStore.delete

    def delete(self, key):
        if key == "zarr.json":  # everything else is gone by now
            raise OSError("simulated crash while deleting")
        return real(self, key)

    monkeypatch.setattr(store_mod.LocalStore, "delete", delete)
    with pytest.raises(OSError, match="simulated crash"):
        reshard(src, dst, 2)
    monkeypatch.undo()
    assert os.listdir(dst) == ["zarr.json"]
    with pytest.raises((NotCommittedError, FormatError)):
        ragckpt.open(dst)
    reshard(src, dst, 2)  # no overwrite needed
    for k, v in state.items():
        assert_bit_equal(ragckpt.open(dst).read(k), v)


def test_two_jobs_started_into_one_destination_one_stops_before_writing(tmp_path, monkeypatch):
    """Job B checks the destination and finds it empty; job A then writes and commits there. B must
    stop at its first write (the root document is created create-if-absent) instead of rewriting
    A's objects and only failing at its commit, which left A's committed checkpoint corrupt."""
    import ragckpt.checkpoint.writer as writer

    a = {"w": special_tensor((40, 6), torch.float32, 1)}
    b = {"w": special_tensor((40, 6), torch.float32, 2)}
    url = str(tmp_path / "ck")
    real = writer.check_checkpoint_destination

    def racing(store, overwrite):
        real(store, overwrite)  # B: empty
        monkeypatch.setattr(writer, "check_checkpoint_destination", real)
        ragckpt.write_global(a, url, 2)  # meanwhile A saves

    monkeypatch.setattr(writer, "check_checkpoint_destination", racing)
    with pytest.raises(ragckpt.DestinationExistsError, match="another job started writing a checkpoint"):
        ragckpt.write_global(b, url, 2)
    ck = ragckpt.open(url)
    assert ck.verify().ok
    assert_bit_equal(ck.read("w"), a["w"])


def test_an_overwrite_racing_another_job_gets_a_clear_error(tmp_path, monkeypatch):
    """Two jobs replacing one destination at once (from an adversarial review: 2 processes x 15
    overwrites): the one whose files the other moved away raised a bare FileNotFoundError from its
    flush, or from the rename that sets the old contents aside."""
    from ragckpt.storage import destination

    url = str(tmp_path / "ck")
    store = store_mod.LocalStore(url)
    store.write("a", [b"x" * 10])
    os.rename(url, str(tmp_path / "moved"))  # the other job set it aside meanwhile, and started anew
    os.mkdir(url)
    with pytest.raises(StorageError, match=r"ck/a vanished before it was flushed to disk: another job is writing into "
                                           r".*ck at the same time, or removed it; let one job finish, then re-run"):
        store.sync()
    url = str(tmp_path / "ck2")
    ragckpt.write_global({"w": torch.arange(6.0)}, url, 2)
    real_rename = os.rename

    def other_job_first(a, b):  # the other job renames it away between the check and this rename
        real_rename(a, a + ".theirs")
        real_rename(a + ".theirs", a + ".gone")
        return real_rename(a, b)

    monkeypatch.setattr(destination.os, "rename", other_job_first)
    with pytest.raises(ragckpt.DestinationError, match=r"ck2 changed while it was being set aside for --overwrite: "
                                                       "another job is replacing it at the same time"):
        ragckpt.write_global({"w": torch.zeros(6)}, url, 2, overwrite=True)
    monkeypatch.undo()
    assert_bit_equal(ragckpt.open(url + ".gone").read("w"), torch.arange(6.0))  # nothing lost: it is where it went


def test_emptying_a_destination_another_job_writes_into_names_the_race(tmp_path, monkeypatch):
    """What the other job removed first is skipped; what it adds meanwhile ("directory not empty")
    is one clear error instead of a bare OSError from shutil."""
    import shutil

    root = tmp_path / "dst"
    (root / "buffers" / "0").mkdir(parents=True)
    (root / "buffers" / "0" / "c.0.0").write_bytes(b"x")
    (root / "gone").write_bytes(b"y")
    store = store_mod.LocalStore(str(root))
    real_unlink = os.unlink

    def other_job_deleted_it_first(path, *a, **k):
        real_unlink(path, *a, **k)
        return real_unlink(path, *a, **k)

    monkeypatch.setattr(store_mod.os, "unlink", other_job_deleted_it_first)
    store.delete_all()
    monkeypatch.undo()
    assert not any(root.iterdir())
    (root / "buffers").mkdir()

    def other_job_adds_files(path, *a, **k):
        raise OSError(errno.ENOTEMPTY, "Directory not empty", path)

    monkeypatch.setattr(shutil, "rmtree", other_job_adds_files)
    with pytest.raises(StorageError, match=r"cannot delete .*dst/buffers: Directory not empty \(is another job writing "
                                           r"into .*dst at the same time\?\); let one job finish, then re-run"):
        store.delete_all()


def test_a_reshard_whose_destination_another_reshard_replaced_does_not_commit(tmp_path, monkeypatch):
    """A second, identical reshard takes the first one's unfinished output for an interrupted run
    and replaces it. The first one must then refuse to commit: its rank records describe objects
    that are gone (it used to commit a checkpoint with objects missing)."""
    from ragckpt.reshard import offline

    state = {"a": special_tensor((64, 5), torch.float32), "b": special_tensor((33,), torch.bfloat16)}
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    ragckpt.write_global(state, src, 4)
    real_share = offline.write_share

    def share_then_intruder(*a, **k):
        out = real_share(*a, **k)
        offline.prepare(src, dst, 2, run_id="the-other-run")  # the second reshard starts over
        return out

    monkeypatch.setattr(offline, "write_share", share_then_intruder)
    with pytest.raises(ragckpt.DestinationReplacedError, match="replaced by another reshard"):
        offline.reshard(src, dst, 2)
    monkeypatch.undo()
    assert not os.path.exists(os.path.join(dst, "COMMITTED"))
    offline.reshard(src, dst, 2)  # a plain re-run recovers
    for k, v in state.items():
        assert_bit_equal(ragckpt.open(dst).read(k), v)


def test_a_rank_record_is_written_only_after_its_data_is_durable(tmp_path, monkeypatch):
    """Write-back may flush files in any order: a record written before its chunks were fsynced
    could reach the disk first, and after a power loss commit would take the torn rank as done."""
    lay, t = _layout()
    url = tmp_path / "ck"
    events: list[tuple[str, str]] = []
    real_write, real_fsync = store_mod.LocalStore.write, os.fsync

    def write(self, key, parts, **kw):
        events.append(("write", key))
        return real_write(self, key, parts, **kw)

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(store_mod.LocalStore, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)
    ragckpt.save_shard(str(url), 1, {"float32": _rank_buffer(lay, t, 1)}, lay)
    record = events.index(("write", "ranks/1.json"))
    chunks = [i for i, (kind, p) in enumerate(events) if kind == "fsync" and "/buffers/0/c.1." in p]
    assert chunks and max(chunks) < record
    assert ("fsync", str(url / "ranks" / "1.json")) in events[record:]


def test_commit_of_a_checkpoint_whose_rank_0_died_mid_metadata_says_so(tmp_path):
    """The root document is written first; a rank 0 killed while writing the unit tables leaves a
    torn table, which commit must report as unfinished metadata (not a decompression error)."""
    url = tmp_path / "ck"
    lay = ragckpt.CheckpointLayout.build({"w": ((40, 6), "float32")}, 3, "row")  # row layouts have unit tables
    t = special_tensor((40, 6), torch.float32)
    for r in range(3):
        ragckpt.save_shard(str(url), r, {"float32": _rank_buffer(lay, t, r)}, lay)
    table = next(p for p in (url / "meta" / "units").rglob("*") if p.is_file() and p.name != "zarr.json")
    table.write_bytes(table.read_bytes()[: len(table.read_bytes()) // 2])
    with pytest.raises(FormatError, match="metadata is incomplete .*rank 0"):
        ragckpt.commit(str(url))


def test_a_failing_rank_stops_the_other_writer_threads_at_a_chunk_boundary(tmp_path):
    """One rank's source fails early: the save raises that failure, and the rank writing beside it
    stops after its current chunk rather than writing its whole buffer for a checkpoint that can
    never commit (the same path Ctrl-C takes)."""
    import threading
    import time

    from ragckpt.checkpoint.writer import write_streaming

    lay = ragckpt.CheckpointLayout.build({"w": ((2, 64 * 1024), "float32")}, 2, "row")  # 256 KiB a rank
    calls = {0: 0, 1: 0}
    lock = threading.Lock()
    data = torch.zeros(64 * 1024).view(torch.uint8).numpy().data

    def fill_for(bi: int, r: int):
        def fill(lo: int, hi: int):
            with lock:
                calls[r] += 1
                n = calls[r]
            if r == 0 and n == 3:
                raise ValueError("rank 0's source failed")
            time.sleep(0.02)
            return data[lo * 4 : hi * 4]
        return fill

    with pytest.raises(ValueError, match="rank 0's source failed"):
        write_streaming(str(tmp_path / "ck"), lay, fill_for, block_bytes=4096, max_chunk_bytes=4096, workers=2)
    assert calls[1] < 20, f"rank 1 wrote {calls[1]} of its 64 chunks after rank 0 had failed"
    assert not (tmp_path / "ck" / "COMMITTED").exists()


def _rank_buffers(state: dict[str, torch.Tensor], lay: ragckpt.CheckpointLayout) -> list[torch.Tensor]:
    flat = state["w"].reshape(-1)
    sizes = lay.rank_sizes(0)
    starts = [int(sizes[:r].sum()) for r in range(lay.world_size)]
    return [flat[starts[r] : starts[r] + int(sizes[r])].clone() for r in range(lay.world_size)]


def test_a_retry_with_a_smaller_layout_leaves_no_stale_objects_in_the_committed_checkpoint(tmp_path):
    """Attempt A (16 rows, rank 1 with extras) dies before commit; retry B into the same directory
    has 5 rows (ranks 5-7 hold nothing) and no extras. The commit removes A's chunks and extras, so
    plain zarr reads rank 7 as zeros (not A's bytes) and a reader going by file names finds no stale
    RNG state; verify reports any such stray it finds."""
    import zarr

    url, W = str(tmp_path / "ck"), 8
    a = {"w": torch.arange(48, dtype=torch.float32).reshape(16, 3) + 1}
    lay_a = ragckpt.CheckpointLayout.build({"w": ((16, 3), "float32")}, W, "row")
    for r, buf in enumerate(_rank_buffers(a, lay_a)):
        ragckpt.save_shard(url, r, {"float32": buf}, lay_a, save_id="a",
                           extra={"rng": torch.ones(3, dtype=torch.uint8)} if r == 1 else None)
    b = {"w": -torch.arange(15, dtype=torch.float32).reshape(5, 3) - 1}
    lay_b = ragckpt.CheckpointLayout.build({"w": ((5, 3), "float32")}, W, "row")
    for r, buf in enumerate(_rank_buffers(b, lay_b)):
        ragckpt.save_shard(url, r, {"float32": buf}, lay_b, save_id="b")
    ragckpt.commit(url)
    assert sorted(os.listdir(tmp_path / "ck" / "buffers" / "0")) == ["c.0.0", "c.1.0", "c.2.0", "c.3.0", "c.4.0",
                                                                       "zarr.json"]
    assert not (tmp_path / "ck" / "extra").exists()  # emptied, so removed
    arr = zarr.open_array(os.path.join(url, "buffers/0"), mode="r")
    assert not arr[7].any() and arr[:].shape == (8, 3)
    ck = ragckpt.open(url)
    assert ck.verify().ok and ck.extra(1) == ({}, {})
    assert_bit_equal(ck.read("w"), b["w"])

    # a stray that got there anyway (copied in, an older version's commit) is named by verify
    (tmp_path / "ck" / "buffers" / "0" / "c.6.0").write_bytes(b"\x01" * 12)
    (tmp_path / "ck" / "extra").mkdir()
    (tmp_path / "ck" / "extra" / "3.safetensors").write_bytes(b"x")
    problems = ragckpt.open(url).verify().problems
    assert len(problems) == 2 and all("not part of this checkpoint (left by an earlier save attempt" in p
                                      for p in problems), problems
    assert problems[0].startswith(f"{url}/buffers/0/c.6.0:") and problems[1].startswith(f"{url}/extra/3.safetensors:")


def test_a_retry_with_fewer_buffers_leaves_no_stale_arrays_or_tables(tmp_path):
    """Attempt A (four row-laid buffers, each with a units table) dies before commit; retry B saves
    one buffer. The commit removes A's other array documents and tables too, so plain zarr lists
    B's one buffer (not three more arrays of zeros) without warnings, and verify names any stale
    array document that gets there anyway."""
    import warnings

    import zarr

    url, W = str(tmp_path / "ck"), 3
    a = {"w": torch.randn(7, 3), "h": torch.randn(4, 2).bfloat16(), "i": torch.arange(5), "m": torch.rand(6) > 0.5}
    lay_a = ragckpt.CheckpointLayout.build({k: (tuple(v.shape), v.dtype) for k, v in a.items()}, W, "row")
    assert len(lay_a.buffers) == 4
    dense_a = _dense_checkpoint(tmp_path, a)
    for r in range(W):
        ragckpt.save_shard(url, r, ragckpt.load(dense_a, lay_a, r), lay_a, save_id="a")
    b = {"w": torch.randn(5, 3)}
    lay_b = ragckpt.CheckpointLayout.build({"w": ((5, 3), torch.float32)}, W, "row")
    dense_b = _dense_checkpoint(tmp_path, b, "b")
    for r in range(W):
        ragckpt.save_shard(url, r, ragckpt.load(dense_b, lay_b, r), lay_b, save_id="b")
    ragckpt.commit(url)
    ck = tmp_path / "ck"
    assert sorted(os.listdir(ck / "buffers")) == ["0", "zarr.json"]
    assert sorted(os.listdir(ck / "meta" / "crc")) == ["0", "zarr.json"]
    assert sorted(os.listdir(ck / "meta" / "units")) == ["0", "zarr.json"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zarr warns about directories it cannot recognise
        assert sorted(zarr.open_group(str(ck / "buffers"), mode="r").array_keys()) == ["0"]
    opened = ragckpt.open(url)
    assert opened.verify().ok
    assert_bit_equal(opened.read("w"), b["w"])

    (ck / "buffers" / "2").mkdir()
    (ck / "buffers" / "2" / "zarr.json").write_bytes((ck / "buffers" / "0" / "zarr.json").read_bytes())
    problems = ragckpt.open(url).verify().problems
    assert len(problems) == 1 and problems[0].startswith(f"{url}/buffers/2/zarr.json: not part of this checkpoint")


def _dense_checkpoint(tmp_path, state, name="dense"):
    """`state` written by one process, for `ragckpt.load` to cut into any layout's rank buffers."""
    url = str(tmp_path / name)
    ragckpt.write_global(state, url, world_size=1)
    return url


@pytest.mark.parametrize("edit", ["world_size", "format_version", "format", "total_bytes", "objects_as_list",
                                  "no_root_entry", "no_table_entry", "not_json"])
def test_a_commit_marker_that_does_not_describe_the_checkpoint_is_refused(tmp_path, edit):
    import json

    url = str(tmp_path / "ck")
    ragckpt.write_global({"w": special_tensor((40, 6), torch.float32)}, url, 3)
    path = tmp_path / "ck" / "COMMITTED"
    mk = json.loads(path.read_text())
    if edit == "world_size":
        mk["world_size"] = 4
    elif edit == "format_version":
        mk["format_version"] = 2
    elif edit == "format":
        mk["format"] = "other"
    elif edit == "total_bytes":
        mk["total_bytes"] = 1
    elif edit == "objects_as_list":
        mk["objects_crc32c"] = list(mk["objects_crc32c"].items())
    elif edit == "no_root_entry":
        del mk["objects_crc32c"]["zarr.json"]
    elif edit == "no_table_entry":
        del mk["objects_crc32c"][next(k for k in mk["objects_crc32c"] if k.startswith("meta/crc/"))]
    path.write_text("{not json" if edit == "not_json" else json.dumps(mk))
    with pytest.raises((FormatError, ragckpt.IntegrityError)) as e:
        ragckpt.open(url)
    assert "COMMITTED" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("failure", [OSError("source read failed"), KeyboardInterrupt()])
def test_an_overwrite_that_fails_half_way_puts_the_old_checkpoint_back(tmp_path, failure):
    """write_global / import-hf / import-dcp replace an existing checkpoint only once their own is
    committed: a failure or Ctrl-C half way through writing leaves the old one as it was."""
    import hashlib

    from ragckpt.checkpoint.writer import write_streaming

    url = str(tmp_path / "ck")
    old = {"w": special_tensor((40, 6), torch.float32, 1)}
    ragckpt.write_global(old, url, 3)

    def digest() -> dict[str, str]:
        return {str(p.relative_to(tmp_path)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted((tmp_path / "ck").rglob("*")) if p.is_file()}

    before = digest()
    lay, fill_for = fill_failing_at(3, failure)

    with pytest.raises(type(failure)) as e:
        write_streaming(url, lay, fill_for, overwrite=True, workers=1)
    if isinstance(failure, KeyboardInterrupt):
        assert e.value.ragckpt_note == f"{url} was left as it was"
    assert digest() == before and not list(tmp_path.glob("ck.replaced-*"))
    assert_bit_equal(ragckpt.open(url).read("w"), old["w"])
    ragckpt.write_global({"v": torch.ones(4096)}, url, 4, overwrite=True)  # a good overwrite replaces it
    assert ragckpt.open(url).names() == ["v"] and not list(tmp_path.glob("ck.replaced-*"))


def test_an_interrupt_while_the_writer_pool_starts_leaves_no_thread_writing(tmp_path, monkeypatch):
    """Ctrl-C right after a pool thread started but before ThreadPoolExecutor recorded it (inside
    `submit`): the writer must still wait for that thread, or it goes on writing after the save has
    returned, into a destination an --overwrite may already have put back."""
    import signal
    import threading
    import time

    from ragckpt.checkpoint.writer import write_streaming

    real_start = threading.Thread.start
    sent = []

    def start(self, *a, **k):
        real_start(self, *a, **k)
        if self.name.startswith("ThreadPoolExecutor") and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)  # lands between t.start() and the pool's bookkeeping
            time.sleep(0.05)  # the KeyboardInterrupt is raised here, inside submit()

    lay = ragckpt.CheckpointLayout.build({"v": ((4, 1024), "float32")}, 4, "row")
    data = torch.zeros(4096).view(torch.uint8).numpy().data
    writes = []

    def fill_for(bi: int, r: int):
        def fill(lo: int, hi: int):
            time.sleep(0.3)
            writes.append(r)
            return data[r * 4096 + lo * 4 : r * 4096 + hi * 4]
        return fill

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(KeyboardInterrupt):
        write_streaming(str(tmp_path / "ck"), lay, fill_for, workers=2, max_chunk_bytes=1024)
    monkeypatch.undo()
    done = len(writes)
    time.sleep(1.0)
    assert sent and len(writes) == done, "a pool thread kept writing after the save returned"


def test_a_save_started_into_a_directory_being_committed_stops_the_commit_or_itself(tmp_path, monkeypatch):
    """Job A's ranks saved and A commits with rank_manifests (as save_state_dict does) while another
    job's rank 1 is writing into the same directory: the commit used the records it was given, never
    looked at storage, and committed a checkpoint whose rank 1 objects were the other job's (checksum
    mismatches on every read). Now the commit sees rank 1's record gone and refuses; and a save that
    finds the directory committed under it fails loudly instead of returning as if all were well."""
    lay, t = _layout(2)
    url = str(tmp_path / "ck")
    docs = [ragckpt.save_shard(url, r, {"float32": _rank_buffer(lay, t, r)}, lay, save_id="jobA") for r in range(2)]
    real = store_mod.LocalStore.write
    state = {"committed": False}

    def write(self, key, parts, **k):
        out = real(self, key, parts, **k)
        if key.startswith("buffers/0/c.1.") and not state["committed"]:  # job B is mid-save: A commits now
            state["committed"] = True
            with pytest.raises(FormatError, match=r"the record of rank 1 \(ranks/1\.json\) is not in storage though "
                                                  r"the rank returned it: .* another save has started into this "
                                                  "directory"):
                ragckpt.commit(url, rank_manifests=docs)
        return out

    monkeypatch.setattr(store_mod.LocalStore, "write", write)
    ragckpt.save_shard(url, 1, {"float32": -_rank_buffer(lay, t, 1)}, lay, save_id="jobB")
    assert state["committed"] and not os.path.exists(os.path.join(url, "COMMITTED"))

    # the other order: A's commit is attempted while B's late rank is writing. B's save holds the
    # directory's claim (it took it over: same process) and has deleted the rank 1 record it replaces,
    # so A's commit is refused in one line and nothing is committed
    url2 = str(tmp_path / "ck2")
    docs = [ragckpt.save_shard(url2, r, {"float32": _rank_buffer(lay, t, r)}, lay, save_id="jobA") for r in range(2)]

    def write_then_commit_a(self, key, parts, **k):
        if key.startswith("buffers/0/c.1.") and not os.path.exists(os.path.join(url2, "COMMITTED")):
            monkeypatch.setattr(store_mod.LocalStore, "write", real)
            ragckpt.commit(url2, rank_manifests=dict(enumerate(docs)))
        return real(self, key, parts, **k)

    monkeypatch.setattr(store_mod.LocalStore, "write", write_then_commit_a)
    with pytest.raises(FormatError, match=r"^cannot commit .*ck2: [^\n]*re-save$"):
        ragckpt.save_shard(url2, 1, {"float32": -_rank_buffer(lay, t, 1)}, lay, save_id="jobB")
    assert not os.path.exists(os.path.join(url2, "COMMITTED"))


def test_info_on_a_save_stopped_while_rank_0_wrote_its_metadata_says_not_committed(tmp_path, monkeypatch):
    """Rank 0 writes its units tables after the root document: info (which opens uncommitted
    checkpoints) called a save stopped in between "metadata is incomplete; restore the object from a
    copy", for a checkpoint with nothing to restore."""
    lay, t = _layout(3)
    url = str(tmp_path / "ck")
    real = store_mod.LocalStore.write

    def write(self, key, parts, **k):
        if key.startswith("meta/units/0/c"):
            raise KeyboardInterrupt  # the process stops here
        return real(self, key, parts, **k)

    monkeypatch.setattr(store_mod.LocalStore, "write", write)
    with pytest.raises(KeyboardInterrupt):
        ragckpt.save_shard(url, 0, {"float32": _rank_buffer(lay, t, 0)}, lay)
    monkeypatch.setattr(store_mod.LocalStore, "write", real)
    with pytest.raises(NotCommittedError, match="is not committed: its save was interrupted or is still running, "
                                                "before rank 0 finished writing the metadata .*meta/units/0/c/0/0 is "
                                                "missing.*re-run the save"):
        ragckpt.open(url, allow_uncommitted=True)


def test_a_reshard_whose_destination_another_overwrite_replaced_stops_writing_into_it(tmp_path, monkeypatch):
    """Reshard A writes DST; reshard B --overwrite sets A's tree aside, makes a new DST at the same path
    and commits. A opened its objects by path, so its remaining chunks landed in B's committed
    checkpoint (verify: checksum mismatches), and A then said DST 'was left uncommitted'. A's writes
    are now pinned to the directory A created: A stops at its next object, B's checkpoint stays whole."""
    from ragckpt.reshard import offline

    a_state = {"w": special_tensor((64, 32), torch.float32, 1)}
    b_state = {"w": special_tensor((64, 32), torch.float32, 2)}
    src_a, src_b, dst = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "dst")
    ragckpt.write_global(a_state, src_a, 2, "row", max_chunk_bytes=1024, block_bytes=512)
    ragckpt.write_global(b_state, src_b, 2, "row", max_chunk_bytes=1024, block_bytes=512)
    real = store_mod.LocalStore.write
    state = {"b_done": False}

    def write(self, key, parts, **k):
        if key.startswith("buffers/0/c.") and not state["b_done"]:
            state["b_done"] = True
            offline.reshard(src_b, dst, 4, overwrite=True)  # B, while A is between two chunks
        return real(self, key, parts, **k)

    monkeypatch.setattr(store_mod.LocalStore, "write", write)
    aborted = []  # on S3 this would abort the other job's open multipart uploads under DST
    monkeypatch.setattr(offline, "abort_uploads", lambda *a, **k: aborted.append(a))
    with pytest.raises(ragckpt.DestinationReplacedError, match="was replaced by another job while this one was "
                                                               "writing into it") as e:
        offline.reshard(src_a, dst, 4, threads=1)
    assert "left uncommitted" not in str(e.value) + str(getattr(e.value, "ragckpt_note", ""))
    assert aborted == []
    monkeypatch.undo()
    ck = ragckpt.open(dst)
    assert ck.verify().ok
    assert_bit_equal(ck.read("w"), b_state["w"])


_REPLACED_UNDER_TORCHRUN = """
import os, socket, sys
sys.path.insert(0, {root!r})
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
from ragckpt.reshard import distributed, offline
from ragckpt.storage import store as store_mod
src_a, src_b, dst = sys.argv[1:4]
real = store_mod.LocalStore.write
done = []

def write(self, key, parts, **k):
    if key.startswith("buffers/0/c.") and not done:
        done.append(1)
        offline.reshard(src_b, dst, 4, overwrite=True)  # B, while A is between two chunks
    return real(self, key, parts, **k)

store_mod.LocalStore.write = write
try:
    distributed.run(src_a, dst, 4, threads=1)
except Exception as e:
    from ragckpt import DestinationReplacedError
    print("ERROR", type(e).__name__, isinstance(e, DestinationReplacedError), e)
else:
    print("NO ERROR")
"""


def test_a_torchrun_reshard_whose_destination_another_overwrite_replaced_stops_writing_into_it(tmp_path):
    """The torchrun path of the test above: its processes wrote by path without pinning the
    directory process 0 prepared, so the other job's committed checkpoint got this run's chunks.
    Each process now pins the directory it sees once it holds process 0's run. The error is a
    DestinationReplacedError as in-process, without the advice to re-run into DST."""
    import subprocess
    import sys
    from pathlib import Path

    a_state = {"w": special_tensor((64, 32), torch.float32, 1)}
    b_state = {"w": special_tensor((64, 32), torch.float32, 2)}
    src_a, src_b, dst = str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "dst")
    ragckpt.write_global(a_state, src_a, 2, "row", max_chunk_bytes=1024, block_bytes=512)
    ragckpt.write_global(b_state, src_b, 2, "row", max_chunk_bytes=1024, block_bytes=512)
    script = tmp_path / "run_a.py"
    script.write_text(_REPLACED_UNDER_TORCHRUN.format(root=str(Path(__file__).resolve().parents[2])))
    p = subprocess.run([sys.executable, str(script), src_a, src_b, dst], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ERROR ReshardReplacedError True process 0 failed to write destination ranks 0-3" in p.stdout, p.stdout
    assert "was replaced by another job while this one was writing into it" in p.stdout, p.stdout
    assert "left uncommitted" not in p.stdout  # DST is the other job's checkpoint, not this one's to redo
    ck = ragckpt.open(dst)
    assert ck.verify().ok
    assert_bit_equal(ck.read("w"), b_state["w"])


def test_a_torchrun_failure_says_when_another_process_found_dst_replaced():
    """Guards the advice after a failed torchrun phase: "re-run" when DST is this job's, nothing when
    the named process found DST replaced, and a word about the process that did when the named one
    failed otherwise (DST is the other job's either way, so its uploads are not aborted)."""
    from ragckpt.reshard.distributed import _UNCOMMITTED, _left_uncommitted

    ok, io = {"ok": True}, {"ok": False, "kind": "OSError"}
    replaced = {"ok": False, "kind": "DestinationReplacedError"}
    assert _left_uncommitted([ok, io]) == _UNCOMMITTED
    assert _left_uncommitted([ok, replaced, io]) == ""
    assert _left_uncommitted([ok, io, replaced]) == "; process 2 found DST replaced by another job: it is that job's now"
