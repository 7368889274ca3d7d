"""Checksummed reads from local files (`LocalStore.read_block_crcs`): each checksum block lands in
pieces small enough to still be in the CPU cache when they are checksummed, the crc continued across
a block's pieces. What is checked: the crc of every block and the bytes landed, against the file's
own bytes and block checksums computed over them whole; the piece sizes the
reads use, crowded or not; short reads, truncated and corrupt objects inside a block's pieces.
"""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest
import torch

import ragckpt
from ragckpt.errors import BadObjectError, IntegrityError, StorageError
from ragckpt.storage import store as store_mod
from ragckpt.storage.checksum import block_crcs
from ragckpt.storage.pagecache import page_cached
from ragckpt.storage.store import LocalStore, Store
from tests.helpers import cut

BLOCK = 4096
SIZE = 3 * BLOCK + 1234  # a short last block


@pytest.fixture()
def obj(tmp_path) -> tuple[LocalStore, bytes]:
    data = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    st = LocalStore(str(tmp_path / "s"))
    st.write("o", [data])
    return st, data


@pytest.fixture()
def small_pieces(monkeypatch):
    """Pieces of 1 KiB (2 KiB when crowded) in 4 KiB blocks, so each block takes several reads."""
    monkeypatch.setattr(store_mod, "CACHE_PIECE_BYTES", 1024)
    monkeypatch.setattr(store_mod, "CROWDED_PIECE_BYTES", 2048)


def preadv_sizes(monkeypatch) -> list[int]:
    """Sizes of the reads that land data (every read does: the page-cache probe reads nothing)."""
    sizes: list[int] = []
    real = os.preadv

    def spy(fd, bufs, offset, *flags):
        sizes.append(sum(len(memoryview(b)) for b in bufs))
        return real(fd, bufs, offset, *flags)

    monkeypatch.setattr(os, "preadv", spy)
    return sizes


@pytest.mark.parametrize("crowded", [False, True])
@pytest.mark.parametrize("split", [[SIZE], [1, 4095, 5000, SIZE - 9096], [3000, SIZE - 3000]])
def test_block_crcs_and_bytes_in_pieces(obj, small_pieces, monkeypatch, crowded, split):
    st, data = obj
    if crowded:
        monkeypatch.setattr(store_mod, "_CORES", 0)
    sizes = preadv_sizes(monkeypatch)
    views = cut(SIZE, split)
    got = list(st.read_block_crcs([("o", 0, views)], BLOCK))
    assert got == block_crcs(data, BLOCK).tolist()
    assert b"".join(bytes(v) for v in views) == data
    piece = 2048 if crowded else 1024
    assert max(sizes) == piece and len(sizes) >= SIZE // piece
    assert store_mod._readers == 0


def test_blocks_of_several_items_and_the_base_store_agree(obj, small_pieces):
    """Two ranges of one object (each starting on a block), as `read_scatter_many` passes them:
    the local override and the generic path (what object stores use) yield the same crcs."""
    st, data = obj
    want = block_crcs(data[BLOCK:], BLOCK).tolist() + block_crcs(data[: 2 * BLOCK], BLOCK).tolist()
    for impl in (LocalStore.read_block_crcs, Store.read_block_crcs):
        a, b = memoryview(bytearray(SIZE - BLOCK)), memoryview(bytearray(2 * BLOCK))
        assert list(impl(st, [("o", BLOCK, [a]), ("o", 0, [b[:100], b[100:]])], BLOCK)) == want
        assert bytes(a) == data[BLOCK:] and bytes(b) == data[: 2 * BLOCK]


def test_blocks_the_piece_does_not_divide_are_read_whole(obj, monkeypatch):
    st, data = obj
    monkeypatch.setattr(store_mod, "CACHE_PIECE_BYTES", 3000)
    sizes = preadv_sizes(monkeypatch)
    buf = memoryview(bytearray(SIZE))
    assert list(st.read_block_crcs([("o", 0, [buf])], BLOCK)) == block_crcs(data, BLOCK).tolist()
    assert sizes == [BLOCK, BLOCK, BLOCK, 1234]


