"""Hand-edited or damaged metadata (found by fuzzing thousands of mutations): every reader, `info`,
`verify`, `ls`, `reshard` and `export-hf` give one clear error naming the file, never a traceback, a
hang, a huge allocation, or data read through a misparsed shape. Edits are made with the commit
marker's checksum recomputed, as a hand edit or a forged marker would be, so that the manifest's own
validation is what must catch them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ragckpt
from cli.main import cli as main
from ragckpt.errors import FormatError, IntegrityError, RagckptError
from ragckpt.storage.checksum import crc32c

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "cli.main"]


def build(tmp_path: Path, layout: str = "ragged") -> str:
    url = str(tmp_path / "ck")
    state = {"a": torch.randn(37, 5), "b": torch.arange(10), "z": torch.zeros(0, 4)}
    ragckpt.write_global(state, url, 3, layout, user={"step": 3})
    return url


def edit_manifest(url: str, fn, *, uncommit: bool = False) -> None:
    p = os.path.join(url, "zarr.json")
    doc = json.load(open(p))
    fn(doc["attributes"]["ragckpt"])
    Path(p).write_bytes(json.dumps(doc).encode())
    if uncommit:
        os.unlink(os.path.join(url, "COMMITTED"))
        return
    mp = os.path.join(url, "COMMITTED")
    mk = json.load(open(mp))
    mk["objects_crc32c"]["zarr.json"] = crc32c(Path(p).read_bytes())
    Path(mp).write_text(json.dumps(mk))


def cli(*args: str) -> tuple[int, str]:
    """The command in this process (one interpreter start per command would dominate the file)."""
    r = CliRunner().invoke(main, list(args))
    return r.exit_code, r.stderr


def cli_process(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """The command as its own process, for what must not hang the test if it blocks."""
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def one_line(code: int, err: str, *needles: str, rc: int = 2) -> None:
    lines = err.strip().splitlines()
    assert code == rc and len(lines) == 1 and "Traceback" not in err and "internal error" not in err, (code, err)
    for n in needles:
        assert n in lines[0], (n, lines[0])


def set_in(path: tuple, value):
    def fn(m: dict) -> None:
        target = m
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = value
    return fn


def test_names_writers_accept_are_read_back(tmp_path):
    """The validator checks types, not taste: an empty tensor name was always writable."""
    url = str(tmp_path / "ck")
    ragckpt.write_global({"": torch.arange(3.0), "w": torch.zeros(2)}, url, 2)
    assert torch.equal(ragckpt.open(url).read(""), torch.arange(3.0)) and ragckpt.open(url).verify().ok


MANIFEST_EDITS = {
    "shape as a string (was read one character at a time)": (set_in(("layouts", 0, "shapes", 0), "37"),
                                                             "layouts[0].shapes"),
    "negative dimension": (set_in(("layouts", 0, "shapes", 0), [-10, 5]), "layouts[0].shapes"),
    "float dimension": (set_in(("layouts", 0, "shapes", 0), [37.0, 5]), "layouts[0].shapes"),
    "boolean dimension": (set_in(("layouts", 0, "shapes", 0), [True, 5]), "layouts[0].shapes"),
    "dimension beyond int64": (set_in(("layouts", 0, "shapes", 0), [10**30, 5]), "layouts[0].shapes"),
    "zero-size tensor with a huge dimension": (set_in(("layouts", 0, "shapes", 1), [0, 10**19]),
                                               "layouts[0].shapes"),
    "elements beyond int64": (set_in(("layouts", 0, "shapes", 0), [2**40, 2**40]), "layouts[0].shapes"),
    "offset beyond int64": (set_in(("layouts", 0, "offsets", 0), 10**20), "layouts[0].offsets"),
    "huge world size": (set_in(("world_size",), 2**40), "'world_size'"),
    "huge block size": (set_in(("block_bytes",), 2**62), "'block_bytes'"),
    "user metadata not an object": (set_in(("user",), [1, 2]), "'user'"),
    "created not an object": (set_in(("created",), "hello"), "'created'"),
    "tensor name null": (set_in(("buffers", 0, "tensors", 0), None), "buffers[0].tensors"),
    "tensors not a list": (set_in(("buffers", 0, "tensors"), 5), "buffers[0].tensors"),
    "buffer layout index out of range": (set_in(("buffers", 0, "layout"), 7), "buffers[0].layout"),
    "dims beyond the shape": (set_in(("layouts", 0, "dims", 0), 5), "layouts[0].dims"),
    "format version true": (set_in(("format_version",), True), "'format_version'"),
    "tensors that do not fit the shard size": (set_in(("layouts", 0, "shard_size"), 3),
                                               "describes an inconsistent layout"),
    # fields FORMAT.md defines that no reader checked (each was accepted, and verify said OK)
    "format of another program": (set_in(("format",), "other"), "manifest field 'format' is 'other'"),
    "format missing": (lambda m: m.pop("format"), "manifest field 'format' is None"),
    "storage dtype of another width": (set_in(("buffers", 0, "storage_dtype"), "int8"), "buffers[0].storage_dtype"),
    "row kind on a flat layout": (set_in(("layout",), "row"), "expected 'per_tensor', as every layout of a 'row'"),
}


#: edits also run through every command (each costs a few interpreter starts)
CLI_EDITS = ("shape as a string (was read one character at a time)", "huge world size", "tensor name null",
             "tensors that do not fit the shard size")


@pytest.mark.parametrize("what", sorted(MANIFEST_EDITS))
def test_a_damaged_manifest_is_one_clear_error_everywhere(tmp_path, what):
    edit, needle = MANIFEST_EDITS[what]
    url = build(tmp_path)
    edit_manifest(url, edit)
    with pytest.raises(FormatError, match="the checkpoint metadata is corrupt") as e:
        ragckpt.open(url)
    assert needle in str(e.value) and f"{url}/zarr.json" in str(e.value) and len(str(e.value)) < 400
    if what not in CLI_EDITS:
        return
    for args in (["info", url], ["verify", url], ["reshard", url, str(tmp_path / "out"), "--to", "2"],
                 ["export-hf", url, str(tmp_path / "hf")]):
        one_line(*cli(*args), needle)
    assert not (tmp_path / "out").exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("edit, needle", [
    (set_in(("layouts", 0, "units"), {"array": "meta/units/7", "shape": [9, 9]}), "layouts[0].units"),
    (set_in(("layout",), "ragged"), "expected 'flat', as every layout of a 'ragged'"),
])
def test_a_row_manifest_must_name_its_own_units_table_and_family(tmp_path, edit, needle):
    url = build(tmp_path, "row")
    edit_manifest(url, edit)
    with pytest.raises(FormatError, match="the checkpoint metadata is corrupt") as e:
        ragckpt.open(url)
    assert needle in str(e.value), e.value


def test_an_uncommitted_damaged_manifest_is_reported_by_info_and_ls(tmp_path):
    url = build(tmp_path)
    edit_manifest(url, set_in(("layouts", 0, "shapes"), None), uncommit=True)
    one_line(*cli("info", url), "layouts[0].shapes")
    r = CliRunner().invoke(main, ["ls", str(tmp_path)])
    assert r.exit_code == 0 and "DAMAGED" in r.stdout and "layouts[0].shapes" in r.stdout, r.output


def test_a_marker_with_loose_types_is_refused(tmp_path):
    """`True == 1` and `1.0 == 1` in Python: the marker's fields are compared with their types."""
    url = build(tmp_path)
    mp = os.path.join(url, "COMMITTED")
    good = json.load(open(mp))
    for field, value in (("format_version", True), ("format_version", 1.0), ("total_bytes", float(good["total_bytes"]))):
        Path(mp).write_text(json.dumps({**good, field: value}))
        with pytest.raises(FormatError, match=f"says {field} "):
            ragckpt.open(url)
    crcs = dict(good["objects_crc32c"])
    crcs["zarr.json"] = str(crcs["zarr.json"])  # a checksum as a string
    Path(mp).write_text(json.dumps({**good, "objects_crc32c": crcs}))
    with pytest.raises(FormatError, match="COMMITTED is corrupt"):
        ragckpt.open(url)


