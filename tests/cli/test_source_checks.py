"""What the commands refuse as their source, in one line before doing anything: a plain zarr group or
array (no ragckpt checkpoint, whatever the command), an array inside a checkpoint, and an empty
string (never taken as the working directory, by the CLI or the library)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ragckpt
from ragckpt.checkpoint import manifest as mf
from tests.cli_helpers import (
    ROOT,
    _plain_array_doc,
    one_line_error,
    save,
    usage_error,
)


@pytest.mark.parametrize("cmd", [["verify"], ["export-hf", "{out}"], ["export-dcp", "{out}"],
                                 ["reshard", "{out}", "--to", "2"], ["info"]])
@pytest.mark.parametrize("doc", ["group", "array"])
def test_plain_zarr_is_not_a_ragckpt_checkpoint(tmp_path, cmd, doc):
    g = tmp_path / "plain"
    g.mkdir()
    (g / "zarr.json").write_bytes(mf.group_doc() if doc == "group" else _plain_array_doc())
    args = [c.replace("{out}", str(tmp_path / "out")) for c in cmd]
    line = one_line_error([args[0], str(g), *args[1:]], str(g), "not a ragckpt manifest")
    assert "not committed" not in line
    assert not (tmp_path / "out").exists()


def test_an_array_inside_a_checkpoint_is_not_a_checkpoint(tmp_path):
    ck = save(str(tmp_path / "ck"))
    for cmd in ("info", "verify"):
        one_line_error([cmd, f"{ck}/buffers/0"], "an array inside a ragckpt checkpoint")


@pytest.mark.parametrize("args, name", [
    (["info", ""], "URL"), (["verify", ""], "URL"), (["ls", ""], "URL"),
    (["export-hf", "", "o"], "SRC"), (["export-dcp", "", "o"], "SRC"),
    (["import-hf", "", "o", "-w", "2"], "HF_DIR"), (["import-dcp", "", "o"], "DCP_DIR"),
])
def test_empty_source_is_a_usage_error(args, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert usage_error(args).startswith(f"{name} is empty")
    assert os.listdir(tmp_path) == []


def test_empty_source_is_one_line_through_the_entry_point(tmp_path):
    save(str(tmp_path / "ck"))  # a checkpoint in the working directory must not be what "" means
    p = subprocess.run([sys.executable, "-m", "cli.main", "info", "", "--json"], cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: URL is empty"), p.stderr
    assert json.loads(p.stdout)["error"].startswith("URL is empty")


def test_empty_source_is_refused_by_the_library_too(tmp_path, monkeypatch):
    monkeypatch.chdir(save(str(tmp_path / "ck")))  # the working directory *is* a checkpoint
    with pytest.raises(ValueError, match="empty string"):
        ragckpt.open("")
    with pytest.raises(ValueError, match="empty string"):
        ragckpt.reshard.reshard("", str(tmp_path / "out"), 2)
    assert not (tmp_path / "out").exists()