def test_default_pieces_of_a_rank_restore(tmp_path, monkeypatch):
    """The real sizes: a restore (`read_rank(out=)`) of 2.5 MiB in 1 MiB blocks reads 256 KiB pieces
    from the page cache, 512 KiB pieces while more threads read than there are cores, and whole
    blocks from the disk when direct I/O is off (where the cache is no help, and larger reads keep
    more in flight)."""
    x = torch.arange(5 * 2**17, dtype=torch.int32) * 2654435761
    path = str(tmp_path / "ck")
    ragckpt.write_global({"x": x}, path, 1, "element")
    ck = ragckpt.open(path)
    ck.read_rank(0, 0)  # into the page cache (the save wrote around it)
    for cores, piece, cached in ((64, 256 << 10, True), (0, 512 << 10, True), (64, 1 << 20, False)):
        monkeypatch.setattr(store_mod, "_CORES", cores)
        if not cached:
            monkeypatch.setattr(store_mod, "_cached", lambda fd, pos: False)
            monkeypatch.setattr(ck.store, "direct_io", False)
        sizes = preadv_sizes(monkeypatch)
        out = torch.zeros_like(x)
        ck.read_rank(0, 0, out=out)
        assert torch.equal(out, x)
        assert sizes == [piece] * (len(sizes) - 1) + [sizes[-1]] and sum(sizes) == x.numel() * 4
        monkeypatch.undo()


def test_short_reads_inside_a_piece_resume(obj, small_pieces, monkeypatch):
    st, data = obj
    real = os.preadv

    def short(fd, bufs, offset, *flags):
        first = memoryview(bufs[0]).cast("B")
        return real(fd, [first[: min(len(first), 333)]], offset, *flags)

    monkeypatch.setattr(os, "preadv", short)
    buf = memoryview(bytearray(SIZE))
    assert list(st.read_block_crcs([("o", 0, [buf])], BLOCK)) == block_crcs(data, BLOCK).tolist()
    assert bytes(buf) == data


def test_truncated_mid_piece_names_the_object(obj, small_pieces):
    st, _ = obj
    os.truncate(os.path.join(st.root, "o"), BLOCK + 1500)
    got = st.read_block_crcs([("o", 0, [memoryview(bytearray(SIZE))])], BLOCK)
    with pytest.raises(BadObjectError, match=rf"o is truncated: wanted bytes \[0, {SIZE}\), file ends at {BLOCK + 1500}"):
        list(got)
    assert store_mod._readers == 0


def test_a_flipped_byte_in_a_later_piece_of_a_block_is_named(tmp_path, small_pieces):
    """The crc must run over every piece of a block: corruption in its third 1 KiB piece."""
    data = torch.from_numpy(np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8))
    path = str(tmp_path / "ck")
    ragckpt.write_global({"x": data}, path, 1, "element", block_bytes=BLOCK)
    ck = ragckpt.open(path)
    obj_path = os.path.join(path, "buffers", "0", "c.0.0")
    with open(obj_path, "r+b") as f:
        f.seek(BLOCK + 2500)
        b = f.read(1)
        f.seek(BLOCK + 2500)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(IntegrityError, match=r"checksum mismatch in .*rank 0, block 1\)"):
        ck.read_rank(0, 0, out=torch.zeros_like(data))
    assert store_mod._readers == 0


def test_an_io_error_mid_block_is_named_and_the_reader_released(tmp_path, small_pieces, monkeypatch):
    """A disk error on the third piece of a restore: one line naming the object, not an OSError."""
    x = torch.arange(SIZE, dtype=torch.uint8)
    path = str(tmp_path / "ck")
    ragckpt.write_global({"x": x}, path, 1, "element", block_bytes=BLOCK)
    ck = ragckpt.open(path)
    real, calls = os.preadv, []

    def failing(fd, bufs, offset, *flags):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(StorageError, match=r"cannot read .*c\.0\.0: Input/output error"):
        ck.read_rank(0, 0, out=torch.zeros_like(x))
    assert calls == [0, 1024, 2048] and store_mod._readers == 0


