"""Reads scattered straight into destination memory (`Checkpoint.read_scatter`, local files'
`preadv`), used by `Gatherer.fill` for merged ranges of long runs: a tensor's piece from each source
rank lands interleaved with other tensors' pieces, which used to go through a staging buffer and a
scatter copy.

References are built without the code under test: `torch.chunk` of the original tensors, the
checkpoint's own staged range reads, and byte slices of the original data.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import ragckpt
from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.errors import IntegrityError, OutOfRangeError
from ragckpt.reshard import gather
from ragckpt.reshard.plan import target_layout
from ragckpt.storage.store import LocalStore, Store, split_views
from tests.helpers import assert_bit_equal, cut, special_tensor

DTYPES = [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.int64, torch.bool]


class ScatterSpy:
    """Every `read_scatter` call `(rank, start, views' total bytes, number of views)`, and every
    `read_rank_ranges` request."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.scatter: list[tuple[int, int, int, int]] = []
        self.ranges: list[tuple[int, int, int]] = []
        real_scatter, real_ranges = Checkpoint.read_scatter, Checkpoint.read_rank_ranges

        def scatter(ck, bi, rank, a, views):
            self.scatter.append((int(rank), int(a), sum(len(v) for v in views), len(views)))
            return real_scatter(ck, bi, rank, a, views)

        def ranges(ck, buffer, reqs):
            self.ranges.extend(tuple(int(x) for x in q) for q in reqs)
            return real_ranges(ck, buffer, reqs)

        monkeypatch.setattr(Checkpoint, "read_scatter", scatter)
        monkeypatch.setattr(Checkpoint, "read_rank_ranges", ranges)


def row_state(dtype: torch.dtype, rows: int = 128, cols: int = 1024, n: int = 5) -> dict[str, torch.Tensor]:
    return {f"layer{i}.w": special_tensor((rows + i, cols), dtype, seed=i) for i in range(n)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [4096, 5000, 1 << 20])
def test_row_4_to_2_load_lands_every_run_in_place(tmp_path, monkeypatch, dtype, block):
    """Pieces of 32+ rows (>= 128 KiB at 4 bytes) from each of 4 source ranks, interleaved with the
    other tensors' pieces in the target: read with `read_scatter` only, bit-exact, and with blocks
    that do not divide rows (5000 bytes) or hold several runs (1 MiB), so views are cut mid-block
    and the bytes between runs are read into scratch and checksummed too."""
    if dtype.itemsize < 4:
        monkeypatch.setattr(gather, "_SCATTER_MIN_RUN_BYTES", 16 << 10)
    state = row_state(dtype)
    src = str(tmp_path / "src")
    ragckpt.write_global(state, src, 4, "row", block_bytes=block)
    ck = ragckpt.open(src)
    target = target_layout(ck.layout, 2, "row")
    spy = ScatterSpy(monkeypatch)
    for r in range(2):
        into = {b.name: torch.ones(int(target.rank_sizes(i)[r]), dtype=dtype) for i, b in enumerate(target.buffers)}
        got = ragckpt.load(ck, target, r, into=into)[target.buffers[0].name]
        want = torch.cat([v.chunk(2)[r].reshape(-1) for v in state.values()])
        assert_bit_equal(got, want, f"rank {r}")
    # nearly every byte went to its place directly; what was staged is the few short runs where a
    # target rank's boundary cuts a source rank's piece of a tensor
    scattered, staged = sum(n for _, _, n, _ in spy.scatter), sum(b - a for _, a, b in spy.ranges)
    assert scattered > 0.9 * (scattered + staged), (spy.scatter, spy.ranges)
    assert any(n > 1 for *_, n in spy.scatter)  # several runs (or a run and a gap) in one read


def test_offline_reshard_writes_what_the_staged_path_writes(tmp_path, monkeypatch):
    """The same offline reshard with scattered reads and with every run staged (the scatter path
    switched off) writes byte-identical rank buffers, equal to `torch.chunk` of the originals."""
    state = row_state(torch.float32)
    src = str(tmp_path / "src")
    ragckpt.write_global(state, src, 4, "row", block_bytes=8192)
    spy = ScatterSpy(monkeypatch)
    ragckpt.reshard.reshard(src, str(tmp_path / "scattered"), 3, layout="row", threads=2)
    assert spy.scatter
    monkeypatch.setattr(gather, "_SCATTER_MIN_RUN_BYTES", 1 << 62)
    spy.scatter.clear()
    ragckpt.reshard.reshard(src, str(tmp_path / "staged"), 3, layout="row", threads=2)
    assert not spy.scatter
    a, b = ragckpt.open(str(tmp_path / "scattered")), ragckpt.open(str(tmp_path / "staged"))
    for r in range(3):
        assert_bit_equal(a.read_rank(0, r), b.read_rank(0, r), f"rank {r}")
    for name, v in state.items():
        assert_bit_equal(a.read(name), v, name)
    assert a.verify().ok


