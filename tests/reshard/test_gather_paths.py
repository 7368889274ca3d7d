"""Copy paths of resharding: `Gatherer.fill` (fetch batches, the concatenated scatter of many small
ranges, in-place reads of block-aligned runs), `copy_runs` / `copy_runs_np`, and the source I/O a fill
asks for.

Data is compared with references built without the code under test: `torch.chunk` of the original
tensors, or a Python slice loop. I/O is checked by spying on the checkpoint's two read primitives
(`read_rank_ranges`, `read_blocks_into`) and on `GatherStats`, with exact expected numbers.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest
import torch

import ragckpt
from ragckpt import CheckpointLayout
from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.format.runs import copy_runs
from ragckpt.reshard.gather import UINT_OF_SIZE, GatherStats, copy_runs_np
from ragckpt.storage.store import LocalStore
from tests.helpers import assert_bit_equal, special_tensor


class ReadSpy:
    """Every `read_rank_ranges` request list, and every `read_blocks_into` and `read_scatter` call
    `(rank, start, nbytes)`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.ranges: list[list[tuple[int, int, int]]] = []
        self.in_place: list[tuple[int, int, int]] = []
        self.scattered: list[tuple[int, int, int]] = []
        real_ranges, real_into, real_scatter = (Checkpoint.read_rank_ranges, Checkpoint.read_blocks_into,
                                                Checkpoint.read_scatter)

        def ranges(ck, buffer, reqs):
            self.ranges.append([tuple(int(x) for x in q) for q in reqs])
            return real_ranges(ck, buffer, reqs)

        def into(ck, bi, rank, a, dst):
            self.in_place.append((int(rank), int(a), len(dst)))
            return real_into(ck, bi, rank, a, dst)

        def scatter(ck, bi, rank, a, views):
            self.scattered.append((int(rank), int(a), sum(len(memoryview(v).cast("B")) for v in views)))
            return real_scatter(ck, bi, rank, a, views)

        monkeypatch.setattr(Checkpoint, "read_rank_ranges", ranges)
        monkeypatch.setattr(Checkpoint, "read_blocks_into", into)
        monkeypatch.setattr(Checkpoint, "read_scatter", scatter)

    def requests(self) -> list[tuple[int, int, int]]:
        return [q for call in self.ranges for q in call]

    def clear(self) -> None:
        self.ranges.clear()
        self.in_place.clear()


def fp32_layout(names_shapes: dict[str, tuple[int, ...]], world_size: int, kind: str) -> CheckpointLayout:
    return CheckpointLayout.build({n: (s, "float32") for n, s in names_shapes.items()}, world_size, kind)


# -- Gatherer.fill: fetch batches and the concatenated scatter -------------------------------------------

def hundred_small_tensors(tmp_path) -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    """100 (4, 8) float32 tensors on one rank, 8-byte checksum blocks: a 2-rank row target takes two
    rows of each, 100 disjoint 64-byte ranges of the source that no merging can join."""
    state = {f"t{i:03d}": special_tensor((4, 8), torch.float32, seed=i) for i in range(100)}
    ragckpt.write_global(state, str(tmp_path / "src"), 1, "row", block_bytes=8)
    return ragckpt.open(str(tmp_path / "src")), state


def test_fetch_batches_after_the_first_scatter_from_their_own_ranges(tmp_path, monkeypatch):
    """Guards the concatenated scatter of a later fetch batch using the first batch's range starts (`g_lo[gid]`)."""
    ck, state = hundred_small_tensors(tmp_path)
    target = fp32_layout({n: (4, 8) for n in state}, 2, "row")
    spy = ReadSpy(monkeypatch)
    for r in range(2):
        spy.clear()
        got = ragckpt.load(ck, target, r, budget_bytes=2048)["float32"]
        want = torch.cat([v.chunk(2)[r].reshape(-1) for v in state.values()])
        assert_bit_equal(got, want, f"rank {r}")
        # the case under test: several batches, one after the first with >= 16 ranges (the concat path)
        assert len(spy.ranges) > 1 and max(len(c) for c in spy.ranges[1:]) >= 16, [len(c) for c in spy.ranges]


def test_many_short_runs_scattered_in_reverse_order_land_exactly(tmp_path, monkeypatch):
    """Guards the index batches of `copy_runs_np` (the vectorised scatter of > 32 short runs) misplacing elements."""
    ck, state = hundred_small_tensors(tmp_path)
    names = list(reversed(state))
    target = fp32_layout({n: (4, 8) for n in names}, 2, "row")
    spy = ReadSpy(monkeypatch)
    for r in range(2):
        spy.clear()
        got = ragckpt.load(ck, target, r)["float32"]  # default budget: one batch of 100 ranges
        want = torch.cat([state[n].chunk(2)[r].reshape(-1) for n in names])
        assert_bit_equal(got, want, f"rank {r}")
        assert [len(c) for c in spy.ranges] == [100]


