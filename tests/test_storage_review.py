"""Storage edge cases a review of the S3 path found: an S3 URL with no bucket (`s3://$BUCKET/x` with
BUCKET unset), bad RAGCKPT_IO_* environment variables, and metadata damage judged by verify."""

from __future__ import annotations

import json
import os
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


@pytest.mark.parametrize("victim", ["meta/crc/0/c/0", "zarr.json"])
def test_verify_judges_damaged_metadata_as_bad(tmp_path, victim):
    """A missing or corrupt metadata object failed `open` with exit 2, the status of an outage
    ('retrying later may find it intact'); it is damage, judged like a data object's: exit 1."""
    ck = tmp_path / "ck"
    ragckpt.write_global({"a": torch.arange(100.0)}, str(ck), 2)
    if victim == "zarr.json":
        (ck / victim).write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
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
