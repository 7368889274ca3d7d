"""Blocks verified from pieces (`checkpoint.partial.PartialBlocks`, `Checkpoint.read_pieces`): reads
of exactly the bytes a fill needs, each block checked once its pieces cover it.

References: crc32c of the joined bytes (awscrt itself), the saved tensors' bytes, and byte counts a
reshard cannot go below (each source byte read once).
"""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest
import torch

import ragckpt
from ragckpt.checkpoint import manifest as mf
from ragckpt.checkpoint.partial import PartialBlocks
from ragckpt.errors import IntegrityError
from ragckpt.reshard import gather
from ragckpt.reshard.offline import reshard
from ragckpt.storage.checksum import crc32c, crc32c_combine
from tests.helpers import assert_bit_equal

KiB = 1 << 10
MiB = 1 << 20
BLOCK = 64 * KiB


def test_combined_crcs_equal_the_crc_of_the_joined_bytes():
    rng = random.Random(3)
    for n_a, n_b in [(0, 0), (0, 5), (7, 0), (1, 1), (4096, 1), (BLOCK - 3, 3), (100_000, 1 << 20)]:
        a, b = rng.randbytes(n_a), rng.randbytes(n_b)
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b), (n_a, n_b)
    for _ in range(50):
        a, b = rng.randbytes(rng.randrange(3 * BLOCK)), rng.randbytes(rng.randrange(3 * BLOCK))
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


@pytest.fixture
def saved(tmp_path):
    """A 3-rank row checkpoint of 64 KiB blocks (rank buffers of about five blocks, the last one
    short), and each rank's buffer bytes as saved."""
    g = torch.Generator().manual_seed(5)
    state = {"a": torch.randn(900, 257, generator=g), "b": torch.randn(77, 1000, generator=g).to(torch.bfloat16)}
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, 3, "row", block_bytes=BLOCK)
    ck = ragckpt.open(url)
    want = [ck.read_rank(0, r).view(torch.uint8).numpy().copy() for r in range(3)]
    return ck, want


def _read(ck, partial, rank: int, a: int, b: int, out: np.ndarray) -> None:
    ck.read_pieces(0, [(rank, a, [memoryview(out[a:b])])], partial)