def test_offline_in_place_reads_of_later_chunks_land_at_their_offset(tmp_path, monkeypatch):
    """Guards an in-place read of a destination chunk that does not start the rank buffer landing at its absolute offset."""
    # 64 KiB fetches make 256 KiB block-aligned runs long enough to read in place; 512 KiB objects
    # make the destination writer fill each rank buffer in four chunks, three of them past offset 0
    monkeypatch.setattr(LocalStore, "fetch_bytes", property(lambda self: 64 << 10))
    w = special_tensor((512, 1024), torch.float32, seed=7)  # 2 MiB
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    ragckpt.write_global({"w": w}, src, 1, "row", block_bytes=64 << 10, max_chunk_bytes=512 << 10)
    spy = ReadSpy(monkeypatch)
    ragckpt.reshard.reshard(src, dst, 1, layout="element", threads=1)
    assert any(a > 0 for _, a, _ in spy.in_place), spy.in_place  # the case under test happened
    assert sum(n for _, _, n in spy.in_place) == w.numel() * 4
    ck = ragckpt.open(dst)
    assert ck.kind == "element"
    assert_bit_equal(ck.read_rank(0, 0), w.reshape(-1), "rank buffer")
    assert_bit_equal(ck.read("w"), w, "w")


# -- copy_runs / copy_runs_np against a slice loop -------------------------------------------------------

def slice_loop(dst: torch.Tensor, dst_starts, src: torch.Tensor, src_starts, lengths) -> torch.Tensor:
    out = dst.clone()
    for d, s, n in zip(dst_starts.tolist(), src_starts.tolist(), lengths.tolist(), strict=True):
        out[d : d + n] = src[s : s + n]
    return out


