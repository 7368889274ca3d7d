"""Reads into buffers on another device (a GPU) go through a host staging window.

`ragckpt.load` and `Checkpoint.read_rank(out=)` fill a device buffer a host window at a time, so host
memory does not grow with the buffer. This machine has no GPU, so the tests mark CPU buffers as
device memory (`reader.on_host`) and shrink the window to a few hundred bytes: the result must be
bit-identical to a read straight into host memory, padding zeroed, each byte copied over once, and
no window larger than `HOST_STAGING_BYTES`.
"""

from __future__ import annotations

import pytest
import torch

import ragckpt
from ragckpt.checkpoint import reader
from ragckpt.format.dtypes import torch_dtype
from ragckpt.reshard import reshard
from ragckpt.reshard.plan import target_layout
from tests.helpers import ALL_DTYPES, assert_bit_equal, odd_state, special_tensor

WINDOW = 1000  # bytes: not a multiple of most element sizes, so windows end mid-way through runs


class Device:
    """Marks tensors as device memory and records every host window copied over to one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.copies: list[int] = []
        real_copy = reader.copy_bits

        def copy_bits(dst, src):
            if any(p <= dst.data_ptr() < p + n for p, n in self.spans):
                self.copies.append(src.numel() * src.element_size())
            return real_copy(dst, src)

        self.spans: list[tuple[int, int]] = []
        monkeypatch.setattr(reader, "on_host", lambda t: not any(p <= t.data_ptr() < p + n for p, n in self.spans))
        monkeypatch.setattr(reader, "HOST_STAGING_BYTES", WINDOW)
        monkeypatch.setattr(reader, "copy_bits", copy_bits)

    def mark(self, t: torch.Tensor) -> torch.Tensor:
        self.spans.append((t.data_ptr(), max(1, t.numel() * t.element_size())))
        return t


def _garbage_like(t: torch.Tensor) -> torch.Tensor:
    g = t.clone()
    g.view(torch.uint8).fill_(0xA5)  # padding must come back zero, not as it was
    return g


@pytest.mark.parametrize("src_layout, src_world, to_world, to_layout", [
    ("ragged", 3, 2, "ragged"), ("row", 4, 3, "row"), ("element", 2, 5, "element"), ("ragged", 5, 2, "row"),
])
def test_a_load_into_device_buffers_matches_one_into_host_memory(tmp_path, monkeypatch, src_layout, src_world,
                                                                 to_world, to_layout):
    """Guards the window cuts of a device load: runs clipped at window edges, gaps (padding between
    tensors) zeroed per window, every dtype's bytes kept."""
    state = odd_state(ALL_DTYPES, seed=4)
    state["big"] = special_tensor((300, 7), torch.float32, seed=9)  # several windows
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, src_world, src_layout)
    ck = ragckpt.open(url)
    target = target_layout(ck.layout, to_world, to_layout)
    for rank in range(to_world):
        want = ragckpt.load(ck, target, rank)
        dev = Device(monkeypatch)
        into = {name: dev.mark(_garbage_like(t)) for name, t in want.items()}
        got = ragckpt.load(ck, target, rank, into=into)
        for name, t in want.items():
            assert got[name] is into[name]
            assert_bit_equal(got[name], t, f"rank {rank} buffer {name}")
        assert dev.copies and max(dev.copies) <= WINDOW, dev.copies
        assert sum(dev.copies) == sum(t.numel() * t.element_size() for t in want.values())  # each byte once
        monkeypatch.undo()


@pytest.mark.parametrize("block_bytes", [1024, 24])
def test_a_restore_into_a_device_buffer_goes_through_whole_block_windows(tmp_path, monkeypatch, block_bytes):
    """Guards `read_rank(out=)` into a device buffer staging the whole rank buffer on the host: it
    copies over windows of whole checksum blocks (a block cut by a window would be read twice),
    bit-exact, also for a range that starts and ends inside blocks."""
    x = special_tensor((1000, 3), torch.bfloat16, seed=2)
    url = str(tmp_path / "ck")
    ragckpt.write_global({"x": x}, url, 2, "row", block_bytes=block_bytes)
    ck = ragckpt.open(url)
    n = int(ck.layout.rank_sizes(0)[1])
    for start, stop in ((0, n), (7, n - 5)):
        dev = Device(monkeypatch)
        out = dev.mark(torch.empty(stop - start, dtype=torch_dtype(ck.layout.buffers[0].dtype)))
        ck.read_rank(0, 1, start, stop, out=out)
        assert_bit_equal(out, ck.read_rank(0, 1, start, stop))
        # a window is at least one block
        assert max(dev.copies) <= max(WINDOW, block_bytes) and sum(dev.copies) == (stop - start) * 2, dev.copies
        ends = [start * 2 + sum(dev.copies[: i + 1]) for i in range(len(dev.copies) - 1)]
        assert all(e % block_bytes == 0 for e in ends), (start, dev.copies)  # on the block grid, from any start
        monkeypatch.undo()


