"""A commit marker that is there but damaged (a dangling symlink, a directory, a pipe) is reported as
damaged by every reader, never as "not committed", and writers never take it for free space; the
Hugging Face converters' thread pools stop the queued work as soon as one task fails."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ragckpt
from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.convert.hf_export import _ordered_pipeline, export_hf
from ragckpt.convert.hf_import import import_hf
from ragckpt.convert.safetensors_io import RangeFile
from ragckpt.errors import (
    DestinationExistsError,
    FormatError,
    IntegrityError,
    NotCommittedError,
    StorageError,
)
from ragckpt.storage.store import LocalStore
from tests.helpers import cli_run

#: how each damaged marker is made, and what the messages must call it
DAMAGE = {
    "dangling": (lambda p: os.symlink(p + ".gone", p), "is a dangling symlink to"),
    "directory": (os.mkdir, "is a directory, not a regular file"),
    "pipe": (os.mkfifo, "is a pipe, not a regular file"),
}


def checkpoint(parent: Path, name: str = "ck") -> str:
    url = str(parent / name)
    ragckpt.write_global({"w": torch.randn(30, 4), "b": torch.randn(4)}, url, 4, "ragged")
    return url


def damage_marker(url: str, kind: str) -> str:
    """Replace `url`'s COMMITTED by a damaged entry of `kind`; its path."""
    marker = os.path.join(url, "COMMITTED")
    os.unlink(marker)
    DAMAGE[kind][0](marker)
    return marker


def tree(url: str) -> dict[str, tuple[int, int, int]]:
    """Every entry under `url` (links not followed) with its inode, mode and mtime."""
    out = {}
    for d, dirs, files in os.walk(url):
        for n in dirs + files:
            st = os.lstat(os.path.join(d, n))
            out[os.path.join(d, n)] = (st.st_ino, st.st_mode, st.st_mtime_ns)
    return out



def assert_one_line(code: int, err: str, *needles: str, rc: int = 2) -> None:
    lines = err.strip().splitlines()
    assert code == rc and len(lines) == 1 and "Traceback" not in err and "internal error" not in err, (code, err)
    for n in needles:
        assert n in lines[0], (n, lines[0])


# -- item 1: a damaged commit marker -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(DAMAGE))
@pytest.mark.parametrize("allow_uncommitted", [False, True])
def test_open_says_the_marker_is_damaged_not_uncommitted(tmp_path, kind, allow_uncommitted):
    marker = damage_marker(checkpoint(tmp_path), kind)
    with pytest.raises(FormatError) as ei:
        ragckpt.open(os.path.dirname(marker), allow_uncommitted=allow_uncommitted)
    assert not isinstance(ei.value, NotCommittedError)
    msg = str(ei.value)
    assert msg.startswith(f"{marker} {DAMAGE[kind][1]}") and "damaged" in msg and "\n" not in msg, msg
    assert "not committed" not in msg


@pytest.mark.parametrize("kind", sorted(DAMAGE))
@pytest.mark.parametrize("command", [["info"], ["info", "--json"], ["verify"], ["ls"], ["ls", "-l"]])
def test_cli_on_the_checkpoint_says_damaged_in_one_line(tmp_path, kind, command):
    marker = damage_marker(checkpoint(tmp_path), kind)
    code, out, err = cli_run(command[0], os.path.dirname(marker), *command[1:])
    assert_one_line(code, err, f"error: {marker} {DAMAGE[kind][1]}", "damaged")
    assert "NOT COMMITTED" not in out and "not committed" not in err
    if "--json" in command:
        assert json.loads(out)["error"] in err


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_ls_of_the_parent_lists_it_as_damaged(tmp_path, kind):
    good = checkpoint(tmp_path, "good")
    bad = checkpoint(tmp_path, "bad")
    damage_marker(bad, kind)
    code, out, err = cli_run("ls", str(tmp_path))
    assert code == 0, err
    rows = out.splitlines()
    assert len(rows) == 2, rows
    assert rows[0].startswith("DAMAGED") and bad in rows[0] and f"COMMITTED {DAMAGE[kind][1]}" in rows[0], rows
    assert rows[1].startswith("committed") and good in rows[1], rows
    code, out, err = cli_run("ls", str(tmp_path), "--json")
    assert code == 0, err
    row = next(r for r in json.loads(out) if r["url"] == bad)
    assert row["committed"] is False and f"COMMITTED {DAMAGE[kind][1]}" in row["damaged"]


def test_a_checkpoint_without_a_marker_still_says_not_committed(tmp_path):
    url = checkpoint(tmp_path)
    os.unlink(os.path.join(url, "COMMITTED"))
    with pytest.raises(NotCommittedError, match="is not committed"):
        ragckpt.open(url)
    code, out, err = cli_run("info", url)
    assert code == 0 and "NOT COMMITTED" in out, err
    assert_one_line(*cli_run("verify", url)[::2], "is not committed")
    code, out, err = cli_run("ls", str(tmp_path))
    assert code == 0 and out.startswith("INCOMPLETE") and url in out, (out, err)