def test_pieces_in_any_order_and_from_any_thread_read_the_bytes_and_verify_every_block(saved):
    ck, want = saved
    partial = PartialBlocks(ck)
    rng = random.Random(11)
    jobs = []
    for r, w in enumerate(want):  # every rank buffer cut at random points, most of them mid-block
        cuts = sorted({0, len(w), *(rng.randrange(len(w)) for _ in range(40))})
        jobs += [(r, a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
    rng.shuffle(jobs)
    got = [np.zeros_like(w) for w in want]

    def run(part):
        for r, a, b in part:
            _read(ck, partial, r, a, b, got[r])

    threads = [threading.Thread(target=run, args=(jobs[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(3):
        assert np.array_equal(got[r], want[r]), r
    assert len(partial) == 0  # every block was covered, so every block was checked
    assert partial.complete() == 0


def test_complete_reads_what_no_piece_covered_and_verifies_it(saved):
    ck, want = saved
    partial = PartialBlocks(ck)
    out = np.zeros_like(want[1])
    _read(ck, partial, 1, 100, 1000, out)  # inside block 0
    _read(ck, partial, 1, BLOCK - 10, BLOCK + 20, out)  # the end of block 0, the start of block 1
    assert len(partial) == 2
    assert sorted(partial.gaps()) == [(0, 1, 0, 100), (0, 1, 1000, BLOCK - 10), (0, 1, BLOCK + 20, 2 * BLOCK)]
    assert partial.complete() == 100 + (BLOCK - 10 - 1000) + (BLOCK - 20)
    last = len(want[1]) // BLOCK  # the buffer's last block is short: its gap ends where the buffer does
    assert len(want[1]) % BLOCK
    _read(ck, partial, 1, last * BLOCK + 3, last * BLOCK + 9, out)
    assert partial.gaps() == [(0, 1, last * BLOCK, last * BLOCK + 3), (0, 1, last * BLOCK + 9, len(want[1]))]
    assert partial.complete() == len(want[1]) - last * BLOCK - 6
    assert len(partial) == 0
    assert np.array_equal(out[100:1000], want[1][100:1000])


def _corrupt(ck, rank: int, pos: int) -> None:
    """Flip one byte at offset `pos` of rank `rank`'s buffer 0 on disk."""
    ch = ck._chunking(0)
    path = os.path.join(ck.url, mf.chunk_key(0, rank, pos // ch.chunk_bytes))
    with open(path, "r+b") as f:
        f.seek(pos % ch.chunk_bytes)
        byte = f.read(1)
        f.seek(pos % ch.chunk_bytes)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_corrupt_block_read_in_pieces_is_named_when_its_last_piece_lands(saved):
    ck, _ = saved
    _corrupt(ck, 2, BLOCK + 500)
    partial = PartialBlocks(ck)
    out = np.zeros(3 * BLOCK, dtype=np.uint8)
    _read(ck, partial, 2, BLOCK, BLOCK + 400, out)
    _read(ck, partial, 2, BLOCK + 900, 2 * BLOCK, out)  # the corrupt byte is in neither: nothing known yet
    with pytest.raises(IntegrityError, match=r"checksum mismatch in .*buffer '.*', rank 2, block 1\)"):
        _read(ck, partial, 2, BLOCK + 400, BLOCK + 900, out)


def test_a_corrupt_block_no_fill_finished_fails_complete(saved):
    ck, _ = saved
    _corrupt(ck, 0, 7)  # block 0, in bytes no piece reads
    partial = PartialBlocks(ck)
    out = np.zeros(BLOCK, dtype=np.uint8)
    _read(ck, partial, 0, 100, 200, out)
    with pytest.raises(IntegrityError, match=r"rank 0, block 0\)"):
        partial.complete()


def test_whole_blocks_in_a_piece_read_are_checked_as_they_land(saved):
    ck, _ = saved
    _corrupt(ck, 1, 2 * BLOCK + 5)
    partial = PartialBlocks(ck)
    out = np.zeros(4 * BLOCK, dtype=np.uint8)
    with pytest.raises(IntegrityError, match=r"rank 1, block 2\)"):
        _read(ck, partial, 1, 10, 3 * BLOCK + 10, out)  # block 2 lies whole inside the range


def test_a_byte_read_twice_is_refused_rather_than_combined(saved):
    ck, _ = saved
    partial = PartialBlocks(ck)
    out = np.zeros(BLOCK, dtype=np.uint8)
    _read(ck, partial, 0, 100, 200, out)
    with pytest.raises(RuntimeError, match="read twice"):
        _read(ck, partial, 0, 150, 300, out)


def test_a_truncated_object_is_named_by_an_exact_read(saved):
    ck, want = saved
    path = os.path.join(ck.url, mf.chunk_key(0, 0, 0))
    os.truncate(path, 1000)
    out = np.zeros_like(want[0])
    with pytest.raises(IntegrityError, match="truncated"):
        _read(ck, PartialBlocks(ck), 0, 500, 3000, out)


def _many_small_ranks(tmp_path, world: int, layout: str = "row", block_bytes: int = MiB) -> tuple[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(21)
    state = {f"w{i}": torch.randn(513, 700 + 31 * i, generator=g) for i in range(6)}
    state["h"] = torch.randn(1001, 97, generator=g).to(torch.bfloat16)
    src = str(tmp_path / f"src{world}")
    ragckpt.write_global(state, src, world, layout, block_bytes=block_bytes)
    return src, state


@pytest.mark.parametrize("to, kind, whole", [(4, "ragged", 3.0), (50, "row", 1.1), (3, "element", 2.5)])
def test_many_small_ranks_into_few_read_each_source_byte_once(tmp_path, monkeypatch, to, kind, whole):
    """Guards the read amplification of many-to-few reshards: 256 row ranks of 40 KiB (one block
    each) hold a slice of every tensor, so each destination chunk needs a piece of every source
    block. Read whole for each chunk that needs a piece, 256 -> 4 ragged fetched 3.9x the data,
    -> 50 row 1.18x and -> 3 element 2.96x (`whole`: checked below, with exact reads off); read
    exactly, each source byte is read once."""
    src, state = _many_small_ranks(tmp_path, 256)
    stats = reshard(src, str(tmp_path / "out"), to, layout=kind, window=64 * MiB)
    assert stats.bytes_read <= 1.01 * stats.data_bytes, stats.bytes_read / stats.data_bytes
    out = ragckpt.open(str(tmp_path / "out"))
    for name, t in state.items():
        assert_bit_equal(out.read(name), t, name)
    monkeypatch.setattr(gather, "EXACT_READS", False)  # the same job reading whole blocks
    again = reshard(src, str(tmp_path / "whole"), to, layout=kind, window=64 * MiB)
    assert again.bytes_read > whole * again.data_bytes, again.bytes_read / again.data_bytes


def test_slices_of_rank_buffers_of_several_blocks_are_read_exactly_too(tmp_path, monkeypatch):
    """Guards reading whole blocks where a chunk needs a slice of several: 64 row ranks of 2.6
    blocks each into 3 ragged ranks with 1.6 MiB chunks, every chunk taking about 25 KiB of each
    source rank, read 1.8x the data whole (the blocks kept between chunks cannot hold one per
    source rank); exactly, 1.00x. (1 GiB on 256 ranks of 4 MiB into 8 ragged: 7.3x, 2.3 s -> 1.0x, 1.0 s.)"""
    src, state = _many_small_ranks(tmp_path, 64, block_bytes=64 * KiB)
    stats = reshard(src, str(tmp_path / "out"), 3, layout="ragged", window=8 * MiB)
    assert stats.bytes_read <= 1.01 * stats.data_bytes, stats.bytes_read / stats.data_bytes
    out = ragckpt.open(str(tmp_path / "out"))
    for name, t in state.items():
        assert_bit_equal(out.read(name), t, name)
    monkeypatch.setattr(gather, "EXACT_READS", False)
    again = reshard(src, str(tmp_path / "whole"), 3, layout="ragged", window=8 * MiB)
    assert again.bytes_read > 1.5 * again.data_bytes, again.bytes_read / again.data_bytes


def test_worker_processes_each_verify_the_blocks_they_read_in_part(tmp_path):
    """Two worker processes split the destination ranks; a source block whose pieces went to both is
    completed by each (reading the other's part), so every block is checked and the output exact."""
    src, state = _many_small_ranks(tmp_path, 64)
    stats = reshard(src, str(tmp_path / "out"), 6, layout="ragged", workers=2, window=64 * MiB)
    assert stats.processes == 2
    assert stats.data_bytes <= stats.bytes_read <= 2.05 * stats.data_bytes
    out = ragckpt.open(str(tmp_path / "out"))
    for name, t in state.items():
        assert_bit_equal(out.read(name), t, name)


def test_a_corrupt_source_read_in_pieces_fails_the_reshard_and_commits_nothing(tmp_path):
    src, _ = _many_small_ranks(tmp_path, 256)
    ck = ragckpt.open(src)
    _corrupt(ck, 77, int(ck.layout.rank_sizes(0)[77]) * 2 // 3)  # mid-buffer: a piece of the one block
    dst = str(tmp_path / "out")
    with pytest.raises(IntegrityError, match=r"rank 77, block 0\)"):
        reshard(src, dst, 4, layout="ragged", window=64 * MiB)
    assert ragckpt.open(dst, allow_uncommitted=True).committed is False


@pytest.mark.slow
def test_an_object_store_source_reads_single_stretches_exactly(s3, tmp_path):
    """From S3 a short range is read exactly only where it is one stretch (a GET each): ragged
    64 -> 3 ranks, where each chunk takes one slice of every source block, reads each byte once."""
    g = torch.Generator().manual_seed(8)
    state = {f"w{i}": torch.randn(300, 301 + i, generator=g) for i in range(5)}
    src, dst = f"{s3.url}/src", f"{s3.url}/dst"
    ragckpt.write_global(state, src, 64, "row", storage_options=s3.storage_options)
    stats = reshard(src, dst, 3, layout="ragged", window=32 * MiB, storage_options=s3.storage_options)
    assert stats.bytes_read <= 1.01 * stats.data_bytes, stats.bytes_read / stats.data_bytes
    out = ragckpt.open(dst, storage_options=s3.storage_options)
    for name, t in state.items():
        assert_bit_equal(out.read(name), t, name)


def test_a_store_that_yields_too_few_crcs_is_named(saved, monkeypatch):
    ck, want = saved
    real = ck.store.read_block_crcs

    def one_short(items, block_bytes):
        yield from list(real(items, block_bytes))[:-1]

    monkeypatch.setattr(ck.store, "read_block_crcs", one_short)
    out = np.zeros_like(want[0])
    with pytest.raises(ragckpt.errors.StorageError, match=r"checksummed 2 blocks .* covers 3: a bug in that store"):
        _read(ck, PartialBlocks(ck), 0, 100, 2 * BLOCK + 5, out)  # a piece, a whole block, a piece


def _spy_bytes_read(monkeypatch) -> list[int]:
    """Bytes the local store reads, whichever read path asks."""
    from ragckpt.storage.store import LocalStore

    seen = [0]
    real_range, real_crcs = LocalStore.read_range, LocalStore.read_block_crcs

    def read_range(self, key, start, stop):
        seen[0] += stop - start
        return real_range(self, key, start, stop)

    def read_block_crcs(self, items, block_bytes):
        seen[0] += sum(len(v) for _, _, views in items for v in views)
        return real_crcs(self, items, block_bytes)

    monkeypatch.setattr(LocalStore, "read_range", read_range)
    monkeypatch.setattr(LocalStore, "read_block_crcs", read_block_crcs)
    return seen


def test_hf_export_of_many_small_ranks_reads_each_byte_once(tmp_path, monkeypatch):
    """Guards HF export re-reading shared blocks: each rank's one block of a 256-rank row checkpoint
    holds a slice of every tensor, and each tensor's read fetched all of those blocks whole (a
    2048-rank source: 16.8x its bytes). Output checked against the saved tensors by safetensors."""
    from safetensors.torch import load_file

    from ragckpt.convert.hf_export import export_hf

    src, state = _many_small_ranks(tmp_path, 256)
    seen = _spy_bytes_read(monkeypatch)
    export_hf(src, str(tmp_path / "hf"), write_config=False)
    data = sum(t.numel() * t.element_size() for t in state.values())
    assert seen[0] <= 1.01 * data, seen[0] / data
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(got) == sorted(state)
    for name, t in state.items():
        assert_bit_equal(got[name], t, name)


def test_hf_export_of_a_corrupt_block_read_in_pieces_fails_and_writes_no_model(tmp_path):
    from ragckpt.convert.hf_export import export_hf

    src, _ = _many_small_ranks(tmp_path, 256)
    ck = ragckpt.open(src)
    _corrupt(ck, 100, int(ck.layout.rank_sizes(0)[100]) // 2)
    out = tmp_path / "hf"
    with pytest.raises(IntegrityError, match=r"rank 100, block 0\)"):
        export_hf(src, str(out), write_config=False)
    assert not out.exists() or not any(out.iterdir())


def test_hf_export_to_s3_reads_each_byte_once_and_uploads_nothing_from_a_corrupt_source(s3, tmp_path, monkeypatch):
    """Uploads to S3 are completed only after every source block is verified (`defer_complete`), so
    S3 outputs read exactly too; a corrupt shared block then leaves no object and no open upload."""
    from safetensors.torch import load as load_bytes

    from ragckpt.convert.hf_export import export_hf

    src, state = _many_small_ranks(tmp_path, 256)
    fs = s3.fs()
    seen = _spy_bytes_read(monkeypatch)
    export_hf(src, f"{s3.url}/hf", write_config=False, max_shard_size="4MB", storage_options=s3.storage_options)
    data = sum(t.numel() * t.element_size() for t in state.values())
    assert seen[0] <= 1.01 * data, seen[0] / data
    got = {}
    files = sorted(f for f in fs.ls(f"{s3.url}/hf") if f.endswith(".safetensors"))
    assert len(files) > 1  # sharded: several deferred uploads completed in turn
    for f in files:
        got.update(load_bytes(fs.cat_file(f)))
    assert sorted(got) == sorted(state)
    for name, t in state.items():
        assert_bit_equal(got[name], t, name)

    ck = ragckpt.open(src)
    _corrupt(ck, 100, int(ck.layout.rank_sizes(0)[100]) // 2)
    with pytest.raises(IntegrityError, match=r"rank 100, block 0\)"):
        export_hf(src, f"{s3.url}/bad", write_config=False, max_shard_size="4MB", storage_options=s3.storage_options)
    fs.invalidate_cache()
    assert not fs.exists(f"{s3.url}/bad") or not fs.ls(f"{s3.url}/bad")
    assert not fs.call_s3("list_multipart_uploads", Bucket=s3.bucket).get("Uploads")


@pytest.mark.parametrize("small", [False, True])
def test_read_flat_of_neighbouring_shards_reads_each_byte_once(tmp_path, monkeypatch, small):
    """Guards a state-dict load reading the blocks its tensors share whole, once per tensor: every
    tensor's half of its rows from a 3-rank row checkpoint of 64 KiB blocks, read with `read_flat`
    into place (large ranges through the parallel in-place spans, small ones directly), as
    `load_state_dict` does for a 3 -> 2 rank FSDP2 load. Whole-block ends read 1.28x in a
    4 -> 2 load of 63 16 MiB tensors."""
    from ragckpt.checkpoint import reader

    if small:
        monkeypatch.setattr(reader, "READ_IN_PLACE_MIN_BYTES", 1 << 40)
    g = torch.Generator().manual_seed(4)
    state = {f"t{i}": torch.randn(97 + i, 301, generator=g) for i in range(12)}
    src = str(tmp_path / "ck")
    ragckpt.write_global(state, src, 3, "row", block_bytes=BLOCK)
    ck = ragckpt.open(src)
    seen = _spy_bytes_read(monkeypatch)

    def load_half(partial):
        out = {}
        for name, t in state.items():
            half = t.shape[0] // 2 * t.shape[1]
            out[name] = torch.empty(half)
            ck.read_flat(name, 0, half, out=out[name], partial=partial)
        return out

    seen[0] = 0
    partial = PartialBlocks(ck)
    got = load_half(partial)
    exact = seen[0]
    partial.complete()
    whole_before = seen[0]
    seen[0] = 0
    load_half(None)
    whole = seen[0]
    data = sum(v.numel() * 4 for v in got.values())
    assert exact <= 1.01 * data, exact / data
    assert whole > 1.2 * data, whole / data
    assert whole_before - exact < whole - data  # completing reads less than whole blocks did
    for name, t in state.items():
        assert_bit_equal(got[name], t.reshape(-1)[: got[name].numel()], name)