def test_load_state_dict_fills_device_shards_a_window_at_a_time(group: None, tmp_path, monkeypatch):
    """Guards the FSDP2 adapter reading a whole GPU shard into one host tensor (per thread, all at
    once: the shards times the threads in host memory): shards on a device get windows."""
    from ragckpt.integrations.fsdp2 import load_state_dict, save_state_dict

    state = {"w": special_tensor((300, 7), torch.float32, seed=5), "b": special_tensor((41,), torch.bfloat16, seed=6),
             "m": special_tensor((9, 3), torch.bool, seed=7)}
    url = str(tmp_path / "ck")
    save_state_dict(url, state)
    dev = Device(monkeypatch)
    sd = {k: dev.mark(_garbage_like(v)) for k, v in state.items()}
    load_state_dict(url, sd)
    for k, v in state.items():
        assert_bit_equal(sd[k], v, k)
    assert dev.copies and max(dev.copies) <= WINDOW, dev.copies
    assert sum(dev.copies) == sum(v.numel() * v.element_size() for v in state.values())


def test_read_flat_into_a_device_tensor_goes_through_host_windows(tmp_path, monkeypatch):
    """Guards `Checkpoint.read_flat(out=)` on a GPU tensor staging the whole range on the host."""
    x = special_tensor((2000,), torch.float16, seed=3)
    url = str(tmp_path / "ck")
    ragckpt.write_global({"x": x}, url, 3, "ragged", block_bytes=256)
    ck = ragckpt.open(url)
    dev = Device(monkeypatch)
    out = dev.mark(torch.full((1990 - 5,), 7.0, dtype=torch.float16))
    ck.read_flat("x", 5, 1990, out=out)
    assert_bit_equal(out, x[5:1990])
    assert max(dev.copies) <= WINDOW and sum(dev.copies) == (1990 - 5) * 2, dev.copies


def test_reads_allocate_host_memory_whatever_the_default_device(tmp_path):
    """Guards host buffers following torch's default device (`torch.set_default_device("cuda")`, a
    `with torch.device(...)` block, common in FSDP2 set-ups): `read_flat` then allocated its result
    on the device and sent its own host windows back to the device path forever (RecursionError).
    The meta device stands in for a GPU here: everything read must come back in host memory."""
    state = {"x": special_tensor((300, 7), torch.bfloat16, seed=1), "y": special_tensor((13,), torch.bool, seed=2)}
    url = str(tmp_path / "ck")
    with torch.device("meta"):  # writing and resharding too
        ragckpt.write_global(state, url, 3, "ragged")
        reshard(url, str(tmp_path / "re"), 2)
    for u in (url, str(tmp_path / "re")):
        for name, t in state.items():
            assert_bit_equal(ragckpt.open(u).read(name), t, f"{u} {name}")
    ck = ragckpt.open(url)
    target = target_layout(ck.layout, 2, "row")
    want = [ragckpt.load(ck, target, r) for r in range(2)]
    with torch.device("meta"):
        got = {name: ck.read(name) for name in state}
        flat = ck.read_flat("x", 5, 900)
        rank = ck.read_rank(0, 1)
        loaded = [ragckpt.load(ck, target, r) for r in range(2)]
    for name, t in state.items():
        assert got[name].device.type == "cpu"
        assert_bit_equal(got[name], t, name)
    assert flat.device.type == "cpu"
    assert_bit_equal(flat, state["x"].reshape(-1)[5:900])
    assert rank.device.type == "cpu"
    assert_bit_equal(rank, ck.read_rank(0, 1))
    for r in range(2):
        for name, t in want[r].items():
            assert loaded[r][name].device.type == "cpu"
            assert_bit_equal(loaded[r][name], t, f"rank {r} {name}")
