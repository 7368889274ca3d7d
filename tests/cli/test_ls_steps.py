"""`ragckpt ls ROOT` of a training job's root (step-<n> checkpoints): one table row per checkpoint
with step, world size, size, state and age, in step order (step-9 before step-10), and the same
fields in --json; the reference is what the checkpoints were made with."""

from __future__ import annotations

import json
import os
import re

import torch

import ragckpt
from tests.helpers import cli_run


def test_ls_of_a_step_root_shows_step_world_size_state_and_age(tmp_path):
    root = tmp_path / "run"
    for step, world in ((9, 2), (10, 3), (11, 3)):
        ragckpt.write_global({"w": torch.ones(6, 4), "b": torch.zeros(5)}, str(root / f"step-{step}"), world,
                             user={"step": step})
    # a save cut short: step 11's root document is there, its commit marker not
    os.remove(root / "step-11" / "COMMITTED")
    code, out, err = cli_run("ls", str(root))
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0].split() == ["STEP", "WORLD", "SIZE", "STATE", "AGE", "URL"]
    cells = [ln.split() for ln in lines[1:]]
    assert [c[0] for c in cells] == ["9", "10", "11"] and [c[1] for c in cells] == ["2", "3", "3"]
    assert [c[4] for c in cells] == ["committed", "committed", "incomplete"]
    assert all(re.fullmatch(r"\d+[sm]", c[5]) for c in cells), cells  # made just now: seconds or minutes
    assert [c[6] for c in cells] == [str(root / f"step-{s}") for s in (9, 10, 11)]
    code, out, err = cli_run("ls", str(root), "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["step"], r["world_size"], r["state"]) for r in rows] == [(9, 2, "committed"), (10, 3, "committed"),
                                                                           (11, 3, "incomplete")]
    info = [json.loads(cli_run("info", str(root / f"step-{s}"), "--json")[1]) for s in (9, 10)]
    assert [r["bytes"] for r in rows[:2]] == [i["bytes"] for i in info]  # the size info reports
    assert [f"{r['bytes'] / 1024:.1f} KiB" if r["bytes"] >= 1024 else f"{r['bytes']} B" for r in rows] == [
        " ".join(c[2:4]) for c in cells]
    assert all(isinstance(r["age_s"], int) and 0 <= r["age_s"] < 3600 for r in rows)
    # latest_committed (what a resume loads) agrees with the table: step 10, not the incomplete 11
    assert ragckpt.latest_committed(ragckpt.list_checkpoints(str(root)))["url"] == rows[1]["url"]


def test_ls_of_a_directory_without_step_names_keeps_its_short_form(tmp_path):
    ragckpt.write_global({"w": torch.ones(3)}, str(tmp_path / "a"), 1)
    code, out, _ = cli_run("ls", str(tmp_path))
    assert code == 0 and out.split() == ["committed", str(tmp_path / "a")]
    code, out, _ = cli_run("ls", str(tmp_path), "--json")
    assert json.loads(out) == [{"url": str(tmp_path / "a"), "committed": True}]
    code, out, _ = cli_run("ls", str(tmp_path), "-l", "--json")
    (row,) = json.loads(out)
    assert row["state"] == "committed" and row["world_size"] == 1 and 0 <= row["age_s"] < 3600