def permuted_runs(lengths: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(dst_starts, src_starts): runs packed in order in the destination, in a random order in the source."""
    rng = np.random.default_rng(seed)
    dst_starts = np.cumsum(lengths) - lengths
    order = rng.permutation(len(lengths))
    src_pos = np.empty_like(lengths)
    src_pos[order] = np.cumsum(lengths[order]) - lengths[order]
    return dst_starts, src_pos


def as_uint_np(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy().view(UINT_OF_SIZE[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64])
def test_runs_of_mixed_lengths_match_a_slice_loop(dtype):
    """Guards the index batches of `copy_runs` / `copy_runs_np` offsetting every run by the first run's length (`lens[0]`)."""
    lengths = np.random.default_rng(1).integers(1, 10, size=300).astype(np.int64)
    assert len(set(lengths.tolist())) > 1
    dst_starts, src_starts = permuted_runs(lengths, seed=2)
    total = int(lengths.sum())
    src = special_tensor((total,), dtype, seed=3)
    want = slice_loop(torch.zeros_like(src), dst_starts, src, src_starts, lengths)
    got = torch.zeros_like(src)
    copy_runs(got, dst_starts, src, src_starts, lengths)
    assert_bit_equal(got, want, "copy_runs")
    got_np = torch.zeros_like(src)
    copy_runs_np(as_uint_np(got_np), dst_starts, as_uint_np(src), src_starts, lengths)
    assert_bit_equal(got_np, want, "copy_runs_np")


class Hang(Exception):
    pass


def test_a_run_longer_than_an_index_batch_among_short_ones_terminates():
    """Guards the batched `copy_runs` loop never advancing past a run longer than one index batch (an endless loop)."""
    lengths = np.array([1] * 100 + [100_000] + [1] * 100, dtype=np.int64)  # mean ~500: the batched path
    dst_starts, src_starts = permuted_runs(lengths, seed=4)
    src = special_tensor((int(lengths.sum()),), torch.float32, seed=5)
    want = slice_loop(torch.zeros_like(src), dst_starts, src, src_starts, lengths)
    got = torch.zeros_like(src)

    def alarm(signum, frame):
        raise Hang("copy_runs did not finish in 10 s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, 10.0)
    try:
        copy_runs(got, dst_starts, src, src_starts, lengths)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert_bit_equal(got, want)


# -- Gatherer.fill: the I/O it asks for ---------------------------------------------------------------------

def sixteen_k_floats(tmp_path) -> tuple[Checkpoint, torch.Tensor, CheckpointLayout]:
    """16384 float32 (64 KiB) on one rank in 1 KiB checksum blocks, and a 1-rank element target."""
    x = special_tensor((16384,), torch.float32, seed=11)
    ragckpt.write_global({"x": x}, str(tmp_path / "src"), 1, "row", block_bytes=1024)
    return ragckpt.open(str(tmp_path / "src")), x, fp32_layout({"x": (16384,)}, 1, "element")


def staged_load_of_sixteen_k_floats(tmp_path, monkeypatch, budget_bytes: int) -> tuple[ReadSpy, GatherStats]:
    """Load `sixteen_k_floats` through the staged path (an in-place read would skip the cutting),
    check it bit-exact, and return what it read."""
    monkeypatch.setattr(LocalStore, "zero_copy_reads", False)
    ck, x, target = sixteen_k_floats(tmp_path)
    spy = ReadSpy(monkeypatch)
    stats = GatherStats()
    got = ragckpt.load(ck, target, 0, budget_bytes=budget_bytes, stats=stats)["float32"]
    assert_bit_equal(got, x)
    return spy, stats


def test_fetches_are_cut_at_the_budget_and_read_every_byte_once(tmp_path, monkeypatch):
    """Guards the source-cell cuts of `split_at_grid` and of the range merging (ranges past the budget, overlapping or empty pieces)."""
    spy, stats = staged_load_of_sixteen_k_floats(tmp_path, monkeypatch, 4096)
    reqs = spy.requests()
    assert all(hi - lo <= 4096 for _, lo, hi in reqs), reqs
    assert sum(hi - lo for _, lo, hi in reqs) == 65536
    assert stats.requests == 16 and stats.bytes_read == 65536 and stats.bytes_requested == 65536
    assert not spy.in_place


def test_a_budget_off_the_block_grid_keeps_requests_within_it(tmp_path, monkeypatch):
    """Guards the source cell being rounded to something other than whole checksum blocks below the budget."""
    spy, stats = staged_load_of_sixteen_k_floats(tmp_path, monkeypatch, 3000)
    reqs = spy.requests()
    assert reqs and all(hi - lo <= 3000 for _, lo, hi in reqs), reqs
    assert stats.bytes_read == 65536  # no block fetched twice


def test_a_budget_below_one_block_still_batches_whole_cells(tmp_path, monkeypatch):
    """Guards the fetch budget not being raised to at least one source cell (one read call per range)."""
    y = special_tensor((40, 3), torch.float32, seed=12)
    ragckpt.write_global({"y": y}, str(tmp_path / "src"), 4, "row")
    stats = GatherStats()
    got = ragckpt.load(str(tmp_path / "src"), fp32_layout({"y": (40, 3)}, 1, "element"), 0, budget_bytes=1,
                       stats=stats)["float32"]
    assert_bit_equal(got, y.reshape(-1))
    assert stats.read_calls == 1 and stats.requests == 4


def test_the_last_block_of_a_rank_is_not_widened_past_its_end(tmp_path):
    """Guards the widened fetch of a rank buffer's last, partial checksum block counting bytes past the buffer's end."""
    z = special_tensor((250,), torch.float32, seed=13)  # 1000 bytes: a partial last 1 KiB block
    ragckpt.write_global({"z": z}, str(tmp_path / "src"), 1, "row", block_bytes=1024)
    stats = GatherStats()
    got = ragckpt.load(str(tmp_path / "src"), fp32_layout({"z": (250,)}, 1, "element"), 0, stats=stats)["float32"]
    assert_bit_equal(got, z)
    assert stats.bytes_read == 1000 and stats.requests == 1


def test_a_range_starting_on_the_next_block_joins_the_previous_request(tmp_path, monkeypatch):
    """Guards two source ranges that meet on a block edge being fetched as two requests."""
    a, b = special_tensor((256,), torch.float32, seed=14), special_tensor((256,), torch.float32, seed=15)
    ragckpt.write_global({"a": a, "b": b}, str(tmp_path / "src"), 1, "row", block_bytes=1024)
    spy = ReadSpy(monkeypatch)
    stats = GatherStats()
    got = ragckpt.load(str(tmp_path / "src"), fp32_layout({"b": (256,), "a": (256,)}, 1, "element"), 0,
                       stats=stats)["float32"]
    assert_bit_equal(got, torch.cat([b, a]))
    assert stats.requests == 1 and spy.requests() == [(0, 0, 2048)]


def test_ranges_within_one_budget_share_one_read_call(tmp_path, monkeypatch):
    """Guards the batch cut counting a range's own size against the budget (a call per range that fits the budget together)."""
    a, g, b = (special_tensor((256,), torch.float32, seed=s) for s in (16, 17, 18))
    ragckpt.write_global({"a": a, "g": g, "b": b}, str(tmp_path / "src"), 1, "row", block_bytes=1024)
    spy = ReadSpy(monkeypatch)
    stats = GatherStats()
    got = ragckpt.load(str(tmp_path / "src"), fp32_layout({"b": (256,), "a": (256,)}, 1, "element"), 0,
                       budget_bytes=2048, stats=stats)["float32"]
    assert_bit_equal(got, torch.cat([b, a]))
    assert stats.requests == 2 and stats.read_calls == 1 and stats.bytes_read == 2048  # g is never read
    assert spy.ranges == [[(0, 0, 1024), (0, 2048, 3072)]]


def test_a_whole_rank_ending_mid_block_is_read_in_place(tmp_path, monkeypatch):
    """Guards a run that ends its rank buffer inside a checksum block being refused the in-place read."""
    u = special_tensor((1001,), torch.uint8, seed=19)
    ragckpt.write_global({"u": u}, str(tmp_path / "src"), 1, "row", block_bytes=8)
    ck = ragckpt.open(str(tmp_path / "src"))
    spy = ReadSpy(monkeypatch)
    got = ragckpt.load(ck, ck.layout, 0, budget_bytes=16)["uint8"]
    assert_bit_equal(got, u)
    assert spy.in_place == [(0, 0, 1001)] and spy.ranges == []


def test_only_runs_long_enough_are_read_in_place(tmp_path, monkeypatch):
    """Guards short block-aligned runs being read in place one call each instead of merged into a fetch batch."""
    big, small = special_tensor((4096,), torch.uint8, seed=20), special_tensor((16,), torch.uint8, seed=21)
    ragckpt.write_global({"big": big, "small": small}, str(tmp_path / "src"), 1, "row", block_bytes=8)
    target = CheckpointLayout.build({"small": ((16,), "uint8"), "big": ((4096,), "uint8")}, 1, "row")
    spy = ReadSpy(monkeypatch)
    got = ragckpt.load(str(tmp_path / "src"), target, 0, budget_bytes=16)["uint8"]
    assert_bit_equal(got, torch.cat([small, big]))
    assert spy.in_place == [(0, 0, 4096)]  # big only; small (16 bytes < 4 fetches of 16) is fetched
    assert spy.requests() == [(0, 4096, 4112)]


def test_scattered_and_staged_ranges_are_each_counted_once(tmp_path, monkeypatch):
    """Guards the counters of ranges read by `read_scatter` (widened bytes, requested bytes, requests,
    calls): the reshard summary's bytes_read and read_calls add them to the staged path's."""
    from ragckpt.reshard import gather

    sizes = {"a": 200, "g": 100, "b": 300, "h": 300, "c": 300}  # float32: a [0, 800), b [1200, 2400), c [3600, 4800)
    x = {n: special_tensor((k,), torch.float32, seed=i) for i, (n, k) in enumerate(sizes.items())}
    ragckpt.write_global(x, str(tmp_path / "src"), 1, "row", block_bytes=1024)
    monkeypatch.setattr(gather, "_SCATTER_MIN_RUN_BYTES", 1000)  # b's and c's 1200 bytes qualify, a's 800 not
    spy = ReadSpy(monkeypatch)
    stats = GatherStats()
    got = ragckpt.load(str(tmp_path / "src"), fp32_layout({n: (sizes[n],) for n in "bac"}, 1, "element"), 0,
                       stats=stats)["float32"]
    assert_bit_equal(got, torch.cat([x["b"], x["a"], x["c"]]))
    assert spy.in_place == []  # no run is whole blocks
    assert spy.scattered == [(0, 1024, 2048), (0, 3072, 1728)]  # b and c widened to their blocks
    assert spy.requests() == [(0, 0, 800)]  # a, staged
    assert stats.as_dict() == {"bytes_read": 1024 + 2048 + 1728, "bytes_requested": 800 + 1200 + 1200,
                               "read_requests": 3, "read_calls": 3, "bytes_reused": 0}


@pytest.mark.parametrize("block_bytes, budget", [(8, 8), (24, 40)])
def test_cells_are_whole_elements_when_blocks_are_smaller_or_do_not_divide_them(tmp_path, block_bytes, budget):
    """Guards a source cell of zero elements (8-byte blocks of complex128 with a budget under one element
    divided by zero) and cells cut inside an element (24-byte blocks of 16-byte elements)."""
    import warnings

    x = {n: special_tensor((3,), torch.complex128, seed=i) for i, n in enumerate(("a", "b"))}
    ragckpt.write_global(x, str(tmp_path / "src"), 1, "row", block_bytes=block_bytes)
    target = CheckpointLayout.build({n: ((3,), "complex128") for n in ("b", "a")}, 4, "element")
    stats = GatherStats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's divide-by-zero warning
        got = [ragckpt.load(str(tmp_path / "src"), target, r, budget_bytes=budget, stats=stats)["complex128"]
               for r in range(4)]
    whole = torch.cat([x["b"], x["a"]])
    assert_bit_equal(torch.cat(got)[: whole.numel()], whole)
    assert stats.bytes_read <= 2 * whole.numel() * 16  # each block at most twice (ranks share edge blocks)
