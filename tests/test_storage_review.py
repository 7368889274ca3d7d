"""Storage edge cases a review of the S3 path found: an S3 URL with no bucket (`s3://$BUCKET/x` with
BUCKET unset), bad RAGCKPT_IO_* environment variables, and metadata damage judged by verify."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ragckpt
from ragckpt.errors import StorageError
from ragckpt.storage.config import io_config
from tests.helpers import cli_run


@pytest.mark.parametrize("spelling", ["s3:///{b}", "s3:////{b}/ck", "S3:///{b}/ck"])
def test_an_s3_url_without_a_bucket_is_refused_not_read_as_another_bucket(s3, spelling):
    """`s3:///victim` was read as bucket 'victim' at its root: with overwrite=True the whole bucket
    was emptied (a bucket root has no sibling to set the old contents aside in)."""
    bucket = s3.url.split("/")[2]
    fs = s3.fs()
    fs.pipe(f"{bucket}/important.txt", b"keep me")
    url = spelling.format(b=bucket)
    with pytest.raises(StorageError, match="names no bucket .*an unset variable"):
        ragckpt.write_global({"a": torch.ones(4)}, url, 2, overwrite=True, storage_options=s3.storage_options)
    assert fs.cat(f"{bucket}/important.txt") == b"keep me"
    assert fs.ls(bucket, refresh=True) == [f"{bucket}/important.txt"]
    code, out, err = cli_run("info", url, *s3.cli_args())
    assert code == 2 and "names no bucket" in err and f"bucket '{bucket}'" not in err, err


def test_bad_environment_settings_name_the_variable():
    with pytest.raises(StorageError, match=r"environment variable RAGCKPT_IO_CONCURRENCY='abc': ragckpt.concurrency"):
        io_config({}, environ={"RAGCKPT_IO_CONCURRENCY": "abc"})
    with pytest.raises(StorageError, match=r"retries must be >= 1 .*\(the environment sets RAGCKPT_IO_RETRIES=0\)"):
        io_config({}, environ={"RAGCKPT_IO_RETRIES": "0"})
    # one that is wrong only together with the options given is still named: the user may not know it is set
    with pytest.raises(StorageError, match=r"the environment sets RAGCKPT_IO_PART_SIZE=8MiB"):
        io_config({"ragckpt": {"multipart_threshold": 6 << 20}}, environ={"RAGCKPT_IO_PART_SIZE": "8MiB"})
    # and a valid combination is taken
    cfg = io_config({"ragckpt": {"multipart_threshold": 16 << 20}}, environ={"RAGCKPT_IO_PART_SIZE": "8MiB"})
    assert (cfg.part_size, cfg.multipart_threshold) == (8 << 20, 16 << 20)
    # options alone say nothing about the environment
    with pytest.raises(StorageError) as e:
        io_config({"ragckpt": {"retries": 0}}, environ={})
    assert "environment" not in str(e.value)


def test_the_cli_names_a_bad_environment_variable(tmp_path, monkeypatch):
    ragckpt.write_global({"a": torch.ones(4)}, str(tmp_path / "ck"), 2)
    monkeypatch.setenv("RAGCKPT_IO_RETRIES", "0")
    code, out, err = cli_run("info", str(tmp_path / "ck"))
    assert code == 2 and "RAGCKPT_IO_RETRIES=0" in err, err


@pytest.mark.parametrize("victim", ["meta/crc/0/c/0", "zarr.json", "COMMITTED", "COMMITTED-foreign"])
def test_verify_judges_damaged_metadata_as_bad(tmp_path, victim):
    """A missing or corrupt metadata object, or a cut-short or foreign commit marker, failed `open`
    with exit 2, the status of an outage ('retrying later may find it intact'); it is damage, judged
    like a data object's: exit 1."""
    ck = tmp_path / "ck"
    ragckpt.write_global({"a": torch.arange(100.0)}, str(ck), 2)
    if victim == "zarr.json":
        (ck / victim).write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    elif victim == "COMMITTED":
        (ck / victim).write_bytes((ck / victim).read_bytes()[:60])
    elif victim == "COMMITTED-foreign":
        victim = "COMMITTED"
        marker = json.loads((ck / victim).read_text())
        (ck / victim).write_text(json.dumps({**marker, "world_size": 3}))
    else:
        os.remove(ck / victim)
    code, out, err = cli_run("verify", str(ck))
    assert code == 1, (code, out, err)
    bad = [ln for ln in err.splitlines() if ln.startswith("BAD  ")]
    assert len(bad) == 1 and str(Path(ck) / victim) in bad[0], err
    assert out.startswith("FAILED (1 problem(s))")
    code, out, err = cli_run("verify", str(ck), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and str(Path(ck) / victim) in doc["problems"][0], out


def test_verify_of_a_missing_checkpoint_is_still_an_error_not_a_verdict(tmp_path):
    code, out, err = cli_run("verify", str(tmp_path / "nothing"))
    assert code == 2 and "no ragckpt checkpoint" in err


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


def test_no_credentials_at_all_says_where_credentials_come_from(s3):
    """botocore's bare "Unable to locate credentials" said nothing of what to set (a 403 did). Run in
    a fresh process: credentials a client found earlier in this one may still be cached."""
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    assert env.get("AWS_EC2_METADATA_DISABLED") == "true"  # botocore must not go looking off this machine
    p = subprocess.run([sys.executable, "-m", "cli.main", "info", f"{s3.url}/ck", *s3.cli_args()], env=env,
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "no S3 credentials found (NoCredentialsError" in p.stderr and "-o anon=true" in p.stderr, p.stderr


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
