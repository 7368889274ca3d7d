"""Importing ragckpt, starting its CLI, and resharding, verifying or inspecting a checkpoint load no
torch (`ragckpt.lazy`): importing torch took about a second, most of every command's start-up and
of every reshard worker process's. Each check runs in a fresh interpreter, where nothing else has
imported torch, and the resharded result is then compared bit for bit in this one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ragckpt
from tests.helpers import ALL_DTYPES, assert_bit_equal, special_tensor

ROOT = Path(__file__).resolve().parents[2]

# the torch modules a fresh interpreter has loaded after the code before it
_REPORT = "\nprint('TORCH=' + json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))"


def _torch_loaded_by(code: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", "import json, sys\n" + code + _REPORT], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stdout.splitlines() if x.startswith("TORCH=")][-1]
    return json.loads(line.removeprefix("TORCH="))


def test_importing_ragckpt_and_its_cli_loads_no_torch():
    assert _torch_loaded_by("import ragckpt, ragckpt.reshard.workers, cli.main") == []


def test_reshard_verify_and_info_load_no_torch(tmp_path):
    state = {f"t{i}": special_tensor((37 + i, 5), dt, seed=i) for i, dt in enumerate(ALL_DTYPES)}
    src, dst = tmp_path / "src", tmp_path / "dst"
    ragckpt.write_global(state, str(src), 4, "ragged")
    code = f"""
import ragckpt
from cli.main import main
stats = ragckpt.reshard.reshard({str(src)!r}, {str(dst)!r}, 3, workers=1)
assert stats.bytes_read > 0
assert ragckpt.open({str(dst)!r}).verify().ok
for args in (["info", {str(dst)!r}], ["ls", {str(dst)!r}], ["verify", {str(src)!r}]):
    try:
        main(args)
    except SystemExit as e:
        assert not e.code, (args, e.code)
"""
    assert _torch_loaded_by(code) == []
    ck = ragckpt.open(str(dst))
    assert ck.world_size == 3
    for name, t in state.items():
        assert_bit_equal(ck.read(name), t, name)


@pytest.mark.slow
def test_torch_dtypes_still_resolve_once_torch_is_wanted():
    # a fresh process: the lazy name must yield the real torch objects on first use
    code = """
from ragckpt.format.dtypes import dtype_name, torch_dtype
import torch
assert torch_dtype("bfloat16") is torch.bfloat16 and dtype_name(torch.float8_e5m2) == "float8_e5m2"
from ragckpt.lazy import torch as lazy
assert lazy.Tensor is torch.Tensor
"""
    assert "torch" in _torch_loaded_by(code)