@pytest.mark.parametrize("change", ["drop_last", "add_one"])
def test_a_store_that_miscounts_blocks_is_caught(tmp_path, monkeypatch, change):
    """A store backend whose `read_block_crcs` yields one crc too few would leave a block unchecked
    (here the corrupt one); one too many would index past the expected list. Both are one clear
    error, not silence or an IndexError."""
    x = torch.arange(SIZE, dtype=torch.uint8)
    path = str(tmp_path / "ck")
    ragckpt.write_global({"x": x}, path, 1, "element", block_bytes=BLOCK)
    if change == "drop_last":  # the block that would go unchecked is corrupt
        with open(os.path.join(path, "buffers", "0", "c.0.0"), "r+b") as f:
            f.seek(SIZE - 1)
            f.write(b"\xff")
    real = LocalStore.read_block_crcs

    def miscount(self, items, block_bytes):
        crcs = list(real(self, items, block_bytes))
        yield from (crcs[:-1] if change == "drop_last" else [*crcs, 0])

    monkeypatch.setattr(LocalStore, "read_block_crcs", miscount)
    seen = "3" if change == "drop_last" else "more than 4"
    with pytest.raises(StorageError, match=rf"LocalStore checksummed {seen} blocks of a read of buffer .* covers 4: a bug"):
        ragckpt.open(path).read_rank(0, 0, out=torch.zeros_like(x))


def test_a_bytearray_view_is_read_and_no_descriptor_leaks(obj, small_pieces):
    st, data = obj
    before = len(os.listdir("/proc/self/fd"))
    buf = bytearray(SIZE)
    assert list(st.read_block_crcs([("o", 0, [buf])], BLOCK)) == block_crcs(data, BLOCK).tolist()
    assert bytes(buf) == data and len(os.listdir("/proc/self/fd")) == before


def fs_type(path) -> str:
    """The type of the file system `path` is on, from /proc/mounts (the longest matching mount)."""
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _, mnt, typ = line.split()[:3]
            if (str(path) + "/").startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best):
                best, kind = mnt, typ
    return kind


def test_the_probe_tells_an_evicted_file_from_a_cached_one_and_leaves_it_evicted(tmp_path):
    """The probe only looks: a read-based probe (RWF_NOWAIT) brought the missing page in, and the lone
    small folios it left made every later buffered read of the file slower (docs/STORAGE.md)."""
    if fs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("a file system in memory: nothing on it is ever cold")
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        if page_cached(fd, 0) is None:
            pytest.skip("this platform cannot tell what is in the page cache")
        os.fsync(fd)  # clean pages, which the kernel may drop
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        for pos in (0, 5000, (1 << 20) - 1):
            assert not store_mod._cached(fd, pos)
        deadline = time.monotonic() + 0.3  # a read the probe started would land within milliseconds
        while time.monotonic() < deadline:
            assert page_cached(fd, 0) is False and page_cached(fd, 4096) is False
            time.sleep(0.01)
        with pytest.raises(BlockingIOError):  # and the kernel agrees: the first page is not there
            os.preadv(fd, (bytearray(4096),), 0, os.RWF_NOWAIT)
        os.pread(fd, 8192, 4096)
        assert store_mod._cached(fd, 5000) and store_mod._cached(fd, 8191)
        assert page_cached(fd, 1 << 30) is False  # past the end of the file
    finally:
        os.close(fd)


def cold_with_flip(st: LocalStore, data: bytes, flip_at: int | None, monkeypatch) -> None:
    """Object "o" with the byte at `flip_at` (if any) flipped, and every read taken as cold."""
    if flip_at is not None:
        with open(os.path.join(st.root, "o"), "r+b") as f:
            f.seek(flip_at)
            f.write(bytes([data[flip_at] ^ 1]))
    monkeypatch.setattr(store_mod, "_cached", lambda fd, pos: False)


@pytest.mark.parametrize("flip_at", [None, BLOCK + 2500, 3 * BLOCK + 7])
def test_a_cold_read_takes_whole_blocks_and_checks_each(obj, small_pieces, monkeypatch, flip_at):
    """From the disk (the probe found the first piece uncached) a view is read a block at a time;
    every block's crc is still checked and a flipped byte is named by its block."""
    st, data = obj
    cold_with_flip(st, data, flip_at, monkeypatch)
    sizes = preadv_sizes(monkeypatch)
    buf = memoryview(bytearray(SIZE))
    got = list(st.read_block_crcs([("o", 0, [buf])], BLOCK))
    want = block_crcs(data, BLOCK).tolist()
    assert sizes == [BLOCK, BLOCK, BLOCK, SIZE - 3 * BLOCK]
    if flip_at is None:
        assert got == want and bytes(buf) == data
    else:
        bad = flip_at // BLOCK
        assert [i for i in range(len(want)) if got[i] != want[i]] == [bad]


# -- cold views read with O_DIRECT ------------------------------------------------------------------------

