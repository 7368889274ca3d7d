"""Storage settings that must be refused or explained: an S3 URL naming no bucket (`s3://$BUCKET/x`
with BUCKET unset), bad RAGCKPT_IO_* environment variables (by the library and the CLI), and S3
access with no credentials at all."""

from __future__ import annotations

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


def test_no_credentials_at_all_says_where_credentials_come_from(s3):
    """botocore's bare "Unable to locate credentials" said nothing of what to set (a 403 did). Run in
    a fresh process: credentials a client found earlier in this one may still be cached."""
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    assert env.get("AWS_EC2_METADATA_DISABLED") == "true"  # botocore must not go looking off this machine
    p = subprocess.run([sys.executable, "-m", "cli.main", "info", f"{s3.url}/ck", *s3.cli_args()], env=env,
                       cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "no S3 credentials found (NoCredentialsError" in p.stderr and "-o anon=true" in p.stderr, p.stderr
