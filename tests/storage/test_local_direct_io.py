"""O_DIRECT writes of large local objects: exact bytes for every size and part split, the buffered
fallback where a file system refuses O_DIRECT, and the switch that turns it off."""

from __future__ import annotations

import errno
import os
import sys

import numpy as np
import pytest
import torch

import ragckpt
from ragckpt.errors import StorageError
from ragckpt.storage import direct
from ragckpt.storage.config import io_config
from ragckpt.storage.store import LocalStore, open_store
from tests.helpers import assert_bit_equal

pytestmark = pytest.mark.skipif(direct.O_DIRECT is None, reason="no O_DIRECT on this platform")


def _supports_direct(path) -> bool:
    try:
        direct.write_direct(str(path / "probe"), [memoryview(bytes(direct.ALIGN))])
    except direct.DirectUnsupported:
        return False
    return True


def _spy_direct_writes(monkeypatch) -> list[str]:
    """The path of every `direct.write_direct` call that returned (the object went to disk with
    O_DIRECT), in a list that fills as they happen."""
    done: list[str] = []
    real = direct.write_direct

    def spy(path, parts):
        real(path, parts)
        done.append(path)

    monkeypatch.setattr(direct, "write_direct", spy)
    return done


@pytest.mark.parametrize("sizes", [
    [direct.MIN_BYTES],  # exactly aligned
    [direct.MIN_BYTES + 1],  # one byte past an aligned block: padded then truncated
    [direct.BOUNCE_BYTES * 2 + 4095],  # several bounce buffers and a partial block
    [3, direct.MIN_BYTES - 1, 7, direct.BOUNCE_BYTES + 11],  # unaligned parts straddling bounce buffers
])
def test_direct_write_is_byte_exact(tmp_path, sizes, monkeypatch):
    if not _supports_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    direct_writes = _spy_direct_writes(monkeypatch)
    rng = np.random.default_rng(len(sizes) + sizes[0])
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    # a view at an odd address, as a torch tensor's storage usually is
    parts[0] = memoryview(b"x" + parts[0])[1:]
    store = LocalStore(str(tmp_path / "ck"))
    store.write("buffers/0/c.0.0", parts)
    assert direct_writes == [str(tmp_path / "ck" / "buffers" / "0" / "c.0.0")]  # this object went with O_DIRECT
    store.sync()
    want = b"".join(bytes(p) for p in parts)
    assert store.size("buffers/0/c.0.0") == len(want)
    assert store.read("buffers/0/c.0.0") == want


def test_refused_o_direct_falls_back_to_buffered_writes(tmp_path, monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & direct.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    store = LocalStore(str(tmp_path / "ck"))
    data = os.urandom(direct.MIN_BYTES + 123)
    store.write("buffers/0/c.0.0", [data])
    assert not store.direct_io  # remembered: later objects skip the attempt
    store.write("buffers/0/c.1.0", [data])
    assert store.read("buffers/0/c.0.0") == data and store.read("buffers/0/c.1.0") == data


def test_refused_direct_write_after_open_falls_back(tmp_path, monkeypatch):
    """Some file systems accept the O_DIRECT open and refuse the write itself."""
    real_write = os.write
    direct_fds: set[int] = set()
    real_open = os.open

    def tracking_open(path, flags, *args):
        fd = real_open(path, flags, *args)
        (direct_fds.add if flags & direct.O_DIRECT else direct_fds.discard)(fd)  # fd numbers are reused
        return fd

    def refusing_write(fd, data):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "write", refusing_write)
    store = LocalStore(str(tmp_path / "ck"))
    data = os.urandom(direct.MIN_BYTES * 2)
    store.write("obj", [data])
    assert not store.direct_io and store.read("obj") == data


@pytest.mark.parametrize("code,message", [
    (errno.ENOSPC, "No space left"),  # a full disk is reported, never retried buffered
    (errno.EINVAL, "RAGCKPT_IO_DIRECT=0"),  # refused mid-file: the error names the switch
])
def test_direct_write_errors_after_the_first_block(tmp_path, monkeypatch, code, message):
    if not _supports_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    real_write = os.write
    calls = []

    def fail_second_write(fd, data):
        # only this object's writes count: another thread of the test process may call os.write
        # meanwhile (a multiprocessing pipe left by an earlier test, say)
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/ck/obj"):
            calls.append(len(data))
            if len(calls) == 2:
                raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", fail_second_write)
    store = LocalStore(str(tmp_path / "ck"))
    with pytest.raises(StorageError, match=message):
        store.write("obj", [os.urandom(direct.BOUNCE_BYTES * 2)])