def test_deeply_nested_json_is_a_clear_error(tmp_path):
    url = build(tmp_path)
    Path(url, "COMMITTED").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FormatError, match="COMMITTED is corrupt"):
        ragckpt.open(url)
    one_line(*cli("info", url), "COMMITTED is corrupt")
    os.unlink(os.path.join(url, "COMMITTED"))
    Path(url, "zarr.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(RagckptError):
        ragckpt.open(url, allow_uncommitted=True)


def test_a_pipe_in_place_of_an_object_is_refused_without_blocking(tmp_path):
    url = build(tmp_path)
    chunk = os.path.join(url, "buffers/0/c.1.0")
    os.unlink(chunk)
    os.mkfifo(chunk)
    done: list = []

    def read_all() -> None:
        try:
            ragckpt.open(url).read("a")
        except RagckptError as e:
            done.append(e)

    t = threading.Thread(target=read_all, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "reading a pipe where an object should be blocked"
    assert done and "c.1.0 is a pipe, not a regular file" in str(done[0])
    os.unlink(chunk)
    os.mkfifo(os.path.join(url, "COMMITTED.tmp"))
    os.replace(os.path.join(url, "COMMITTED.tmp"), os.path.join(url, "COMMITTED"))
    p = cli_process("info", url, timeout=30)
    one_line(p.returncode, p.stderr, "COMMITTED is a pipe")


def test_verify_names_an_unreadable_object_and_checks_the_rest(tmp_path):
    url = build(tmp_path)
    chunk = os.path.join(url, "buffers/0/c.1.0")
    os.unlink(chunk)
    os.symlink(chunk, chunk)  # a link to itself: stat fails with ELOOP
    report = ragckpt.open(url).verify()
    assert not report.ok and len(report.problems) == 1
    assert "c.1.0 is a symlink loop, not a regular file" in report.problems[0]
    p = cli_process("verify", url)
    assert p.returncode == 1 and "BAD" in p.stderr and "c.1.0 is a symlink loop" in p.stderr
    assert p.stdout.startswith("FAILED (1 problem(s))") and "restore the objects named above" in p.stdout, p.stdout


def test_verify_calls_a_permission_failure_a_storage_error_not_damage(tmp_path, monkeypatch):
    """A chunk that cannot be stat'ed for want of permission (tests run as root, so os.stat is made
    to fail as it does for another user) was listed as BAD, "a broken link or a link loop": verify
    said to restore an object that is intact. It is the file system failing, as a read would be."""
    url = build(tmp_path)
    chunk = os.path.join(url, "buffers/0/c.1.0")
    real_stat = os.stat

    def stat(path, *a, **k):
        if os.fspath(path) == chunk:
            raise PermissionError(13, "Permission denied", chunk)
        return real_stat(path, *a, **k)

    ck = ragckpt.open(url)
    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(ragckpt.StorageError) as e:
        ck.verify()
    assert not isinstance(e.value, ragckpt.BadObjectError)
    assert str(e.value) == f"cannot read {chunk}: Permission denied"
    monkeypatch.setattr(os, "stat", real_stat)
    assert ck.verify().ok


@pytest.mark.parametrize("kind, make", [("a directory", os.mkdir), ("a pipe", os.mkfifo),
                                        ("a dangling symlink to", lambda p: os.symlink(p + ".gone", p))])
def test_verify_and_reshard_name_an_entry_of_the_wrong_kind_where_a_chunk_should_be(tmp_path, kind, make):
    """A directory where a chunk should be was reported "missing", a pipe as "0 bytes, expected ...":
    both send the user looking for the wrong thing."""
    url = build(tmp_path)
    chunk = os.path.join(url, "buffers/0/c.1.0")
    os.unlink(chunk)
    make(chunk)
    report = ragckpt.open(url).verify()
    assert not report.ok and len(report.problems) == 1, report.problems
    assert f"c.1.0 is {kind}" in report.problems[0] and "rank 1" in report.problems[0], report.problems
    code, err = cli("reshard", url, str(tmp_path / "dst"), "--to", "2")
    assert code == 2 and f"c.1.0 is {kind}" in err and "nothing was written" in err, err
    assert not (tmp_path / "dst").exists()


def test_forged_extras_that_are_not_safetensors_name_the_object(tmp_path):
    import numpy as np

    url = str(tmp_path / "ck")
    lay = ragckpt.CheckpointLayout.build({"w": ((4,), "float32")}, 1, "row")
    ragckpt.save_shard(url, 0, {"float32": torch.ones(4)}, lay, extra={"rng": torch.zeros(3)})
    ragckpt.commit(url)
    junk = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"
    Path(url, "extra/0.safetensors").write_bytes(junk)
    # forge the tables so the checksum matches: only a broken writer or a hand edit gets here
    from ragckpt.checkpoint.writer import read_table, table_chunk_key, write_table

    store = ragckpt.open(url).store
    table = read_table(store, "meta/extra").copy()
    table[0] = (len(junk), crc32c(junk))
    crc = write_table(store, "meta/extra", np.ascontiguousarray(table), atomic=True)
    mp = os.path.join(url, "COMMITTED")
    mk = json.load(open(mp))
    mk["objects_crc32c"][table_chunk_key("meta/extra", 2)] = crc
    Path(mp).write_text(json.dumps(mk))
    with pytest.raises(IntegrityError, match=r"extra/0.safetensors \(extras of rank 0\) is not a safetensors file"):
        ragckpt.open(url).extra(0)


def test_ls_lists_a_checkpoint_that_lost_its_root_document_as_damaged(tmp_path):
    good = build(tmp_path)
    bad = str(tmp_path / "bad")
    ragckpt.write_global({"w": torch.zeros(3)}, bad, 1)
    os.unlink(os.path.join(bad, "zarr.json"))
    out = cli_process("ls", str(tmp_path))
    assert out.returncode == 0, out.stderr
    rows = out.stdout.splitlines()
    assert any(r.startswith("DAMAGED") and bad in r and "zarr.json is missing" in r for r in rows), rows
    assert any(r.startswith("committed") and good in r for r in rows), rows
    one_line(*cli("info", bad), "has a COMMITTED marker but no zarr.json")
    one_line(*cli("ls", bad), "has a COMMITTED marker but no zarr.json")
