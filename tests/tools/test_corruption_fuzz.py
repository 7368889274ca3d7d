"""Every file of a checkpoint, corrupted in turn (a bit flipped, cut to half, deleted), is named by
`verify` or by the error opening it: never an OK, never a raw exception (tools/fuzz/corrupt_each_file.py)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ragckpt
from tools.fuzz import corrupt_each_file as fuzz

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", ["row", "ragged"])  # per-tensor units tables; flat layouts with padding
def test_every_damage_to_every_file_is_named(tmp_path, kind):
    cases = fuzz.run(kind, seed=0, workdir=str(tmp_path))
    keys = {c.key for c in cases}
    # what the fuzzer walks is the whole checkpoint: data, tables, documents, records, extras, marker
    assert {"COMMITTED", "zarr.json", "buffers/zarr.json", "meta/zarr.json", "meta/crc/zarr.json",
            "meta/extra/c/0/0", "extra/1.safetensors", "ranks/2.json", "buffers/0/c.2.0"} <= keys, keys
    assert ("meta/units/zarr.json" in keys) == (kind == "row")
    assert len(cases) == 3 * len(keys)
    missed = [f"{c.key} {c.damage} ({c.done}): {c.said}" for c in cases if not c.named]
    assert not missed, "\n".join(missed)


def test_the_fuzz_checkpoint_has_a_zero_size_shard_and_is_whole(tmp_path):
    url = str(tmp_path / "ck")
    fuzz.build(url, "row")
    ck = ragckpt.open(url)
    assert ck.layout.rank_sizes("bool").tolist() == [1, 1, 0]  # rank 2 holds no part of the bool buffer
    assert not (tmp_path / "ck/buffers/3/c.2.0").exists() and ck.layout.buffers[3].name == "bool"
    assert {b.dtype for b in ck.layout.buffers} == {"float32", "bfloat16", "int8", "bool", "complex64"}
    assert ck.verify().ok and ck.extra(1)[1] == {"step": "7"}


def test_the_judge_fails_an_undamaged_checkpoint(tmp_path):
    """The fuzzer's verdict can fail: on a checkpoint nothing was done to, verify says OK."""
    url = str(tmp_path / "ck")
    fuzz.build(url, "row")
    named, said = fuzz.judge(url, "buffers/0/c.0.0")
    assert not named and said == "verify said OK"


@pytest.mark.parametrize(("key", "damage"), [("buffers/1/c.1.0", "flip"), ("ranks/0.json", "truncate"),
                                             ("zarr.json", "delete")])
def test_the_command_says_it_in_one_line(tmp_path, key, damage):
    """`ragckpt verify` on a sample: exit 1 (bad objects) or 2 (cannot be opened), the file named on
    stderr in one line per problem, no traceback; with --json, the same in the document."""
    base = tmp_path / "base"
    fuzz.build(str(base), "row")
    case = tmp_path / "case"
    shutil.copytree(base, case)
    fuzz.corrupt(case, key, damage, random.Random(0))
    p = subprocess.run([sys.executable, "-m", "cli.main", "verify", str(case)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode in (1, 2) and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert lines and any(fuzz.names(line.removeprefix("BAD  ").removeprefix("error: "), str(case), key)
                         for line in lines), lines
    if p.returncode == 2:
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
    else:
        assert all(line.startswith("BAD  ") for line in lines) and p.stdout.startswith("FAILED"), (lines, p.stdout)
    j = subprocess.run([sys.executable, "-m", "cli.main", "verify", "--json", str(case)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    doc = json.loads(j.stdout)
    said = doc.get("error") or "\n".join(doc["problems"])
    assert j.returncode == p.returncode and fuzz.names(said, str(case), key) and doc.get("ok") is not True, doc