@pytest.fixture()
def one_rank(tmp_path) -> tuple[Checkpoint, bytes]:
    """One rank of 10 KiB + 17 bytes of uint8 in 4 KiB blocks and 8 KiB objects (two objects and a
    short last block), and its bytes."""
    data = torch.from_numpy(np.random.default_rng(3).integers(0, 256, 10 * 1024 + 17, dtype=np.uint8))
    path = str(tmp_path / "ck")
    ragckpt.write_global({"x": data}, path, 1, "element", block_bytes=4096, max_chunk_bytes=8192)
    return ragckpt.open(path), data.numpy().tobytes()


@pytest.mark.parametrize("a, sizes", [(0, [10 * 1024 + 17]), (0, [1, 4095, 4096, 3, 2000, 62]),
                                      (4096, [4196, 1965]), (8192, [2065])])
def test_read_scatter_fills_views_across_blocks_and_objects(one_rank, a, sizes):
    ck, data = one_rank
    views = cut(sum(sizes), sizes)
    ck.read_scatter(0, 0, a, views)
    assert b"".join(bytes(v) for v in views) == data[a : a + sum(sizes)]


def test_read_scatter_refuses_ranges_that_are_not_whole_blocks(one_rank):
    ck, _ = one_rank
    with pytest.raises(ValueError, match="not whole blocks"):
        ck.read_scatter(0, 0, 100, cut(3996, [3996]))
    with pytest.raises(ValueError, match="not whole blocks"):
        ck.read_scatter(0, 0, 0, cut(4000, [4000]))
    with pytest.raises(OutOfRangeError, match="runs past its 10257 bytes"):  # whole blocks, past the end
        ck.read_scatter(0, 0, 8192, cut(4096, [4096]))


@pytest.mark.parametrize("obj, at, block", [("c.0.1", 5, 2), ("c.0.0", 4096 + 4000, 1), ("c.0.0", 4096 + 5, 1)])
def test_read_scatter_names_the_corrupt_block_and_object(one_rank, obj, at, block):
    """A flipped byte in a block read whole into one view, and on either side of a view edge inside
    a block (block 1 is split at byte 5000 across two views)."""
    ck, _ = one_rank
    path = os.path.join(ck.url, "buffers", "0", obj)  # c.0.0: blocks 0 and 1; c.0.1: block 2 (and padding)
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(IntegrityError, match=rf"checksum mismatch in .*{obj.replace('.', '[.]')} .*rank 0, block {block}"):
        ck.read_scatter(0, 0, 0, cut(10 * 1024 + 17, [5000, 10 * 1024 + 17 - 5000]))


def test_read_scatter_names_a_truncated_object(one_rank):
    ck, _ = one_rank
    path = os.path.join(ck.url, "buffers", "0", "c.0.1")
    os.truncate(path, 100)
    with pytest.raises(IntegrityError, match=r"c\.0\.1 is truncated"):
        ck.read_scatter(0, 0, 8192, cut(2048 + 17, [2048 + 17]))


def test_short_preadv_reads_resume_mid_view(one_rank, monkeypatch):
    """A `preadv` may return fewer bytes than asked (signals, some file systems): the rest must
    follow at the right place, mid-view included."""
    ck, data = one_rank
    real = os.preadv
    calls = []

    def short(fd, bufs, offset, *flags):
        calls.append(len(bufs))
        first = memoryview(bufs[0]).cast("B")
        return real(fd, [first[: max(1, min(len(first), 777))]], offset, *flags)

    monkeypatch.setattr(os, "preadv", short)
    sizes = [3000, 1, 5000, 10 * 1024 + 17 - 8001]
    views = cut(sum(sizes), sizes)
    ck.read_scatter(0, 0, 0, views)
    assert b"".join(bytes(v) for v in views) == data
    assert len(calls) > 10


def test_the_fetch_and_copy_fallback_matches_preadv(one_rank):
    """Object stores fill the views from an ordinary range read (`Store.read_range_scatter`)."""
    ck, data = one_rank
    key = "buffers/0/c.0.0"
    for impl in (Store.read_range_scatter, LocalStore.read_range_scatter):
        views = cut(8000, [10, 4086, 3904])
        pieces = list(impl(ck.store, key, 100, views, 4096))
        assert [sum(len(v) for v in p) for p in pieces] == [4096, 3904]
        assert b"".join(bytes(v) for v in views) == data[100:8100]


