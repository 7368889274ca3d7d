"""Hugging Face conversion edge cases: weights under names ragckpt reserves for engine state (`optim`,
`extra` submodules), tensor names with non-ASCII digits, malformed or null `__metadata__`, rename maps
with a key twice, and `--include` that matches only optimizer state."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ragckpt
from ragckpt.convert.hf_export import export_hf
from ragckpt.convert.hf_import import import_hf
from tests.helpers import assert_bit_equal, cli_error, cli_run, special_tensor


def _model(tmp_path: Path, state: dict[str, torch.Tensor], name: str = "hf") -> Path:
    d = tmp_path / name
    d.mkdir()
    save_file(state, str(d / "model.safetensors"))
    return d


def test_weights_of_submodules_called_optim_or_extra_are_exported_and_cast(tmp_path):
    """A model with a submodule named `extra` or `optim` has weights under names ragckpt reserves for
    engine state; export-hf left them out as optimizer state (and --dtype did not cast them)."""
    state = {"extra.proj.weight": special_tensor((3, 4), torch.float32, 1),
             "optim.head.weight": special_tensor((5,), torch.bfloat16, 2),
             "model.w": special_tensor((2, 2), torch.float32, 3)}
    hf = _model(tmp_path, state)
    import_hf(str(hf), str(tmp_path / "ck"), 3)
    ragckpt.reshard.reshard(str(tmp_path / "ck"), str(tmp_path / "ck2"), 2)  # the record travels along
    code, out, err = cli_run("export-hf", str(tmp_path / "ck2"), str(tmp_path / "out"), "--json")
    assert code == 0, err
    assert json.loads(out)["excluded"] == 0
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(state)
    for n, t in state.items():
        assert_bit_equal(got[n], t, n)
    export_hf(str(tmp_path / "ck"), str(tmp_path / "bf16"), dtype="bf16")
    got = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for n, t in state.items():
        assert_bit_equal(got[n], t.to(torch.bfloat16), n)


def test_a_checkpoints_own_optimizer_state_is_still_left_out(tmp_path):
    """The recorded names are exactly the imported ones: state a job saved later under optim. stays out."""
    state = {"optim.head.weight": torch.arange(4.0)}
    import_hf(str(_model(tmp_path, state)), str(tmp_path / "ck"), 2)
    ck = ragckpt.open(str(tmp_path / "ck"))
    ragckpt.write_global({**{n: ck.read(n) for n in ck.names()}, "optim.state.w.exp_avg": torch.ones(3)},
                         str(tmp_path / "ck2"), 2, user=ck.user)
    res = export_hf(str(tmp_path / "ck2"), str(tmp_path / "out"))
    assert res.excluded == 1
    assert sorted(load_file(str(tmp_path / "out" / "model.safetensors"))) == ["optim.head.weight"]


def test_names_with_superscript_digits_export(tmp_path):
    """'²' is a digit to str.isdigit but not to the regex \\d: the shard-order key called int('²')."""
    state = {"model.w1²": torch.arange(3.0), "model.w10": torch.arange(2.0), "model.w2": torch.ones(1)}
    import_hf(str(_model(tmp_path, state)), str(tmp_path / "ck"), 2)
    export_hf(str(tmp_path / "ck"), str(tmp_path / "out"))
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    for n, t in state.items():
        assert_bit_equal(got[n], t, n)


def _raw_safetensors(path: Path, header: str) -> None:
    """A file with this header text (as bytes, unescaped by us) and 4 bytes of data for tensor 'a'."""
    h = header.encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"\0\0\0\0")


@pytest.mark.parametrize("meta", ['[]', '""', '0', 'false', '{"x": "\\ud800"}', '{"\\udc00": "y"}', '{"x": 1}'])
def test_a_malformed_metadata_section_is_refused_naming_the_file(tmp_path, meta):
    d = tmp_path / "hf"
    d.mkdir()
    _raw_safetensors(d / "model.safetensors",
                     '{"__metadata__": ' + meta + ', "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}')
    line = cli_error("import-hf", str(d), str(tmp_path / "ck"), "-w", "2")
    assert f"{d}/model.safetensors: __metadata__" in line, line
    assert not (tmp_path / "ck").exists()


def test_a_null_metadata_section_is_accepted_as_safetensors_does(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    _raw_safetensors(d / "model.safetensors",
                     '{"__metadata__": null, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}')
    assert torch.equal(load_file(str(d / "model.safetensors"))["a"], torch.zeros(1))
    import_hf(str(d), str(tmp_path / "ck"), 2)
    assert_bit_equal(ragckpt.open(str(tmp_path / "ck")).read("a"), torch.zeros(1))


def test_a_rename_map_with_a_key_twice_is_refused(tmp_path):
    ragckpt.write_global({"a": torch.ones(2), "b": torch.zeros(2)}, str(tmp_path / "ck"), 2)
    rmap = tmp_path / "map.json"
    rmap.write_text('{"a": "x", "a": "y"}')
    line = cli_error("export-hf", str(tmp_path / "ck"), str(tmp_path / "out"), "--rename-map", str(rmap))
    assert f"rename map {rmap}: 'a' is mapped twice" in line
    assert not (tmp_path / "out").exists()


def test_include_of_optimizer_state_alone_points_at_all_tensors(tmp_path):
    ragckpt.write_global({"w": torch.ones(2), "optim.state.w.exp_avg": torch.zeros(2)}, str(tmp_path / "ck"), 2)
    line = cli_error("export-hf", str(tmp_path / "ck"), str(tmp_path / "out"), "--include", "optim.state.*")
    assert "matches only optimizer state or extra.* tensors" in line and "--all-tensors" in line, line
    assert not (tmp_path / "out").exists()
    # a glob that matches nothing at all is still told so
    line = cli_error("export-hf", str(tmp_path / "ck"), str(tmp_path / "out"), "--include", "nothing.*")
    assert "matched nothing" in line
    res = export_hf(str(tmp_path / "ck"), str(tmp_path / "out"), include=["optim.state.*"], all_tensors=True)
    assert res.tensors == 1
