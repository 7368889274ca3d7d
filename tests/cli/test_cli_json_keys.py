"""The README's `--json` table is a contract for scripts: every key a command prints is named in
its row (a key added without documenting it fails here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

import ragckpt
from tests.helpers import cli_run

README = Path(__file__).resolve().parents[2] / "README.md"


def documented_keys() -> dict[str, set[str]]:
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"\| `([a-z-]+(?: [A-Z]+)?)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`([a-z_]+)`", m.group(2)))
    return rows


def keys_of(doc) -> set[str]:
    """The keys of `doc` and of the objects in its lists (a list of rows, `buffers`, `differences`)."""
    if isinstance(doc, list):
        return set().union(*(keys_of(d) for d in doc if isinstance(d, dict | list)))
    return set(doc) | set().union(*(keys_of(v) for v in doc.values() if isinstance(v, list)))


def test_every_json_key_is_in_the_readme_table(tmp_path):
    rows = documented_keys()
    a, hf = str(tmp_path / "a"), tmp_path / "hf"
    ragckpt.write_global({"model.w": torch.ones(4, 3), "model.b": torch.ones(3)}, a, 2)
    ragckpt.write_global({"model.w": torch.zeros(4, 3)}, str(tmp_path / "b"), 2)
    hf.mkdir()
    save_file({"w": torch.ones(4)}, str(hf / "model.safetensors"))
    runs = {
        "info": ["info", a], "verify": ["verify", a], "ls CKPT": ["ls", a], "ls DIR": ["ls", str(tmp_path), "-l"],
        "diff": ["diff", a, str(tmp_path / "b")],
        "reshard": ["reshard", a, str(tmp_path / "r"), "--to", "3"],
        "import-hf": ["import-hf", str(hf), str(tmp_path / "h"), "-w", "2"],
        "export-hf": ["export-hf", a, str(tmp_path / "e")],
        "export-dcp": ["export-dcp", a, str(tmp_path / "d")],
        "import-dcp": ["import-dcp", str(tmp_path / "d"), str(tmp_path / "i")],
    }
    assert set(runs) <= set(rows), sorted(rows)
    for row, args in runs.items():
        code, out, err = cli_run(*args, "--json")
        assert code in (0, 1), (row, out, err)  # diff of two different checkpoints exits 1
        missing = keys_of(json.loads(out)) - rows[row]
        assert not missing, f"README's --json row for `{row}` lacks {sorted(missing)}"
    code, out, _ = cli_run("info", str(tmp_path / "nothing"), "--json")
    assert code == 2 and set(json.loads(out)) == {"error"}