def test_split_views_cuts_at_piece_edges():
    views = cut(10, [3, 0, 4, 3])
    parts = list(split_views(views, 4))
    assert [[len(v) for v in p] for p in parts] == [[3, 1], [3, 1], [2]]
    assert list(split_views([], 4)) == []


def test_more_views_than_one_preadv_takes(one_rank):
    """A checksum block cut into 4,096 one-byte views: more than IOV_MAX (1,024) buffers, so the
    read goes in several `preadv` calls."""
    ck, data = one_rank
    sizes = [1] * 4096 + [10 * 1024 + 17 - 4096]
    views = cut(sum(sizes), sizes)
    ck.read_scatter(0, 0, 0, views)
    assert b"".join(bytes(v) for v in views) == data


def test_scattered_and_staged_ranges_mixed_in_one_fill(tmp_path):
    """A long tensor between 20 small ones on each side: its ranges are scattered, the small ones'
    (16 or more groups, one concatenated staging copy) are not. The staged path once kept the
    scattered groups' runs in its spans and failed ("operands could not be broadcast")."""
    g = torch.Generator().manual_seed(4)
    state = {f"b{i}": torch.randn(1000, generator=g) for i in range(20)}
    state["w"] = torch.randn(300, 1024, generator=g)
    state.update({f"c{i}": torch.randn(1000, generator=g) for i in range(20)})
    src = str(tmp_path / "src")
    ragckpt.write_global(state, src, 1, "row", block_bytes=4096)
    ck = ragckpt.open(src)
    target = target_layout(ck.layout, 4, "row")
    for r in range(4):
        got = ragckpt.load(ck, target, r)["float32"]
        assert_bit_equal(got, torch.cat([v.chunk(4)[r].reshape(-1) for v in state.values()]), f"rank {r}")
    ragckpt.reshard.reshard(src, str(tmp_path / "dst"), 4, layout="row")
    out = ragckpt.open(str(tmp_path / "dst"))
    for name, v in state.items():
        assert_bit_equal(out.read(name), v, name)


def test_runs_reading_one_source_range_twice_are_not_scattered(tmp_path, monkeypatch):
    """Two destination runs from the same source bytes (a plan may copy one source twice): views
    could not tile such a range, so it is staged, and both copies land."""
    from ragckpt.format.intervals import CopyPlan

    monkeypatch.setattr(gather, "_SCATTER_MIN_RUN_BYTES", 0)
    x = special_tensor((64 << 10,), torch.float32, seed=9)
    ragckpt.write_global({"x": x}, str(tmp_path / "src"), 1, "element", block_bytes=4096)
    ck = ragckpt.open(str(tmp_path / "src"))
    n = 20_000
    plan = CopyPlan(np.array([0, 0]), np.array([100, 100]), np.array([0, 0]), np.array([0, n]), np.array([n, n]))
    out = np.zeros(2 * n, dtype=np.uint32)
    gather.Gatherer(ck, 0, budget_bytes=1 << 20).fill(out, 0, plan)
    want = x[100 : 100 + n].view(torch.int32).numpy().view(np.uint32)
    assert np.array_equal(out[:n], want) and np.array_equal(out[n:], want)


def test_large_read_flat_reads_in_place_and_scatters_its_partial_blocks(tmp_path, monkeypatch):
    """A 12 MiB window starting and ending mid-block of a tensor spread over 3 ranks: whole blocks go
    straight into place, the partial ones through `read_scatter`; nothing is staged."""
    x = special_tensor((3 << 20,), torch.float32, seed=2)
    ragckpt.write_global({"x": x}, str(tmp_path / "src"), 3, "element", block_bytes=1 << 20)
    ck = ragckpt.open(str(tmp_path / "src"))
    spy = ScatterSpy(monkeypatch)
    a, b = 1234, (3 << 20) - 4321
    got = ck.read_flat("x", a, b, out=torch.empty(b - a, dtype=torch.float32))
    assert_bit_equal(got, x[a:b], "window")
    assert spy.scatter and not spy.ranges


def test_read_flat_into_a_strided_out_is_staged_and_copied(one_rank, monkeypatch):
    """An `out` that cannot take a `preadv` (strided here; a GPU buffer in training) is read through
    staged ranges and copied over, element for element."""
    ck, data = one_rank
    spy = ScatterSpy(monkeypatch)
    base = torch.zeros(200, dtype=torch.uint8)
    out = base[::2]
    assert ck.read_flat("x", 10, 110, out=out) is out
    assert out.numpy().tobytes() == data[10:110]
    assert not base[1::2].any(), "the gaps of a strided out were written"
    assert spy.ranges and not spy.scatter
