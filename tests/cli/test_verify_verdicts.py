"""`ragckpt verify` exit statuses: damaged or missing metadata objects and cut-short or foreign commit
markers are damage (exit 1, the object named, in text and --json); a checkpoint that is not there is
an error (exit 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ragckpt
from tests.helpers import cli_run


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