MiB = 1 << 20


def direct_spy(monkeypatch) -> list[tuple[int, bool]]:
    """(size, whether the descriptor was in O_DIRECT mode) of every read that lands data."""
    import fcntl

    calls: list[tuple[int, bool]] = []
    real = os.preadv

    def spy(fd, bufs, offset, *flags):
        mode = fcntl.fcntl(fd, fcntl.F_GETFL)
        calls.append((sum(len(memoryview(b)) for b in bufs), bool(mode & os.O_DIRECT)))
        return real(fd, bufs, offset, *flags)

    monkeypatch.setattr(os, "preadv", spy)
    return calls


@pytest.fixture()
def big(tmp_path, monkeypatch) -> tuple[LocalStore, bytes]:
    """An object of 2.5 MiB + 1234 bytes: whole 8 KiB blocks, then a short one ending off a page."""
    data = np.random.default_rng(11).integers(0, 256, 5 * MiB // 2 + 1234, dtype=np.uint8).tobytes()
    st = LocalStore(str(tmp_path / "s"))
    st.write("o", [data])
    return st, data


def out_buffer(n: int, aligned: bool) -> memoryview:
    """`n` writable bytes starting on a page boundary, or 64 bytes past one (where torch puts tensors)."""
    t = ragckpt.aligned_empty(n + 64, torch.uint8)
    mv = memoryview(t.numpy())
    return mv[:n] if aligned else mv[64 : 64 + n]


@pytest.mark.parametrize("aligned", [True, False])
def test_a_cold_view_is_read_with_o_direct_exactly(big, monkeypatch, aligned):
    """Cold (the probe missed), a view of MIN_READ_BYTES or more is read with O_DIRECT in requests of up to
    8 MiB (here 1 MiB, so blocks of 8 KiB and requests cut through each other's crcs), straight into
    page-aligned memory or through the bounce buffer; the last partial page is read buffered. Every
    block's crc and every byte are the file's."""
    from ragckpt.storage import direct

    st, data = big
    monkeypatch.setattr(store_mod, "_cached", lambda fd, pos: False)
    monkeypatch.setattr(direct, "BOUNCE_BYTES", MiB)
    monkeypatch.setattr(direct, "_local", __import__("threading").local())  # a bounce of the new size
    calls = direct_spy(monkeypatch)
    buf = out_buffer(len(data), aligned)
    got = list(st.read_block_crcs([("o", 0, [buf])], 8192 + 4096))
    assert got == block_crcs(data, 8192 + 4096).tolist()
    assert bytes(buf) == data
    assert calls == [(MiB, True), (MiB, True), (MiB // 2, True), (1234, False)]
    assert st.direct_io


def scattered_views(n: int, cuts: list[int]) -> tuple[list[memoryview], bytearray]:
    """Views of `n` bytes in all, cut at `cuts`, each placed 100 bytes past the previous one's end in
    one buffer (off page boundaries, with gaps between): a reshard's runs, scattered into place."""
    bounds = [0, *cuts, n]
    room = bytearray(n + 100 * len(bounds))
    mv = memoryview(room)
    return [mv[a + 100 * (i + 1) : b + 100 * (i + 1)] for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))], room


# views of 5 bytes, 3 pages + 1, up to a bounce buffer's end, one across the next bounce, and the rest
CUTS = [5, 5 + 3 * 4096 + 1, MiB, MiB + MiB // 2 + 3]


@pytest.mark.parametrize("flip_at", [None, MiB + 8192 * 3 + 5])
def test_a_cold_range_into_several_views_is_read_with_o_direct_exactly(big, monkeypatch, flip_at):
    """A load-time reshard's range scattered into several views: cold, it is read with O_DIRECT into
    the bounce buffer (here 1 MiB, so views cross requests) and copied from there into each view; the
    last partial page is read buffered. Every block's crc and every byte are the file's, and a flipped
    byte is named by its block."""
    from ragckpt.storage import direct

    st, data = big
    cold_with_flip(st, data, flip_at, monkeypatch)
    monkeypatch.setattr(direct, "BOUNCE_BYTES", MiB)
    monkeypatch.setattr(direct, "_local", __import__("threading").local())  # a bounce of the new size
    calls = direct_spy(monkeypatch)
    views, _ = scattered_views(len(data), CUTS)
    got = list(st.read_block_crcs([("o", 0, views)], 8192))
    want = block_crcs(data, 8192).tolist()
    assert calls == [(MiB, True), (MiB, True), (MiB // 2, True), (1234, False)]
    if flip_at is None:
        assert got == want
        assert b"".join(bytes(v) for v in views) == data
    else:
        assert [i for i in range(len(want)) if got[i] != want[i]] == [flip_at // 8192]


def test_a_cold_view_from_an_evicted_file_is_read_directly(tmp_path, monkeypatch):
    """No stand-in for the probe: a restore of a file evicted from the page cache."""
    if fs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("a file system in memory: nothing on it is ever cold")
    x = torch.from_numpy(np.random.default_rng(3).integers(0, 256, 3 * MiB + 100, dtype=np.uint8))
    path = str(tmp_path / "ck")
    ragckpt.write_global({"x": x}, path, 1, "element")
    obj_path = os.path.join(path, "buffers", "0", "c.0.0")
    fd = os.open(obj_path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    calls = direct_spy(monkeypatch)
    out = torch.from_numpy(np.frombuffer(out_buffer(x.numel(), True), dtype=np.uint8))
    ragckpt.open(path).read_rank(0, 0, out=out)
    assert torch.equal(out, x)
    assert calls[0] == (3 * MiB, True) and calls[-1] == (100, False)


def test_a_flipped_byte_in_a_direct_read_is_named_by_its_block(tmp_path, monkeypatch):
    x = torch.from_numpy(np.random.default_rng(5).integers(0, 256, 2 * MiB + 999, dtype=np.uint8))
    path = str(tmp_path / "ck")
    ragckpt.write_global({"x": x}, path, 1, "element", block_bytes=256 << 10)
    with open(os.path.join(path, "buffers", "0", "c.0.0"), "r+b") as f:
        f.seek(5 * (256 << 10) + 77)
        f.write(bytes([int(x[5 * (256 << 10) + 77]) ^ 0x10]))
    monkeypatch.setattr(store_mod, "_cached", lambda fd, pos: False)
    calls = direct_spy(monkeypatch)
    with pytest.raises(IntegrityError, match=r"checksum mismatch in .*rank 0, block 5\)"):
        ragckpt.open(path).read_rank(0, 0, out=torch.zeros_like(x))
    assert calls[0] == (2 * MiB, True)


@pytest.mark.parametrize("several", [False, True], ids=["one view", "several views"])
def test_a_truncated_object_read_directly_is_named(big, monkeypatch, several):
    st, data = big
    os.truncate(os.path.join(st.root, "o"), MiB + 5000)
    monkeypatch.setattr(store_mod, "_cached", lambda fd, pos: False)
    views = scattered_views(len(data), CUTS)[0] if several else [out_buffer(len(data), True)]
    with pytest.raises(BadObjectError, match=rf"o is truncated: wanted bytes \[0, {len(data)}\), file ends at {MiB + 5000}"):
        list(st.read_block_crcs([("o", 0, views)], MiB))
    assert store_mod._readers == 0


@pytest.mark.parametrize("several", [False, True], ids=["one view", "several views"])
@pytest.mark.parametrize("refused_at", ["open", "first read"])
def test_a_file_system_that_refuses_o_direct_is_read_buffered(big, monkeypatch, refused_at, several):
    """EINVAL when O_DIRECT is turned on, or on the first direct read (some FUSE mounts): the view is
    read a block at a time, buffered, and the store stops trying (writes included)."""
    from ragckpt.storage import direct

    st, data = big
    monkeypatch.setattr(store_mod, "_cached", lambda fd, pos: False)
    calls = direct_spy(monkeypatch)
    if refused_at == "open":
        def refuse(fd, on):
            raise direct.DirectUnsupported("Invalid argument")
        monkeypatch.setattr(direct, "set_direct", refuse)
    else:
        real = direct.read_direct

        def refuse_first(fd, pos, out, *, first):
            if first:
                raise direct.DirectUnsupported("Invalid argument")
            return real(fd, pos, out, first=first)
        monkeypatch.setattr(direct, "read_direct", refuse_first)
    views = scattered_views(len(data), CUTS)[0] if several else [out_buffer(len(data), True)]
    assert list(st.read_block_crcs([("o", 0, views)], MiB)) == block_crcs(data, MiB).tolist()
    assert b"".join(bytes(v) for v in views) == data and not st.direct_io
    if several:  # buffered, a checksum piece at a time (scattered by the kernel)
        assert calls and not any(d for _, d in calls)
    else:
        assert calls == [(MiB, False), (MiB, False), (len(data) - 2 * MiB, False)]


def test_warm_small_and_unaligned_views_stay_buffered(big, monkeypatch):
    """Direct reads only where they pay: not from the page cache, not for views under MIN_READ_BYTES, and
    not for views starting off a page of the file (O_DIRECT needs aligned offsets)."""
    st, data = big
    with open(os.path.join(st.root, "o"), "rb") as f:  # into the page cache (it was written with O_DIRECT)
        f.read()
    calls = direct_spy(monkeypatch)
    for start, n, cold in ((0, len(data), False), (0, MiB - 1, True), (100, 2 * MiB, True)):
        if cold:
            monkeypatch.setattr(store_mod, "_cached", lambda fd, pos: False)
        buf = memoryview(bytearray(n))
        assert list(st.read_block_crcs([("o", start, [buf])], MiB)) == block_crcs(data[start : start + n], MiB).tolist()
        assert bytes(buf) == data[start : start + n]
    assert calls and not any(d for _, d in calls)


def test_a_view_of_one_piece_is_read_without_a_probe(big, monkeypatch):
    """Cold or warm, a view no larger than a piece is one read: the resharder restores thousands of
    small rank objects, and a probe for each would be a wasted system call. Larger views are probed."""
    st, data = big
    probes: list[int] = []

    def spy(fd, pos):
        probes.append(pos)
        return page_cached(fd, pos)

    monkeypatch.setattr(store_mod, "page_cached", spy)
    for start, n in ((0, 256 << 10), (4096, 1000), (0, (256 << 10) + 1)):
        buf = memoryview(bytearray(n))
        assert list(st.read_block_crcs([("o", start, [buf])], MiB)) == block_crcs(data[start : start + n], MiB).tolist()
        assert bytes(buf) == data[start : start + n]
    assert probes == [0]


def test_cold_ranges_under_1_mib_are_read_buffered_by_default(big, monkeypatch):
    """Below a checksum block a direct read has nothing in flight before it starts, where a buffered
    one often finds its bytes read ahead with the previous range of the file (a reshard of 8192
    ranks reads thousands of objects of about 128 KiB); from 1 MiB on, cold ranges go direct."""
    from ragckpt.storage import direct

    assert direct.MIN_READ_BYTES == MiB
    st, data = big
    monkeypatch.setattr(store_mod, "_cached", lambda fd, pos: False)
    calls = direct_spy(monkeypatch)
    for views in ([out_buffer(MiB - 4096, True)], scattered_views(MiB - 4096, [4096, 300000])[0]):
        assert list(st.read_block_crcs([("o", 0, views)], MiB)) == block_crcs(data[: MiB - 4096], MiB).tolist()
        assert b"".join(bytes(v) for v in views) == data[: MiB - 4096]
    assert calls and not any(d for _, d in calls)
    calls.clear()
    buf = out_buffer(MiB, True)
    assert list(st.read_block_crcs([("o", 0, [buf])], MiB)) == block_crcs(data[:MiB], MiB).tolist()
    assert calls == [(MiB, True)]


def test_where_the_cache_cannot_be_asked_ranges_are_read_buffered(big, monkeypatch):
    """No mincore, or a file that cannot be mapped: the range is taken as cached and read through
    the page cache, as before direct reads existed, never direct on a guess."""
    st, data = big
    monkeypatch.setattr(store_mod, "page_cached", lambda fd, pos: None)
    with open(os.path.join(st.root, "o"), "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    calls = direct_spy(monkeypatch)
    buf = out_buffer(2 * MiB, True)
    assert list(st.read_block_crcs([("o", 0, [buf])], MiB)) == block_crcs(data[: 2 * MiB], MiB).tolist()
    assert bytes(buf) == data[: 2 * MiB]
    assert calls and not any(d for _, d in calls)
    monkeypatch.setattr(store_mod, "page_cached", lambda fd, pos: False)  # and the same read, cold, goes direct
    calls.clear()
    assert list(st.read_block_crcs([("o", 0, [buf])], MiB)) == block_crcs(data[: 2 * MiB], MiB).tolist()
    assert calls and all(d for _, d in calls)
