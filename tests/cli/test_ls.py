"""`ragckpt ls` of a directory, a bucket or a prefix: which entries are listed (ragckpt checkpoints
only, also inside plain zarr groups and behind symlinks), how committed, incomplete, damaged and
unreadable ones are shown, the long listing, and the errors for unreadable or missing directories.

Permission tests need a user the file modes apply to: as root they run the command as `nobody`
(setpriv) in a scratch directory everyone can enter (`shared_dir`); as anyone else they chmod and
run in process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

import ragckpt
from ragckpt.checkpoint import manifest as mf
from tests.cli_helpers import (
    _plain_array_doc,
    as_unprivileged,
    assert_one_line,
    mode,
    one_line_error,
    run,
    save,
)
from tests.helpers import cli_run


def test_ls_of_an_unreadable_directory_is_a_permission_error(shared_dir):
    d = shared_dir / "ud"
    save(str(d / "ck"))
    with mode(d, 0o000):
        rc, out, err = as_unprivileged("ls", str(d))
        assert_one_line(rc, err, str(d), "permission denied")
        rc, out, err = as_unprivileged("ls", str(d), "--json")
        assert_one_line(rc, err, str(d), "permission denied")
        assert "permission denied" in json.loads(out)["error"]  # never a silent []


def test_ls_of_a_directory_with_an_unreadable_subdirectory_fails(shared_dir):
    d = shared_dir / "runs"
    save(str(d / "ck"))
    (d / "private").mkdir()
    with mode(d / "private", 0o000):
        rc, out, err = as_unprivileged("ls", str(d))
    assert_one_line(rc, err, str(d / "private"), "permission denied")


def test_ls_skips_plain_zarr_and_flags_damaged_checkpoints(tmp_path):
    d = tmp_path / "runs"
    good = save(str(d / "good"))
    inc = save(str(d / "incomplete"))
    os.remove(Path(inc) / mf.COMMIT_KEY)
    (d / "group").mkdir()
    (d / "group" / "zarr.json").write_bytes(mf.group_doc())
    (d / "array").mkdir()
    (d / "array" / "zarr.json").write_bytes(_plain_array_doc())
    nested = save(str(d / "group" / "inner"))  # a checkpoint inside a plain zarr group is still listed
    garbage = save(str(d / "garbage"))
    (Path(garbage) / "zarr.json").write_text("garbage{")
    foreign = save(str(d / "foreign"))
    (Path(foreign) / "zarr.json").write_bytes(mf.group_doc())
    torn = save(str(d / "torn"))
    os.remove(Path(torn) / mf.COMMIT_KEY)
    (Path(torn) / "zarr.json").write_text("{")

    rc, out, err = run("ls", str(d), "--json")
    assert rc == 0, err
    rows = {r["url"]: r for r in json.loads(out)}
    assert sorted(rows) == sorted([good, inc, nested, garbage, foreign, torn])
    assert rows[good] == {"url": good, "committed": True}
    assert rows[inc] == {"url": inc, "committed": False}
    assert rows[nested] == {"url": nested, "committed": True}
    for bad in (garbage, foreign, torn):
        assert rows[bad]["committed"] is False and "zarr.json" in rows[bad]["damaged"], rows[bad]
    assert "not valid JSON" in rows[garbage]["damaged"]
    assert "not a ragckpt manifest" in rows[foreign]["damaged"]

    rc, out, err = run("ls", str(d))
    assert rc == 0, err
    by_url = {line.split()[1]: line.split()[0] for line in out.splitlines()}
    assert by_url == {good: "committed", inc: "INCOMPLETE", nested: "committed", garbage: "DAMAGED",
                      foreign: "DAMAGED", torn: "DAMAGED"}


def test_ls_of_a_plain_zarr_group_lists_the_checkpoints_inside(tmp_path):
    g = tmp_path / "group"
    g.mkdir()
    (g / "zarr.json").write_bytes(mf.group_doc())
    inner = save(str(g / "ck"))
    rc, out, err = run("ls", str(g), "--json")
    assert rc == 0 and json.loads(out) == [{"url": inner, "committed": True}], (out, err)


def test_ls_long_describes_each_checkpoint_of_a_directory(tmp_path):
    ck = save(str(tmp_path / "ck"), world_size=3, layout="row")
    rc, out, err = run("ls", str(tmp_path), "-l")
    assert rc == 0, err
    assert out.split()[:2] == ["committed", ck] and "world 3, row, 2 tensors, created " in out
    rc, out, err = run("ls", str(tmp_path), "-l", "--json")
    (row,) = json.loads(out)
    assert row["world_size"] == 3 and row["layout"] == "row" and row["tensors"] == 2 and row["created"]


def test_ls_of_an_empty_bucket_is_empty_like_an_empty_directory(s3, tmp_path):
    bucket = f"s3://{s3.bucket}"
    rc, out, err = run("ls", bucket, *s3.cli_args(), "--json")
    assert rc == 0 and json.loads(out) == [], (out, err)
    rc, out, err = run("ls", bucket, *s3.cli_args())
    assert rc == 0 and out == "", (out, err)
    (tmp_path / "empty").mkdir()
    assert run("ls", str(tmp_path / "empty"))[:2] == (0, "")
    # a prefix holding nothing may be a typo: still an error, as a missing local directory is
    one_line_error(["ls", f"{bucket}/nope", *s3.cli_args()], "no such directory or prefix")


def test_ls_on_s3_skips_plain_zarr_and_flags_damaged(s3):
    url, opts = s3
    ragckpt.write_global({"w": torch.randn(4, 3)}, f"{url}/good", 2, storage_options=opts)
    ragckpt.write_global({"w": torch.randn(4, 3)}, f"{url}/garbage", 2, storage_options=opts)
    fs = s3.fs()
    root = url.split("://", 1)[1]
    fs.pipe(f"{root}/garbage/zarr.json", b"garbage{")
    fs.pipe(f"{root}/plain/zarr.json", mf.group_doc())
    rc, out, err = run("ls", url, *s3.cli_args(), "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert [r["url"] for r in rows] == [f"{url}/garbage", f"{url}/good"]
    assert rows[0]["committed"] is False and "not valid JSON" in rows[0]["damaged"]
    assert rows[1] == {"url": f"{url}/good", "committed": True}


def test_ls_of_a_checkpoint_with_a_damaged_root_document_is_an_error(tmp_path):
    # not a plain zarr group to list the contents of: ragckpt's own objects are beside it
    ck = save(str(tmp_path / "ck"))
    os.remove(Path(ck) / mf.COMMIT_KEY)
    (Path(ck) / "zarr.json").write_text("null")
    one_line_error(["ls", ck], f"{ck}/zarr.json")


def _partial_save(url: str, storage_options: dict | None = None) -> None:
    """Rank 1 of 2 saved; rank 0, which writes zarr.json, never did."""
    lay = ragckpt.CheckpointLayout.build({"w": ((4, 4), "float32")}, 2, "row")
    ragckpt.save_shard(url, 1, {"float32": torch.ones(8)}, lay, storage_options=storage_options)


def _ls_rows(url: str, *extra: str) -> tuple[dict[str, dict], str]:
    code, out, err = cli_run("ls", url, "--json", *extra)
    assert code == 0, err
    code2, text, err2 = cli_run("ls", url, *extra)
    assert code2 == 0, err2
    return {r["url"].rstrip("/").rsplit("/", 1)[-1]: r for r in json.loads(out)}, text


def test_ls_lists_a_save_stopped_before_zarr_json_as_incomplete(tmp_path):
    """Such a save has no zarr.json for ls to find: it was not listed at all, though STORAGE.md
    promised INCOMPLETE for an uncommitted checkpoint. A directory merely named buffers is not one."""
    ragckpt.write_global({"a": torch.ones(4)}, str(tmp_path / "done"), 2)
    _partial_save(str(tmp_path / "run" / "partial"))
    (tmp_path / "other" / "buffers" / "x").mkdir(parents=True)
    (tmp_path / "other" / "buffers" / "x" / "notes.txt").write_text("not a checkpoint")
    rows, text = _ls_rows(str(tmp_path))
    assert set(rows) == {"done", "partial"}, rows
    assert rows["done"]["committed"] and "incomplete" not in rows["done"]
    assert rows["partial"]["committed"] is False and "before rank 0 wrote zarr.json" in rows["partial"]["incomplete"]
    line = next(ln for ln in text.splitlines() if "partial" in ln)
    assert line.startswith("INCOMPLETE ") and "before rank 0 wrote zarr.json" in line
    rows, _ = _ls_rows(str(tmp_path), "-l")  # the long listing has no world size to show for it
    assert "partial" in rows
    # ls of the partial save's own URL listed nothing, with exit status 0: its own row now
    own = str(tmp_path / "run" / "partial")
    for extra in ((), ("-l",)):
        rows, text = _ls_rows(own, *extra)
        assert list(rows) == ["partial"] and rows["partial"]["url"] == own, rows
        assert "before rank 0 wrote zarr.json" in rows["partial"]["incomplete"]
        assert text.startswith(f"INCOMPLETE  {own}  (a save stopped before rank 0 wrote zarr.json"), text


def test_ls_lists_checkpoints_reached_through_a_symlink(tmp_path):
    """`runs/latest -> ../store/step_100`: the walk does not follow links, so a directory holding only
    such a link listed as empty (exit 0). A link to a directory is looked into at its top level only
    (a link back up does not loop)."""
    ragckpt.write_global({"a": torch.ones(4)}, str(tmp_path / "store" / "step_100"), 2)
    ragckpt.write_global({"a": torch.ones(4)}, str(tmp_path / "runs" / "own"), 2)
    (tmp_path / "runs" / "latest").symlink_to("../store/step_100")
    (tmp_path / "runs" / "up").symlink_to(tmp_path / "runs")
    (tmp_path / "runs" / "notes").symlink_to(tmp_path / "store")  # a link to a plain directory
    rows, text = _ls_rows(str(tmp_path / "runs"), "-l")
    assert set(rows) == {"own", "latest"}, rows
    assert rows["latest"]["committed"] and rows["latest"]["world_size"] == 2
    assert [ln.split()[1].rsplit("/", 1)[-1] for ln in text.splitlines()] == ["latest", "own"], text


def test_ls_on_s3_lists_a_save_stopped_before_zarr_json_as_incomplete(s3):
    ragckpt.write_global({"a": torch.ones(4)}, f"{s3.url}/done", 2, storage_options=s3.storage_options)
    _partial_save(f"{s3.url}/run/partial", s3.storage_options)
    s3.fs().pipe(f"{s3.url[5:]}/other/buffers/x/notes.txt", b"not a checkpoint")
    rows, text = _ls_rows(s3.url, *s3.cli_args())
    assert set(rows) == {"done", "partial"}, rows
    assert rows["partial"]["committed"] is False and "before rank 0 wrote zarr.json" in rows["partial"]["incomplete"]
    assert any(ln.startswith("INCOMPLETE ") and "partial" in ln for ln in text.splitlines())
    rows, _ = _ls_rows(f"{s3.url}/run/partial", *s3.cli_args())
    assert list(rows) == ["partial"] and rows["partial"]["committed"] is False, rows


def test_ls_of_an_unreadable_checkpoint_says_permissions_not_try_again_later(tmp_path, monkeypatch):
    """Waiting does not cure a permission error; ls advised it anyway. (Tests run as root, so the
    refusal is injected at os.open, where an unprivileged user's read would get it.)"""
    ragckpt.write_global({"a": torch.ones(4)}, str(tmp_path / "locked"), 2)
    ragckpt.write_global({"a": torch.ones(4)}, str(tmp_path / "open"), 2)
    locked = str(tmp_path / "locked" / "zarr.json")
    real_open = os.open

    def refusing(path, *a, **k):
        if os.fspath(path) == locked:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", refusing)
    code, out, err = cli_run("ls", str(tmp_path))
    assert code == 2 and "UNREADABLE" in out and "committed" in out, (out, err)
    assert "Permission denied" in err and "check their permissions" in err and "try again" not in err, err
