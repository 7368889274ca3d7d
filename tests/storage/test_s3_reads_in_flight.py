"""Reads from object stores keep several GETs in flight and stream them straight into place.

Real S3 answers each request after tens of milliseconds and moves one request's bytes at about
100 MB/s, so a reader that asks for one range after another is slow there and fast against the local
test server. The fault proxy's `latency_s` holds every reply back, so requests that overlap in time
are the ones the client issued together: `max_inflight` shows how many a read path keeps going.
"""

from __future__ import annotations

import pytest
import torch

import ragckpt
from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.errors import IntegrityError
from ragckpt.planner.state import CheckpointLayout
from ragckpt.reshard.gather import GatherStats
from tests.helpers import assert_bit_equal, special_tensor

MiB = 1 << 20
PART = 5 * MiB  # S3's smallest part: the GET size of in-place reads
CONCURRENCY = 4
LATENCY_S = 0.3  # long enough that a busy machine still issues all the GETs of one call before the first reply


def _opts(opts: dict) -> dict:
    return {**opts, "ragckpt": {**opts.get("ragckpt", {}), "part_size": PART, "concurrency": CONCURRENCY}}


@pytest.fixture
def two_ranks(s3_faulty):
    """A 2-rank row checkpoint of 2 x 24 MiB of float32 in 8 MiB objects (three per rank), written
    straight to the server; returns (url through the proxy, its options, the state)."""
    state = {"w": special_tensor((2 * 6 * MiB,), torch.float32, seed=3)}
    url = f"{s3_faulty.url}/ck"
    ragckpt.write_global(state, url, 2, "row", storage_options=s3_faulty.direct.storage_options,
                         max_chunk_bytes=8 * MiB)
    s3_faulty.proxy.configure(latency_s=LATENCY_S)
    return url, _opts(s3_faulty.storage_options), state


def test_a_restore_keeps_the_gets_of_all_its_objects_in_flight(two_ranks, s3_faulty):
    """Guards `read_rank(out=)` on S3 fetching one GET after another (one in flight, 60 MB/s per
    process against S3's latency): a rank buffer of three objects is read in 5 MiB GETs, `concurrency`
    of them at once across objects, never more (six GETs), bit-exact."""
    url, opts, state = two_ranks
    ck = ragckpt.open(url, storage_options=opts)
    out = torch.empty(6 * MiB, dtype=torch.float32)
    s3_faulty.proxy.configure(latency_s=LATENCY_S)
    ck.read_rank("float32", 1, out=out)
    assert_bit_equal(out, state["w"][6 * MiB :])
    gets = s3_faulty.proxy.stats.by_method["GET"]
    assert gets == 6  # each 8 MiB object in a 5 MiB and a 3 MiB GET
    assert s3_faulty.proxy.stats.max_inflight == CONCURRENCY


