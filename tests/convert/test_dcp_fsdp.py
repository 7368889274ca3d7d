"""FSDP2 (CPU/gloo) end to end: 2 ranks train and save with DCP -> import-dcp -> export-dcp -> stock
`dcp.load` + `set_state_dict` into a fresh FSDP2 model at 3 ranks. The references are FSDP2's own
`full_tensor()` of every parameter and Adam state, compared byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ragckpt
from ragckpt.convert.dcp import export_dcp, import_dcp
from tests.helpers import free_port

WORKER = Path(__file__).resolve().parents[1] / "dcp_fsdp_worker.py"


def run_worker(mode: str, dcp_dir: Path, out_pt: Path, nprocs: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, str(WORKER), mode, str(dcp_dir), str(out_pt), str(free_port()), str(nprocs)],
                       capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, f"{mode} worker failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return torch.load(out_pt, weights_only=False)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(bits(got), bits(want)), f"{what}: bytes differ"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    d = tmp_path_factory.mktemp("fsdp")
    ref = run_worker("save", d / "dcp", d / "ref.pt", 2)
    return d, ref


def expected_tensors(ref: dict) -> dict[str, torch.Tensor]:
    """What the ragckpt checkpoint must hold, by the documented key mapping."""
    out = {k: v for k, v in ref["model"].items()}
    out |= {f"optim.{k}": v for k, v in ref["optim"].items()}
    out |= {f"extra.tp.{k}": v for k, v in ref["tp"].items()}
    return out


@pytest.mark.slow
def test_fsdp2_dcp_import_export_reshard_2_to_3(saved: tuple[Path, dict]) -> None:
    d, ref = saved
    want = expected_tensors(ref)
    assert any(v.dtype == torch.bfloat16 for v in want.values()) and "seen" in want
    # import at the save's own world size (recovered from the file names) ...
    s = import_dcp(str(d / "dcp"), str(d / "rag"))
    assert s.saved_world_size == 2 and s.world_size == 2
    ck = ragckpt.open(str(d / "rag"))
    assert sorted(ck.names()) == sorted(want)
    for name, t in want.items():
        assert_same(ck.read(name), t, name)
    # the optimizer hyperparameters travel in user metadata, readable per parameter
    groups = ck.user["optim.param_groups"]
    assert groups["inp.weight"]["lr"] == ref["hparams"][0]["lr"] and groups["out.weight"]["betas"] == [0.8, 0.95]
    # ... and at another world size with FSDP2's row layout
    s3 = import_dcp(str(d / "dcp"), str(d / "rag3"), world_size=3, layout="row")
    ck3 = ragckpt.open(str(d / "rag3"))
    assert s3.world_size == 3 and ck3.world_size == 3
    for name, t in want.items():
        assert_same(ck3.read(name), t, name)
    # export with tiny chunks: row groups and sub-row boxes, which dcp.load must reshard onto 3 ranks
    e = export_dcp(str(d / "rag3"), str(d / "out"), max_chunk_bytes=24)
    assert e.chunks > 2 * len(want)
    got = run_worker("load", d / "out", d / "got.pt", 3)
    assert got["local_rows"]["inp.weight"] == 8 and got["local_rows"]["out.weight"] == 2  # 22 and 5 rows on 3
    for section in ("model", "optim", "tp", "params"):
        assert sorted(got[section]) == sorted(ref[section])
        for k, v in ref[section].items():
            assert_same(got[section][k], v, f"{section}.{k}")
    assert got["hparams"] == ref["hparams"]  # lr 1e-2 restored over the fresh optimizer's 5e-4


def test_missing_rank_file_names_the_rank(saved: tuple[Path, dict], tmp_path: Path) -> None:
    """A save by 2 ranks with rank 1's file gone: one line that says which rank's data is missing."""
    import shutil

    from click.testing import CliRunner

    from cli.main import cli

    d, _ = saved
    broken = tmp_path / "dcp"
    shutil.copytree(d / "dcp", broken)
    (broken / "__1_0.distcp").unlink()
    r = CliRunner().invoke(cli, ["import-dcp", str(broken), str(tmp_path / "rag"), "--world-size", "3"])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "__1_0.distcp is missing (written by rank 1 of the save)" in lines[0], r.stderr
    assert not (tmp_path / "rag").exists()
