"""`ragckpt info`, `verify`, `ls` as a user runs them: exit codes, JSON, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import ragckpt
from cli.main import cli


@pytest.fixture()
def ck(tmp_path):
    url = str(tmp_path / "ck")
    ragckpt.write_global({"w": torch.randn(30, 4), "b": torch.randn(4).to(torch.bfloat16)}, url, 4, "ragged",
                         user={"step": 12})
    return url


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_info_json(ck):
    r = run("info", ck, "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert s["world_size"] == 4 and s["layout"] == "ragged" and s["committed"] is True
    assert s["tensors"] == 2 and s["dtypes"] == {"float32": 1, "bfloat16": 1}
    assert s["data_bytes"] == 30 * 4 * 4 + 4 * 2 and s["bytes"] == s["data_bytes"] + s["padding_bytes"]
    assert s["user"] == {"step": 12}


def test_info_text_and_uncommitted(ck):
    r = run("info", ck)
    assert r.exit_code == 0 and "committed" in r.output and "world size   4" in r.output
    os.remove(os.path.join(ck, "COMMITTED"))
    r = run("info", ck)
    assert r.exit_code == 0 and "NOT COMMITTED" in r.output


def test_info_shows_user_metadata_one_short_line_per_key(tmp_path):
    """An imported DCP checkpoint carries every hyperparameter's pickled bytes in its user metadata:
    `info` summarises big values (counts, first keys), `--json` keeps everything."""
    blobs = {f"optim.param_groups.layer{i}.lr": "QUJD" * 300 for i in range(40)}
    user = {"step": 7, "run": "llama-70b", "cfg": {"a": 1, "b": "x"}, "lrs": [1e-3] * 100,
            "dcp": {"bytes": blobs, "model_prefix": "model.", "world_size": 8}}
    url = str(tmp_path / "ck")
    ragckpt.write_global({"w": torch.zeros(3)}, url, 1, user=user)
    r = run("info", url)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("user"))
    assert [line[13:] for line in lines[start : start + 5]] == [  # keys sorted, as stored
        "cfg: {a: 1, b: 'x'}", "dcp: {bytes: {40 entries}, model_prefix: 'model.', world_size: 8}",
        "lrs: [100 items]", "run: 'llama-70b'", "step: 7"]
    assert max(len(line) for line in lines) < 120 and "QUJD" not in r.output
    assert json.loads(run("info", url, "--json").output)["user"] == user


def test_verify_ok_and_bad(ck):
    r = run("verify", ck, "--json")
    assert r.exit_code == 0 and json.loads(r.output)["ok"] is True
    chunk = os.path.join(ck, "buffers", "0", "c.2.0")
    raw = bytearray(open(chunk, "rb").read())
    raw[3] ^= 0xFF
    open(chunk, "wb").write(raw)
    r = run("verify", ck)
    assert r.exit_code == 1
    assert "buffers/0/c.2.0" in r.output and "checksum mismatch" in r.output


def test_ls(ck, tmp_path):
    r = run("ls", ck, "-l")
    assert r.exit_code == 0 and "w" in r.output and "(30, 4)" in r.output
    r = run("ls", str(tmp_path), "--json")
    rows = json.loads(r.output)
    assert rows == [{"url": ck, "committed": True}]


def test_errors_are_one_line_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "cli.main", "info", str(tmp_path / "missing")],
                       capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no ragckpt checkpoint" in r.stderr
    assert "Traceback" not in r.stderr


def test_every_command_has_help_with_an_example():
    for name in cli.commands:
        r = run(name, "--help")
        assert r.exit_code == 0, name
        assert "ragckpt " in r.output and "xample" in r.output, f"{name} --help has no example"