def test_a_save_whose_rank_0_never_wrote_is_unfinished_not_absent(tmp_path):
    """Rank 0 writes the metadata; when only other ranks wrote, the directory is a failed save, not a
    wrong path."""
    lay = ragckpt.CheckpointLayout.build({"w": ((8,), "float32")}, 2, "row")
    url = str(tmp_path / "half")
    ragckpt.save_shard(url, 1, {"float32": torch.zeros(4)}, lay)
    with pytest.raises(NotCommittedError, match="holds part of a ragckpt checkpoint but no zarr.json: its save did "
                                                "not finish"):
        ragckpt.open(url)
    assert_one_line(*cli_run("info", url)[::2], "its save did not finish")
    with pytest.raises(ragckpt.FormatError, match=r"no ragckpt checkpoint at .*empty \(no zarr.json found\)"):
        ragckpt.open(str(tmp_path / "empty"))
    # judged by the objects' names: a folder merely called buffers is no part of a checkpoint
    (tmp_path / "other" / "buffers" / "x").mkdir(parents=True)
    (tmp_path / "other" / "buffers" / "x" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ragckpt.FormatError, match=r"no ragckpt checkpoint at .*other") as info:
        ragckpt.open(str(tmp_path / "other"))
    assert not isinstance(info.value, NotCommittedError)


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_writers_treat_a_damaged_marker_as_present(tmp_path, kind):
    """Without overwrite, nothing writes into the damaged checkpoint or replaces its marker; with
    overwrite it is replaced by a readable checkpoint."""
    url = checkpoint(tmp_path)
    damage_marker(url, kind)
    before = tree(url)
    lay = ragckpt.CheckpointLayout.build({"w": ((8,), "float32")}, 1, "row")
    with pytest.raises(DestinationExistsError):
        ragckpt.write_global({"w": torch.zeros(8)}, url, 1)
    for save in (lambda: ragckpt.save_shard(url, 0, {"float32": torch.zeros(8)}, lay), lambda: ragckpt.commit(url)):
        with pytest.raises(DestinationExistsError,
                           match=re.escape(f"COMMITTED {DAMAGE[kind][1]}") + ".*: the checkpoint there is damaged"):
            save()
    assert tree(url) == before, "a writer changed the damaged checkpoint"
    ragckpt.write_global({"w": torch.ones(8)}, url, 1, overwrite=True)
    assert torch.equal(ragckpt.open(url).read("w"), torch.ones(8))


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_creating_the_marker_over_a_damaged_one_names_the_damage(tmp_path, kind):
    """The create-if-absent write of the marker is what refuses it at the last moment (a committer
    that checked before the damage appeared): its message names the damage, not another writer."""
    url = checkpoint(tmp_path)
    marker = damage_marker(url, kind)
    before = tree(url)
    with pytest.raises(DestinationExistsError) as ei:
        LocalStore(url).write("COMMITTED", [b"{}"], create_only=True)
    msg = str(ei.value)
    assert msg.startswith(f"{marker} is already there but {DAMAGE[kind][1]}"), msg
    assert "damaged" in msg and "another writer" not in msg
    assert tree(url) == before  # the damaged entry kept, no temporary left


def test_a_dangling_link_in_place_of_an_object_is_named_as_one(tmp_path):
    url = checkpoint(tmp_path)
    store = LocalStore(url)
    chunk = next(k for k in store.list("buffers") if not k.endswith("zarr.json"))
    path = os.path.join(url, *chunk.split("/"))
    os.unlink(path)
    os.symlink(path + ".gone", path)
    assert store.exists(chunk) and store.object_problem(chunk) == f"a dangling symlink to {path}.gone"
    for op in (store.read, store.size):
        with pytest.raises(StorageError, match=f"object {path} is a dangling symlink to {path}.gone, not a regular"):
            op(chunk)
    os.unlink(path)
    with pytest.raises(StorageError, match=f"object {path} is missing"):
        store.read(chunk)
    assert not store.exists(chunk) and store.object_problem(chunk) is None
    assert store.object_problem("zarr.json") is None


# -- item 2: the Hugging Face converters' pools ---------------------------------------------------------------

def test_ordered_pipeline_keeps_order_and_its_window():
    started: list[int] = []
    consumed: list[int] = []
    most_ahead = [0]
    lock = threading.Lock()

    def fn(i: int) -> int:
        with lock:
            started.append(i)
            most_ahead[0] = max(most_ahead[0], len(started) - len(consumed))
        time.sleep(0.002 * (i % 3))
        return i

    for r in _ordered_pipeline(fn, list(range(40)), workers=3, window=5):
        with lock:
            consumed.append(r)
    assert consumed == list(range(40))
    assert most_ahead[0] <= 5, most_ahead


def test_ordered_pipeline_stops_its_workers_when_the_consumer_fails():
    """The consumer's failure (a sink write, Ctrl-C) closes the pipeline: nothing more starts, and it
    returns only when no task is running, before the caller's clean-up."""
    started: list[int] = []
    running = [0]
    lock = threading.Lock()

    def fn(i: int) -> int:
        with lock:
            started.append(i)
            running[0] += 1
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return i

    with pytest.raises(KeyboardInterrupt), closing(_ordered_pipeline(fn, list(range(50)), 2, 4)) as results:
        for _ in results:
            raise KeyboardInterrupt
    assert running[0] == 0, "a task was still running after the pipeline was closed"
    n = len(started)
    time.sleep(0.2)
    assert len(started) == n and n <= 5, started