def test_direct_io_switch(tmp_path, monkeypatch):
    assert open_store(str(tmp_path)).direct_io
    assert not open_store(str(tmp_path), {"ragckpt": {"direct_io": "false"}}).direct_io
    monkeypatch.setenv("RAGCKPT_IO_DIRECT", "0")
    assert not io_config().direct_io and not open_store(f"file://{tmp_path}").direct_io
    with pytest.raises(StorageError, match="direct_io"):
        io_config({"ragckpt": {"direct_io": "sometimes"}})


@pytest.mark.parametrize("direct_io", ["1", "0"])
def test_checkpoint_round_trip_with_and_without_direct_io(tmp_path, monkeypatch, direct_io):
    monkeypatch.setenv("RAGCKPT_IO_DIRECT", direct_io)
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(1031, 517, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16)}
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, 3, "row")
    ck = ragckpt.open(url)
    assert ck.verify().ok
    for k, v in state.items():
        assert_bit_equal(ck.read(k), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.int64])
@pytest.mark.parametrize("numel", [0, 1, 4097, 3 << 20])
def test_aligned_empty(dtype, numel):
    t = ragckpt.aligned_empty(numel, dtype)
    assert t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
    assert numel == 0 or t.data_ptr() % direct.ALIGN == 0
    t.view(torch.uint8).fill_(7)  # writable over its whole length
    assert int(t.view(torch.uint8).sum()) == 7 * numel * t.element_size()


def test_aligned_sources_mixed_with_unaligned_parts(tmp_path, monkeypatch):
    """Aligned parts go to the device without a copy, but only while the bounce buffer is empty; an
    aligned part that follows unaligned bytes must still land at the right file offset."""
    if not _supports_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    direct_writes = _spy_direct_writes(monkeypatch)
    rng = np.random.default_rng(5)

    def aligned(nbytes: int) -> memoryview:
        t = ragckpt.aligned_empty(nbytes, torch.uint8)
        t.copy_(torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8)))
        return memoryview(t.numpy()).cast("B")

    parts = [aligned(direct.MIN_BYTES + 100), b"\x01\x02\x03", aligned(2 * direct.ALIGN),
             aligned(direct.BOUNCE_BYTES + direct.ALIGN)]
    store = LocalStore(str(tmp_path / "ck"))
    store.write("obj", parts)
    assert direct_writes == [str(tmp_path / "ck" / "obj")]  # this object went with O_DIRECT
    assert store.read("obj") == b"".join(bytes(p) for p in parts)


def test_save_shard_stages_non_contiguous_buffers(tmp_path):
    g = torch.Generator().manual_seed(9)
    full = torch.randn(600_000, 2, generator=g)
    column = full[:, 1]  # a strided view: save_shard stages it into aligned memory
    assert not column.is_contiguous()
    lay = ragckpt.CheckpointLayout.build({"w": ((600_000,), "float32")}, 1, "element")
    url = str(tmp_path / "ck")
    ragckpt.save_shard(url, 0, {"float32": column}, lay)
    ragckpt.commit(url)
    assert_bit_equal(ragckpt.open(url).read("w"), column.contiguous())


@pytest.mark.parametrize("piece", [1, 1000, 4096, 1 << 20])
def test_local_range_pieces_arrive_in_order_and_exact(tmp_path, piece):
    st = LocalStore(str(tmp_path))
    data = os.urandom(10_000)
    st.write("obj", [data])
    out = memoryview(bytearray(9_000))
    seen = []
    for p in st.read_range_pieces("obj", 700, out, piece):
        # each piece has landed when it is yielded, and the pieces tile `out` in order
        assert bytes(p) == data[700 + sum(seen) : 700 + sum(seen) + len(p)]
        seen.append(len(p))
    assert seen == [min(piece, 9_000 - s) for s in range(0, 9_000, piece)]
    assert bytes(out) == data[700:9_700]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for RSS")
def test_chunk_padding_is_shared_read_only_zeros_that_cost_no_memory():
    """The zeros that pad a rank's last chunk to full size come from one mapping that is never
    written: reading 64 MiB of it maps no memory, and no caller can change what the next one gets."""
    def rss() -> int:
        return next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmRSS:"))

    before = rss()
    pad = direct.zeros(64 << 20)
    assert len(pad) == 64 << 20 and pad.readonly
    assert not np.frombuffer(pad, dtype=np.uint8).any()
    assert rss() - before < 8 << 20, (rss() - before) >> 20
    with pytest.raises(TypeError):
        pad[0] = 1
    small = direct.zeros(3)
    assert bytes(small) == bytes(3) and small.readonly