@pytest.mark.slow
def test_a_load_reads_the_whole_blocks_of_long_runs_in_place_with_gets_in_flight(s3_faulty):
    """Guards `ragckpt.load` from S3 staging every run batch by batch (one or two GETs in flight): the
    whole checksum blocks of a long run stream straight into the destination, GETs in flight
    together, and only the partial blocks at its ends are fetched apart; no block is read twice."""
    n = 12 * MiB + 7  # element layout on 2 ranks: rank 1 starts 16 bytes into a block
    state = {"w": special_tensor((n,), torch.float32, seed=5)}
    url = f"{s3_faulty.url}/odd"
    ragckpt.write_global(state, url, 1, "row", storage_options=s3_faulty.direct.storage_options,
                         max_chunk_bytes=8 * MiB)
    opts = _opts(s3_faulty.storage_options)
    target = CheckpointLayout.build({"w": ((n,), "float32")}, 2, "element")
    for rank in (0, 1):
        seg = target.layout_of(0).rank_segments(rank)
        lo = int(seg.flat_start[0])
        hi = lo + int(seg.length[0])
        s3_faulty.proxy.configure(latency_s=LATENCY_S)
        stats = GatherStats()
        got = ragckpt.load(url, target, rank, storage_options=opts, stats=stats)["float32"]
        assert_bit_equal(got[: hi - lo], state["w"][lo:hi])
        assert s3_faulty.proxy.stats.max_inflight == CONCURRENCY
        first_block = lo * 4 // MiB * MiB
        last = min(-(-hi * 4 // MiB) * MiB, n * 4)
        assert stats.bytes_read == last - first_block  # every block it touches, once


def test_reading_a_tensor_from_s3_holds_no_second_copy_of_it(s3_faulty, monkeypatch):
    """Guards `Checkpoint.read` of a large tensor on S3 fetching all of it into staging buffers
    before copying it into the result (twice its size in memory): only the partial checksum blocks
    at the ends of each rank's piece are fetched apart, the whole blocks land in place."""
    from ragckpt.storage.remote import S3Store

    staged: list[int] = []
    real = S3Store.read_ranges

    def read_ranges(store, reqs):
        staged.extend(b - a for _, a, b in reqs)
        return real(store, reqs)

    monkeypatch.setattr(S3Store, "read_ranges", read_ranges)
    small, big = special_tensor((1000,), torch.float32, seed=1), special_tensor((6 * MiB + 3,), torch.float32, seed=2)
    url = f"{s3_faulty.url}/two"
    ragckpt.write_global({"small": small, "big": big}, url, 2, "row", storage_options=s3_faulty.direct.storage_options)
    ck = ragckpt.open(url, storage_options=_opts(s3_faulty.storage_options))
    staged.clear()
    assert_bit_equal(ck.read("big"), big)
    assert len(staged) <= 3 and sum(staged) < 3 * MiB, staged  # of 24 MiB: a partial block at a piece's end


@pytest.mark.parametrize("where", ["s3", "local"])
def test_a_corrupt_block_in_a_batch_of_scattered_reads_is_named(where, s3_faulty, tmp_path):
    """Guards `read_scatter_many` naming the wrong rank, block or object when the bad block is in
    a later request of the batch (blocks are counted across all of them)."""
    state = {"w": special_tensor((2 * 3 * MiB,), torch.float32, seed=8)}  # 12 MiB per rank
    if where == "s3":
        url, write_opts, opts = f"{s3_faulty.url}/bad", s3_faulty.direct.storage_options, _opts(s3_faulty.storage_options)
    else:
        url, write_opts, opts = str(tmp_path / "bad"), None, None
    ragckpt.write_global(state, url, 2, "row", storage_options=write_opts, max_chunk_bytes=8 * MiB)
    key = "buffers/0/c.1.1"  # rank 1's second object
    written = ragckpt.open(url, storage_options=write_opts)
    store, per_object = written.store, written._chunking(0).chunk_bytes
    data = bytearray(store.read(key))
    data[MiB + 5] ^= 0x40  # in the second block of that object
    store.write(key, [bytes(data)])
    ck = ragckpt.open(url, storage_options=opts)
    a, b = bytearray(12 * MiB), bytearray(12 * MiB)
    with pytest.raises(IntegrityError) as e:
        Checkpoint.read_scatter_many(ck, 0, [(0, 0, [memoryview(a)]), (1, 0, [memoryview(b)])])
    assert "c.1.1" in str(e.value) and f"rank 1, block {per_object // MiB + 1})" in str(e.value), str(e.value)


def test_a_truncated_object_under_a_restore_from_s3_is_named(two_ranks, s3_faulty):
    """A chunk object cut short is reported as a damaged checkpoint naming the object, whichever of
    the GETs in flight together finds it."""
    url, opts, _ = two_ranks
    s3_faulty.proxy.configure()
    direct = ragckpt.open(url, storage_options=s3_faulty.direct.storage_options).store
    key = "buffers/0/c.0.1"
    direct.write(key, [direct.read(key)[: 3 * MiB]])
    ck = ragckpt.open(url, storage_options=opts)
    with pytest.raises(IntegrityError, match=r"c\.0\.1.*(truncated|incomplete)"):
        ck.read_rank("float32", 0, out=torch.empty(6 * MiB, dtype=torch.float32))
