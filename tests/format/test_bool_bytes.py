"""Bool tensors keep every byte on every save path, strided ones included.

A bool byte other than 0 or 1 is still a byte a checkpoint must return as it was given. torch's own
reshape of a strided tensor, `contiguous`, `clone` and `to` turn every nonzero bool byte into 1, so a
transposed bool buffer used to be stored as 0/1 by save_shard, save_shard_async, write_global,
save_state_dict and async_save_state_dict, where the same bytes given contiguously were kept.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ragckpt
from ragckpt.convert.dcp import import_dcp
from ragckpt.format.runs import flat_bits, host_bits
from ragckpt.integrations.fsdp2 import async_save_state_dict, save_state_dict

RAW = torch.tensor([0, 2, 255, 1, 7, 0, 3, 9, 4, 0, 1, 128], dtype=torch.uint8)


def strided_bools() -> tuple[torch.Tensor, torch.Tensor]:
    """A transposed (3, 4) bool view of RAW, and its bytes in row-major order."""
    view = RAW.view(torch.bool).reshape(4, 3).t()
    assert not view.is_contiguous()
    return view, RAW.reshape(4, 3).t().reshape(-1)  # uint8 copies keep the bytes


def stored_bytes(url: str, name: str = "m") -> torch.Tensor:
    return ragckpt.open(url).read(name).view(torch.uint8).reshape(-1)


def test_the_helpers_keep_bytes_where_torch_does_not():
    view, want = strided_bools()
    assert view.reshape(-1).view(torch.uint8).tolist() != want.tolist()  # why the helpers exist
    assert torch.equal(flat_bits(view).view(torch.uint8), want)
    assert torch.equal(flat_bits(view, "cpu").view(torch.uint8), want)
    kept = host_bits(RAW.view(torch.bool), copy=True)
    assert kept.data_ptr() != RAW.data_ptr() and torch.equal(kept.view(torch.uint8), RAW)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_save_shard_keeps_a_strided_bool_buffer(tmp_path: Path, asynchronous: bool):
    view, want = strided_bools()
    lay = ragckpt.CheckpointLayout.build({"m": ((12,), "bool")}, 1, "element")
    url = str(tmp_path / "ck")
    save = ragckpt.save_shard_async if asynchronous else ragckpt.save_shard
    record = save(url, 0, {"bool": view}, lay)
    ragckpt.commit(url, rank_manifests={0: record.result() if asynchronous else record})
    assert torch.equal(stored_bytes(url), want)


@pytest.mark.parametrize("layout", ["row", "element", "ragged"])
def test_write_global_keeps_a_strided_bool_tensor(tmp_path: Path, layout: str):
    view, want = strided_bools()
    ragckpt.write_global({"m": view, "pad": torch.ones(5)}, str(tmp_path / layout), 2, layout)
    assert torch.equal(stored_bytes(str(tmp_path / layout)), want)


@pytest.mark.parametrize("save", [save_state_dict, lambda url, sd: async_save_state_dict(url, sd).result()],
                         ids=["sync", "async"])
def test_state_dict_saves_keep_a_strided_bool_entry(tmp_path: Path, group, save):
    view, want = strided_bools()
    save(str(tmp_path / "ck"), {"model": {"m": view}})
    assert torch.equal(stored_bytes(str(tmp_path / "ck")), want)


def test_import_dcp_keeps_a_strided_bool_record(tmp_path: Path):
    """DCP writes a chunk with its memory format, storage bytes as they are; import rebuilds the
    row-major order from the strides without turning the bytes into 0/1."""
    raw = (torch.arange(2 * 3 * 2 * 2) * 37 % 256).to(torch.uint8)
    raw[::5] = 0
    bools = raw.reshape(2, 3, 2, 2).contiguous(memory_format=torch.channels_last).view(torch.bool)
    assert not bools.is_contiguous()
    with warnings.catch_warnings():  # "no process group: running single-process"
        warnings.simplefilter("ignore")
        dcp.save({"model": {"m": bools}}, checkpoint_id=str(tmp_path / "dcp"))
    import_dcp(str(tmp_path / "dcp"), str(tmp_path / "rag"), world_size=2, layout="element")
    assert torch.equal(stored_bytes(str(tmp_path / "rag")), raw)
