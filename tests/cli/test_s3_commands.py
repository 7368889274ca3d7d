"""`ragckpt reshard`, `export-hf` and `import-hf` with s3:// on either side (local -> S3, S3 -> local,
S3 -> S3), each checked bit for bit against the same command run on local paths."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import ragckpt
from cli.main import cli
from tests.helpers import assert_bit_equal, bits, special_tensor

SIDES = [("local", "s3"), ("s3", "local"), ("s3", "s3")]


def _run(*args: str) -> str:
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert r.exit_code == 0, f"ragckpt {' '.join(args)} -> {r.exit_code}: {r.stderr}"
    return r.stdout


def _state() -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": special_tensor((97, 16), torch.bfloat16, 1),
        "model.layers.0.mlp.up_proj.weight": special_tensor((48, 16), torch.float32, 2),
        "model.layers.0.input_layernorm.weight": special_tensor((16,), torch.float16, 3),
        "model.layers.0.self_attn.q_proj.weight": special_tensor((16, 16), torch.float8_e4m3fn, 4),
        "lm_head.weight": special_tensor((97, 16), torch.bfloat16, 5),
    }


def _where(side: str, tmp_path, s3, name: str) -> str:
    return str(tmp_path / name) if side == "local" else f"{s3.url}/{name}"


def _assert_same_checkpoint(a: str, b: str, opts: dict) -> None:
    ca, cb = ragckpt.open(a, storage_options=opts), ragckpt.open(b, storage_options=opts)
    assert ca.world_size == cb.world_size and ca.kind == cb.kind and ca.names() == cb.names()
    for n in ca.names():
        assert torch.equal(bits(ca.read(n)), bits(cb.read(n))), n
        for r in range(ca.world_size):
            assert torch.equal(bits(ca.read_local(n, r)), bits(cb.read_local(n, r))), (n, r)
    assert cb.verify().ok


@pytest.mark.parametrize(("src_side", "dst_side"), SIDES)
def test_reshard_across_storage(s3, tmp_path, src_side, dst_side):
    state = _state()
    base = str(tmp_path / "base")
    ragckpt.write_global(state, base, 3)
    src = _where(src_side, tmp_path, s3, "src")
    ragckpt.write_global(state, src, 3, storage_options=s3.storage_options)
    want = str(tmp_path / "want")
    _run("reshard", base, want, "--to", "5", "--no-progress")
    dst = _where(dst_side, tmp_path, s3, "dst")
    json.loads(_run("reshard", src, dst, "--to", "5", "--no-progress", "--json", *s3.cli_args()))
    _assert_same_checkpoint(want, dst, s3.storage_options)
    for n, t in state.items():
        assert torch.equal(bits(ragckpt.open(dst, storage_options=s3.storage_options).read(n)), bits(t)), n


@pytest.mark.parametrize(("src_side", "dst_side"), SIDES)
def test_export_hf_across_storage(s3, tmp_path, src_side, dst_side):
    state = _state()
    src = _where(src_side, tmp_path, s3, "ck")
    ragckpt.write_global(state, src, 2, storage_options=s3.storage_options)
    out = _where(dst_side, tmp_path, s3, "hf")
    _run("export-hf", src, out, "--max-shard-size", "4KB", *s3.cli_args())
    local_out = tmp_path / "hf_local"
    if dst_side == "s3":
        s3.fs().get(f"{out}/", str(local_out), recursive=True)
    else:
        local_out = tmp_path / "hf"
    index = json.loads((local_out / "model.safetensors.index.json").read_text())
    got: dict[str, torch.Tensor] = {}
    for f in sorted(set(index["weight_map"].values())):
        got.update(load_file(str(local_out / f)))
    assert set(got) == set(state)
    for n, t in state.items():
        assert torch.equal(bits(got[n]), bits(t)), n


@pytest.mark.parametrize(("src_side", "dst_side"), SIDES)
def test_import_hf_across_storage(s3, tmp_path, src_side, dst_side):
    """Same checkpoint as a local import, and every tensor equal to the original (two imports that
    both lose the data would agree)."""
    state = _state()
    hf_local = tmp_path / "hf_model"
    os.makedirs(hf_local)
    save_file(state, str(hf_local / "model.safetensors"))
    (hf_local / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if src_side == "s3":
        fs = s3.fs()
        for f in ("model.safetensors", "config.json"):
            fs.put_file(str(hf_local / f), f"{s3.url}/hf_model/{f}")
        hf = f"{s3.url}/hf_model"
    else:
        hf = str(hf_local)
    want = str(tmp_path / "want")
    _run("import-hf", str(hf_local), want, "-w", "4")
    dst = _where(dst_side, tmp_path, s3, "imported")
    _run("import-hf", hf, dst, "-w", "4", *s3.cli_args())
    _assert_same_checkpoint(want, dst, s3.storage_options)
    ck = ragckpt.open(dst, storage_options=s3.storage_options)
    for n, t in state.items():
        assert_bit_equal(ck.read(n), t, n)


def test_reshard_s3_to_s3_with_worker_processes(s3, tmp_path):
    """`--workers 2`: spawned processes open their own S3 clients from the same -o options; the
    result matches a local reshard and the original tensors."""
    state = _state()
    ragckpt.write_global(state, str(tmp_path / "base"), 2)
    _run("reshard", str(tmp_path / "base"), str(tmp_path / "want"), "--to", "3", "--layout", "row", "--no-progress")
    ragckpt.write_global(state, f"{s3.url}/src", 2, storage_options=s3.storage_options)
    _run("reshard", f"{s3.url}/src", f"{s3.url}/dst", "--to", "3", "--layout", "row", "--workers", "2",
         "--no-progress", *s3.cli_args())
    _assert_same_checkpoint(str(tmp_path / "want"), f"{s3.url}/dst", s3.storage_options)
    ck = ragckpt.open(f"{s3.url}/dst", storage_options=s3.storage_options)
    for n, t in state.items():
        assert_bit_equal(ck.read(n), t, n)