def test_export_hf_stops_queued_reads_when_one_fails(tmp_path, monkeypatch):
    """One read fails while the writer waits on a slow earlier one: the queued reads never start
    (a plain thread pool ran them all while the writer waited), the export fails with that read's
    error, and nothing of it is left."""
    src = str(tmp_path / "src")
    ragckpt.write_global({f"t{i}": torch.randn(64, 4096) for i in range(12)}, src, 2, "row")
    real = Checkpoint.read_pieces  # a local export's reads
    calls: list[int] = []
    lock = threading.Lock()

    def read_pieces(self, *a, **k):
        with lock:
            n = len(calls)
            calls.append(n)
        if n == 0:
            time.sleep(0.5)  # the writer waits on this one, in order
        if n == 1:
            raise IntegrityError("object damaged (test)")
        return real(self, *a, **k)

    monkeypatch.setattr(Checkpoint, "read_pieces", read_pieces)
    out = tmp_path / "hf"
    t0 = time.perf_counter()
    with pytest.raises(IntegrityError, match="object damaged"):
        export_hf(src, str(out), workers=2, memory_bytes=16 << 20)
    assert time.perf_counter() - t0 < 5
    assert sorted(calls) == [0, 1], f"{len(calls)} reads started; the queued ones should not have"
    assert not out.exists()


def test_import_hf_stops_the_other_ranks_when_one_source_read_fails(tmp_path, monkeypatch):
    """import-hf writes through `write_streaming`, whose pool stops every rank at its next chunk."""
    model = tmp_path / "model"
    model.mkdir()
    save_file({f"w{i}": torch.randn(256, 1024) for i in range(16)}, str(model / "model.safetensors"))
    real = RangeFile.read_many
    calls: list[int] = []
    lock = threading.Lock()

    def read_many(self, reqs):
        with lock:
            n = len(calls)
            calls.append(n)
        if n == 1:
            raise FormatError("source read failed (test)")
        time.sleep(0.05)
        return real(self, reqs)

    monkeypatch.setattr(RangeFile, "read_many", read_many)
    with pytest.raises(FormatError, match="source read failed"):
        import_hf(str(model), str(tmp_path / "ck"), 4, layout="row", workers=2, memory_bytes=4 << 20)
    assert len(calls) <= 4, f"{len(calls)} chunk reads ran; the other ranks should have stopped"


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"objects_crc32c": {}}', b'[1, 2]',
                                     b'{"objects_crc32c": {"zarr.json": "123"}}'])
def test_ls_of_the_parent_lists_a_corrupt_marker_as_damaged(tmp_path, content):
    """A regular COMMITTED file that is no commit marker (cut short, overwritten): `info` refuses
    the checkpoint as corrupt, so `ls` of its parent must not list it as committed."""
    good = checkpoint(tmp_path, "good")
    bad = checkpoint(tmp_path, "bad")
    with open(os.path.join(bad, "COMMITTED"), "wb") as f:
        f.write(content)
    assert "COMMITTED is corrupt" in cli_run("info", bad)[2]
    code, out, err = cli_run("ls", str(tmp_path), "-l")
    assert code == 0, err
    rows = out.splitlines()
    assert rows[0].startswith("DAMAGED") and bad in rows[0] and "COMMITTED is corrupt" in rows[0], rows
    assert rows[1].startswith("committed") and good in rows[1], rows


def test_a_save_cut_short_while_writing_zarr_json_reads_as_unfinished_not_corrupt(tmp_path, monkeypatch):
    """Rank 0's root document is replaced whole: a save stopped half-way through writing it (a kill,
    a full disk) used to leave a torn zarr.json that open, info and ls called corrupt or DAMAGED."""
    lay = ragckpt.CheckpointLayout.build({"w": ((8,), "float32")}, 2, "row")
    url = str(tmp_path / "ck")
    ragckpt.save_shard(url, 1, {"float32": torch.ones(4)}, lay)
    real_write = os.write

    def torn(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").split("/")[-1].startswith("zarr.json"):
            real_write(fd, bytes(data)[: len(data) // 2])
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", torn)
    with pytest.raises(ragckpt.RagckptError, match="No space left"):
        ragckpt.save_shard(url, 0, {"float32": torch.ones(4)}, lay)
    monkeypatch.setattr(os, "write", real_write)
    assert sorted(p.name for p in Path(url).iterdir()) == ["buffers", "ranks"]  # no torn document, no temp file
    with pytest.raises(NotCommittedError, match="its save did not finish"):
        ragckpt.open(url)
    ragckpt.save_shard(url, 0, {"float32": torch.ones(4)}, lay)  # the re-run finishes it
    ragckpt.commit(url)
    assert torch.equal(ragckpt.open(url).read("w"), torch.ones(8))
