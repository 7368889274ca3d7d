"""Format v1 round trips: every dtype, every layout kind, odd shapes, W in {1, 2, 3, 8, 8192}."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import zarr

import ragckpt
from tests.helpers import ALL_DTYPES, assert_bit_equal, bits, odd_state, special_tensor


@pytest.mark.parametrize("kind", ["ragged", "row", "element"])
@pytest.mark.parametrize("W", [1, 2, 3, 8])
def test_round_trip_all_dtypes_odd_shapes(tmp_path, kind, W):
    state = odd_state()
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, W, kind, granularity="row")
    ck = ragckpt.open(url)
    assert ck.world_size == W and ck.kind == kind and sorted(ck.names()) == sorted(state)
    for name, want in state.items():
        assert_bit_equal(ck.read(name), want, name)
        m = ck.meta(name)
        assert m.shape == tuple(want.shape)
        # the rank pieces follow the recorded placement and concatenate to the tensor
        pieces = [ck.read_local(name, r) for r in range(W)]
        rng = m.placement.ranges(m.shape)
        assert [p.numel() for p in pieces] == (rng[:, 1] - rng[:, 0]).tolist()
        assert_bit_equal(torch.cat(pieces), want.reshape(-1), name)
    assert ck.verify().ok


@pytest.mark.parametrize("granularity", ["element", "row", "rows:2", "whole"])
def test_ragged_granularities(tmp_path, granularity):
    """Round-trips, and each tensor is cut only where the granularity allows: anywhere for element,
    at rows (3 elements) for row, at even rows for rows:2, nowhere for whole (one rank owns it)."""
    state = {f"w{i}": special_tensor((7 + i, 3), ALL_DTYPES[i % 4], i) for i in range(6)}
    ragckpt.write_global(state, str(tmp_path / "ck"), 5, "ragged", granularity)
    ck = ragckpt.open(str(tmp_path / "ck"))
    dims = {"element": (0, 1), "row": (0,), "rows:2": (0,), "whole": ()}[granularity]
    for n, t in state.items():
        assert_bit_equal(ck.read(n), t, n)
        m = ck.meta(n)
        assert m.placement.dims == dims, n
        block = {"element": 1, "row": 3, "rows:2": 6, "whole": t.numel()}[granularity]
        starts = m.placement.ranges(m.shape)[:, 0].tolist()
        assert all(a % block == 0 or a == t.numel() for a in starts), (n, starts)


@pytest.mark.slow
def test_world_8192_with_100m_elements(tmp_path):
    """N = 8192 from one process with a 100M-element state (most ranks hold a sliver, some none)."""
    g = torch.Generator().manual_seed(1)
    state = {
        "embed": torch.randn(32500, 2048, generator=g),  # 66.6M
        "mlp.up": torch.randn(4096, 4096, generator=g).to(torch.bfloat16),  # 16.8M
        "mlp.down": torch.randn(4096, 4096, generator=g).to(torch.bfloat16),
        "norm": torch.randn(2048, generator=g),
        "tiny": torch.randn(3, generator=g),  # rows < W: ranks with no data
    }
    total = sum(t.numel() for t in state.values())
    assert total >= 100_000_000
    url = str(tmp_path / "big")
    ragckpt.write_global(state, url, 8192, "ragged")
    ck = ragckpt.open(url)
    assert ck.world_size == 8192
    for n, t in state.items():
        assert_bit_equal(ck.read(n), t, n)
    # spot-check local pieces on ranks across the world against the placement
    m = ck.meta("embed")
    rng = m.placement.ranges(m.shape)
    for r in (0, 1, 4095, 8191):
        a, b = rng[r]
        assert_bit_equal(ck.read_local("embed", r), state["embed"].reshape(-1)[a:b], f"embed@{r}")


@pytest.mark.parametrize("kind", ["ragged", "row", "element"])
def test_world_8192_odd_shapes(tmp_path, kind):
    # every dtype is covered at W <= 8 above; here three dtypes keep the object count sane
    state = odd_state([torch.bfloat16, torch.float32, torch.float8_e4m3fn], seed=3)
    ragckpt.write_global(state, str(tmp_path / "ck"), 8192, kind)
    ck = ragckpt.open(str(tmp_path / "ck"))
    for n, t in state.items():
        assert_bit_equal(ck.read(n), t, n)


def test_plain_zarr_reads_every_buffer_without_ragckpt(tmp_path):
    state = {"a": special_tensor((10, 3), torch.bfloat16), "b": special_tensor((4,), torch.float32, 1),
             "c": special_tensor((5,), torch.float8_e5m2, 2)}
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, 3, "row")
    root = zarr.open_group(url, mode="r")
    attrs = root.attrs["ragckpt"]
    for bi, b in enumerate(attrs["buffers"]):
        lay = attrs["layouts"][b["layout"]]
        units = zarr.open_array(os.path.join(url, lay["units"]["array"]), mode="r")[:]
        arr = zarr.open_array(os.path.join(url, f"buffers/{bi}"), mode="r")
        assert arr.dtype == np.dtype(b["storage_dtype"]) and arr.shape[0] == 3
        for r in range(3):
            data = arr[r]
            # FORMAT.md: a rank buffer is its pieces in tensor order; rows -> elements via the row size
            pos = 0
            for t, name in enumerate(b["tensors"]):
                shape = lay["shapes"][t]
                row = int(np.prod(shape[1:])) if shape else 1
                n = int(units[t, r]) * row
                want = state[name].reshape(-1).contiguous()
                a = sum(int(units[t, q]) * row for q in range(r))
                raw = torch.from_numpy(data[pos : pos + n].copy()).view(want.dtype)
                assert torch.equal(bits(raw), bits(want[a : a + n]))
                pos += n


def test_save_shard_from_ranks_and_extras(tmp_path):
    """The engine's path: each rank saves its own flat buffers (params and Adam state sharing one
    layout), per-rank RNG state and user metadata; one commit."""
    W = 3
    params = {"w": special_tensor((7, 4), torch.float32, 1), "b": special_tensor((5,), torch.float32, 2)}
    lay = ragckpt.CheckpointLayout.build({k: (tuple(v.shape), "float32") for k, v in params.items()}, W, "ragged")
    moments = {f"optim.state.{k}.exp_avg": special_tensor(tuple(v.shape), torch.float32, 9) for k, v in params.items()}
    lay = lay.with_buffer("optim.exp_avg", "float32", like="float32", tensors=list(moments))
    flat = lay.layout_of(0)
    url = str(tmp_path / "ck")

    def rank_buffer(values, r):
        buf = torch.zeros(int(flat.rank_sizes()[r]))
        seg = flat.rank_segments(r)
        names = list(values)
        for i in range(len(seg)):
            t = values[names[int(seg.slot[i])]].reshape(-1)
            o, fs, n = int(seg.offset[i]), int(seg.flat_start[i]), int(seg.length[i])
            buf[o : o + n] = t[fs : fs + n]
        return buf

    for r in reversed(range(W)):  # ranks finish in any order
        with pytest.raises(ragckpt.FormatError) if r == W - 1 else _nullcontext():
            ragckpt.commit(url) if r == W - 1 else None
        ragckpt.save_shard(url, r, {"float32": rank_buffer(params, r), "optim.exp_avg": rank_buffer(moments, r)}, lay,
                           extra={"rng": torch.tensor([r, 42], dtype=torch.int64)}, extra_meta={"data_pos": str(100 * r)},
                           user={"step": 7})
    ragckpt.commit(url)
    ck = ragckpt.open(url)
    assert ck.user == {"step": 7}
    for k, v in {**params, **moments}.items():
        assert_bit_equal(ck.read(k), v, k)
    for r in range(W):
        tensors, meta = ck.extra(r)
        assert tensors["rng"].tolist() == [r, 42] and meta == {"data_pos": str(100 * r)}
    # both buffers share one layout: stored once
    assert len(json.loads((tmp_path / "ck" / "zarr.json").read_text())["attributes"]["ragckpt"]["layouts"]) == 1


def test_each_rank_writes_only_its_own_objects(tmp_path):
    W = 4
    state = {"w": torch.randn(9, 2)}
    lay = ragckpt.CheckpointLayout.build({"w": ((9, 2), "float32")}, W, "row")
    url = tmp_path / "ck"
    before: set[str] = set()
    for r in (1, 2, 3, 0):
        buf = state["w"].reshape(-1)[int(lay.rank_sizes(0)[:r].sum()) : int(lay.rank_sizes(0)[: r + 1].sum())]
        ragckpt.save_shard(str(url), r, {"float32": buf.clone()}, lay)
        now = {str(p.relative_to(url)) for p in url.rglob("*") if p.is_file()}
        new = now - before
        own = {p for p in new if p.startswith(f"buffers/0/c.{r}.") or p == f"ranks/{r}.json"}
        shared = new - own
        if r != 0:
            assert not shared, f"rank {r} wrote objects it does not own: {shared}"
        before = now
    ragckpt.commit(str(url))
    assert torch.equal(ragckpt.open(str(url)).read("w"), state["w"])


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_large_rank_buffer_spans_several_chunk_objects(tmp_path):
    t = special_tensor((3000, 7), torch.float32)
    url = str(tmp_path / "ck")
    ragckpt.write_global({"t": t}, url, 2, "row", max_chunk_bytes=8 << 10, block_bytes=1 << 10)
    ck = ragckpt.open(url)
    assert len([f for f in os.listdir(tmp_path / "ck/buffers/0") if f.startswith("c.0.")]) > 5
    assert_bit_equal(ck.read("t"), t)
    assert_bit_equal(ck.read_flat("t", 1234, 17001), t.reshape(-1)[1234:17001])
    assert ck.verify().ok
    arr = zarr.open_array(str(tmp_path / "ck/buffers/0"), mode="r")
    assert torch.equal(bits(torch.from_numpy(arr[1])), bits(t.reshape(-1)[10500:]))


@pytest.mark.parametrize("W", [1, 3])
def test_fewer_ranks_than_threads_share_each_ranks_chunks(tmp_path, W):
    """With fewer ranks than writer threads and `share_chunks`, the chunks of one rank are written by
    several threads at once (a reshard to a small world from an object store is not one thread per
    rank), each taking runs of neighbouring chunks (so the resharder's kept source blocks serve the
    next chunk); the crc tables are assembled in chunk order, so the checkpoint verifies and reads
    back bit-exactly."""
    import threading

    from ragckpt.checkpoint.manifest import buffer_chunking
    from ragckpt.checkpoint.writer import _runs, write_streaming
    from ragckpt.format.dtypes import as_bytes

    state = {"a": special_tensor((9001, 5), torch.float32), "b": special_tensor((777,), torch.bfloat16),
             "empty": torch.zeros(0, 4, dtype=torch.int8)}
    lay = ragckpt.CheckpointLayout.build({k: (tuple(v.shape), ragckpt.format.dtypes.dtype_name(v.dtype))
                                          for k, v in state.items()}, W, "ragged")
    ch = buffer_chunking(lay, 0, 4 << 10, 1 << 10)
    chunk = ch.chunk_elems
    runs = _runs(ch.count(lay.rank_sizes(0)[0]), 8)  # 4 threads: two runs each
    assert len(runs) > 2 and len(runs[0]) > 1
    threads_seen: set[int] = set()
    order: dict[int, list[int]] = {}  # rank 0's float32 chunks in the order each thread filled them
    both = threading.Barrier(2, timeout=10)  # two runs must be in flight together, or this times out

    def fill_for(bi, rank):
        spec = lay.buffers[bi]
        seg = lay.layout_of(bi).rank_segments(rank)
        n = int(lay.rank_sizes(bi)[rank])
        buf = torch.zeros(n, dtype=ragckpt.format.dtypes.torch_dtype(spec.dtype))
        for i in range(len(seg)):
            o, fs, m = int(seg.offset[i]), int(seg.flat_start[i]), int(seg.length[i])
            buf[o : o + m] = state[spec.tensors[int(seg.slot[i])]].reshape(-1)[fs : fs + m]

        def fill(lo, hi):
            threads_seen.add(threading.get_ident())
            if rank == 0 and bi == 0:
                order.setdefault(threading.get_ident(), []).append(lo // chunk)
                if lo // chunk in (runs[0][0], runs[1][0]):  # the first chunks of the first two runs meet here
                    both.wait()
            return as_bytes(buf[lo:hi])
        return fill

    url = str(tmp_path / "ck")
    write_streaming(url, lay, fill_for, workers=4, max_chunk_bytes=4 << 10, block_bytes=1 << 10, share_chunks=True)
    assert len(threads_seen) > 1
    assert len([f for f in os.listdir(tmp_path / "ck/buffers/0") if f.startswith("c.0.")]) > 2
    def within(seq: list[int], run: list[int]) -> bool:
        return any(seq[i : i + len(run)] == run for i in range(len(seq)))

    assert all(any(within(seq, list(js)) for seq in order.values()) for js in runs), (runs, order)
    ck = ragckpt.open(url)
    assert ck.verify().ok
    for k, v in state.items():
        assert_bit_equal(ck.read(k), v)


def test_chunk_runs_cover_every_chunk_once_in_at_most_the_parts_asked():
    from ragckpt.checkpoint.writer import _runs

    for count in range(0, 40):
        for parts in (1, 2, 3, 8):
            rs = _runs(count, parts)
            assert [j for r in rs for j in r] == list(range(count)) and len(rs) <= parts
            assert all(len(r) for r in rs) and (not rs or max(map(len, rs)) - min(map(len, rs)) <= 1)
            assert len(rs) == min(count, parts)


def test_existing_destination_is_refused(tmp_path):
    url = str(tmp_path / "ck")
    ragckpt.write_global({"a": torch.ones(3)}, url, 2)
    with pytest.raises(ragckpt.DestinationExistsError, match="already holds .*checkpoint"):
        ragckpt.write_global({"a": torch.zeros(3)}, url, 2)
    assert torch.equal(ragckpt.open(url).read("a"), torch.ones(3))  # nothing lost
    ragckpt.write_global({"a": torch.zeros(3)}, url, 2, overwrite=True)
    assert torch.equal(ragckpt.open(url).read("a"), torch.zeros(3))


def test_io_concurrency_env_sizes_the_writer_pool(monkeypatch):
    from ragckpt.checkpoint.writer import default_workers

    monkeypatch.setenv("RAGCKPT_IO_CONCURRENCY", "3")
    assert default_workers() == 3
    monkeypatch.delenv("RAGCKPT_IO_CONCURRENCY")
    assert 1 <= default_workers() <= 16


def _random_ranges_equal(ck, state: dict, seed: int) -> None:
    """Every tensor whole, and 20 random flat ranges of each, bit-equal to the original."""
    rng = np.random.default_rng(seed)
    for name, t in state.items():
        flat = t.reshape(-1)
        n = flat.numel()
        assert_bit_equal(ck.read(name), t, name)
        for _ in range(20):
            lo, hi = sorted(int(x) for x in rng.integers(0, n + 1, 2))
            assert_bit_equal(ck.read_flat(name, lo, hi), flat[lo:hi], f"{name}[{lo}:{hi}]")


@pytest.mark.parametrize("kind", ["ragged", "row", "element"])
@pytest.mark.parametrize("block_bytes", [8, 24, 1 << 10])
def test_read_flat_in_place_matches_the_staged_path(tmp_path, monkeypatch, kind, block_bytes):
    # force the in-place path onto a small checkpoint: whole blocks read into place across several
    # chunk objects and spans, partial end blocks staged; every range must equal the tensor
    from ragckpt.checkpoint import reader

    state = {"a": special_tensor((37, 11), torch.float32), "b": special_tensor((301,), torch.bfloat16, 1),
             "c": special_tensor((5, 3, 7), torch.float8_e5m2, 2), "d": special_tensor((64,), torch.bool, 3),
             "e": special_tensor((0, 4), torch.int16, 4)}
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, 3, kind, max_chunk_bytes=256, block_bytes=block_bytes)
    ck = ragckpt.open(url)
    calls = []
    real = ck.read_blocks_into
    monkeypatch.setattr(ck, "read_blocks_into", lambda *a: (calls.append(a), real(*a))[1])
    monkeypatch.setattr(reader, "READ_IN_PLACE_MIN_BYTES", 0)
    monkeypatch.setattr(reader, "_IN_PLACE_SPAN_BYTES", 3 * block_bytes)
    _random_ranges_equal(ck, state, seed=7)
    assert calls  # the in-place path did run


@pytest.mark.parametrize("block_bytes", [8, 24, 64])
def test_staged_read_flat_asks_one_object_per_range(tmp_path, monkeypatch, block_bytes):
    """Guards a staged read (object stores) of a range over two storage objects: the reader joined
    the two objects' bytes into one more copy of the range, which `diff --window` did not count.
    Every request now lies in one object, and every range still equals the tensor."""
    from ragckpt.checkpoint.reader import Checkpoint
    from ragckpt.storage.store import LocalStore

    monkeypatch.setattr(LocalStore, "zero_copy_reads", False)
    state = {"a": special_tensor((37, 11), torch.float32), "b": special_tensor((301,), torch.bfloat16, 1),
             "c": special_tensor((5, 3, 7), torch.float8_e5m2, 2), "d": special_tensor((64,), torch.bool, 3)}
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, 3, "ragged", max_chunk_bytes=192, block_bytes=block_bytes)
    ck = ragckpt.open(url)
    asked = []
    real = Checkpoint.read_rank_ranges
    monkeypatch.setattr(Checkpoint, "read_rank_ranges", lambda self, bi, reqs: (
        asked.extend((self._chunking(bi).chunk_bytes, a, b) for _, a, b in reqs), real(self, bi, reqs))[1])
    _random_ranges_equal(ck, state, seed=8)
    assert any(b - a > 0 for _, a, b in asked)
    assert all(a // c == (b - 1) // c for c, a, b in asked if b > a), [x for x in asked if x[1] // x[0] != (x[2] - 1) // x[0]]


def test_read_flat_in_place_names_a_corrupt_block(tmp_path, monkeypatch):
    from ragckpt.checkpoint import reader

    t = special_tensor((4096,), torch.float32)
    url = str(tmp_path / "ck")
    ragckpt.write_global({"t": t}, url, 2, "row", block_bytes=1 << 10)
    monkeypatch.setattr(reader, "READ_IN_PLACE_MIN_BYTES", 0)
    f = tmp_path / "ck" / "buffers" / "0" / "c.1.0"
    raw = bytearray(f.read_bytes())
    raw[3000] ^= 0x40  # rank 1, block 2: inside the whole blocks of a full read
    f.write_bytes(bytes(raw))
    ck = ragckpt.open(url)
    with pytest.raises(ragckpt.IntegrityError, match=r"buffers/0/c\.1\.0 .*rank 1, block 2"):
        ck.read("t")
    with pytest.raises(ragckpt.IntegrityError, match=r"buffers/0/c\.1\.0"):
        ck.read_flat("t", 2048 + 700, 2048 + 760)  # a partial block, staged
    assert_bit_equal(ck.read_flat("t", 0, 2048), t[:2048])  # rank 0 is intact
