"""Small inputs that met a raw error, silence or a needless difference: a buffer given by name to
`rank_sizes`, `ls` of a directory holding no checkpoint, `reshard --world-size`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ragckpt
from ragckpt.errors import OutOfRangeError, UnknownNameError
from ragckpt.planner.state import CheckpointLayout
from tests.helpers import cli_run

ROOT = Path(__file__).resolve().parents[2]


def test_rank_sizes_and_layout_of_take_a_buffer_name_as_read_rank_does(tmp_path):
    lay = CheckpointLayout.build({"w": ((10, 3), "float32"), "b": ((5,), "bfloat16")}, 4, "row")
    # torch.chunk of 10 rows over 4 ranks: 3, 3, 3, 1 rows of 3 elements; of 5 rows: 2, 2, 1, 0
    assert lay.rank_sizes("float32").tolist() == [9, 9, 9, 3] == lay.rank_sizes(0).tolist()
    assert lay.rank_sizes("bfloat16").tolist() == [2, 2, 1, 0] == lay.rank_sizes(np.int64(1)).tolist()
    assert lay.layout_of("bfloat16") is lay.layout_of(1)
    with pytest.raises(UnknownNameError, match="buffer 'float64' is not in this checkpoint or layout"):
        lay.rank_sizes("float64")
    for bad in (2, -1, 1.0, True, None):  # -1 counted from the end before
        with pytest.raises(OutOfRangeError, match=r"neither the name nor the index \(0\.\.1\)"):
            lay.rank_sizes(bad)
    url = str(tmp_path / "ck")
    ragckpt.write_global({"w": torch.arange(30.0).reshape(10, 3), "b": torch.ones(5, dtype=torch.bfloat16)}, url,
                         layout=lay, world_size=4)
    ck = ragckpt.open(url)
    for r, n in enumerate(ck.layout.rank_sizes("float32")):
        assert ck.read_rank("float32", r).numel() == n


def test_ls_of_a_directory_without_checkpoints_says_so(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "notes.txt").write_text("x")
    code, out, err = cli_run("ls", str(tmp_path / "empty"))
    assert code == 0 and out == "" and err == f"no checkpoints under {tmp_path / 'empty'} (nothing with a ragckpt " \
        "zarr.json or COMMITTED in it)\n", (code, out, err)
    code, out, err = cli_run("ls", str(tmp_path / "empty"), "--json")  # stdout stays one document
    assert code == 0 and json.loads(out) == [] and err == "", (out, err)
    ragckpt.write_global({"w": torch.zeros(2)}, str(tmp_path / "empty" / "sub" / "ck"), 1)
    code, out, err = cli_run("ls", str(tmp_path / "empty"))
    assert code == 0 and out.startswith("committed") and err == "", (out, err)


@pytest.fixture()
def src(tmp_path) -> str:
    url = str(tmp_path / "src")
    ragckpt.write_global({"w": torch.arange(12.0).reshape(4, 3)}, url, 2)
    return url


@pytest.mark.parametrize("flag", ["--world-size", "-w", "--to"])
def test_reshard_takes_world_size_as_the_importers_name_it(src, tmp_path, flag):
    dst = str(tmp_path / "dst")
    code, out, err = cli_run("reshard", src, dst, flag, "3", "--json")
    assert code == 0, err
    assert json.loads(out)["to_world_size"] == 3
    ck = ragckpt.open(dst)
    assert ck.world_size == 3 and torch.equal(ck.read("w"), torch.arange(12.0).reshape(4, 3))


def _command(*args: str) -> subprocess.CompletedProcess:
    """The installed command's way of running (usage errors as one line), in a child process."""
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_reshard_refuses_to_and_world_size_that_disagree_or_are_both_missing(src, tmp_path):
    dst = tmp_path / "dst"
    p = _command("reshard", src, str(dst), "--to", "3", "--world-size", "4")
    assert p.returncode == 2 and "--to 3 and --world-size 4 disagree" in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1, p.stderr
    p = _command("reshard", src, str(dst))
    assert p.returncode == 2 and "Missing option '--to' (or its alias '--world-size')" in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1, p.stderr
    assert not dst.exists()
    code, _, err = cli_run("reshard", src, str(dst), "--to", "3", "--world-size", "3")  # the same: fine
    assert code == 0 and ragckpt.open(str(dst)).world_size == 3, err
