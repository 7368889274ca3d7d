"""docs/FORMAT.md is a contract: a reader written from it alone (tests/spec_reader.py, which never
imports ragckpt) must find every tensor's bytes, every checksum, the commit state and the extras in
what ragckpt writes, across layout kinds, world sizes, dtypes, chunking and the engine's save path;
and it must see damage where ragckpt does."""

from __future__ import annotations

import os

import pytest
import torch

import ragckpt
from tests.helpers import ALL_DTYPES, MORE_DTYPES, bits, odd_state, special_tensor
from tests.spec_reader import SpecReader


def _conforms(url: str, state: dict[str, torch.Tensor]) -> SpecReader:
    r = SpecReader(url)
    assert r.committed, r.commit_problems
    assert sorted(r.names()) == sorted(state)
    for name, want in state.items():
        got = r.read(name)
        assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), name
        assert torch.equal(bits(got), bits(want)), name
        flat, covered = want.reshape(-1), 0
        for rank in range(r.W):
            piece, (lo, hi) = r.read_local(name, rank)
            assert torch.equal(bits(piece), bits(flat[lo:hi])), (name, rank)
            covered += hi - lo
        assert covered == want.numel(), name
    problems = r.verify() + r.structure() + r.check_rank_records()
    assert problems == [], problems
    return r


@pytest.mark.parametrize("layout", ["row", "element", "ragged"])
@pytest.mark.parametrize("W", [1, 3, 8])
def test_write_global_conforms(tmp_path, layout, W):
    state = {**odd_state(), **odd_state(ALL_DTYPES[3:] + ALL_DTYPES[:3], seed=5)}
    state = {f"{k}.{i}": v for i, (k, v) in enumerate(state.items())}
    ragckpt.write_global(state, str(tmp_path / "ck"), W, layout)
    _conforms(str(tmp_path / "ck"), state)


@pytest.mark.parametrize("layout", ["row", "element", "ragged"])
def test_complex_and_wide_unsigned_dtypes_conform(tmp_path, layout):
    state = {f"{k}.{i}": v for i, (k, v) in enumerate(odd_state(MORE_DTYPES, seed=3).items())}
    ragckpt.write_global(state, str(tmp_path / "ck"), 3, layout)
    _conforms(str(tmp_path / "ck"), state)


@pytest.mark.parametrize("layout", ["row", "element", "ragged"])
def test_many_chunks_and_blocks_conform(tmp_path, layout):
    """Small blocks and chunks: several objects per rank, blocks that are not a multiple of the
    element size, zero-padded last chunks."""
    state = {"a": special_tensor((301, 37), torch.float32), "b": special_tensor((1001, 3), torch.bfloat16),
             "c": special_tensor((999,), torch.int8), "d": special_tensor((517,), torch.bool),
             "s": special_tensor((), torch.float32)}
    ragckpt.write_global(state, str(tmp_path / "ck"), 5, layout, block_bytes=96, max_chunk_bytes=288)
    _conforms(str(tmp_path / "ck"), state)


def test_engine_save_with_moments_steps_and_extras_conforms(tmp_path):
    W = 3
    params = {"w": special_tensor((10, 7), torch.float32, 1), "b": special_tensor((7,), torch.float32, 2)}
    state = dict(params)
    lay = ragckpt.CheckpointLayout.build({k: (tuple(v.shape), "float32") for k, v in params.items()}, W, "ragged")
    for key in ("exp_avg", "exp_avg_sq"):
        names = [f"optim.state.{n}.{key}" for n in params]
        lay = lay.with_buffer(f"optim.{key}", "float32", like="float32", tensors=names)
        state.update({n: special_tensor(tuple(params[n.split(".")[2]].shape), torch.float32, 3) for n in names})
    steps = {f"optim.state.{n}.step": torch.tensor(100.0 + i) for i, n in enumerate(params)}
    lay = lay.with_tensors("optim.step", {n: ((), "float32") for n in steps}, granularity="whole")
    state.update(steps)
    url = str(tmp_path / "ck")
    for rank in range(W):
        bufs = {}
        for bi, spec in enumerate(lay.buffers):
            flat = torch.zeros(int(lay.rank_sizes(bi)[rank]))
            seg = lay.layout_of(bi).rank_segments(rank)
            for i in range(len(seg)):
                o, fs, n = int(seg.offset[i]), int(seg.flat_start[i]), int(seg.length[i])
                flat[o : o + n] = state[spec.tensors[int(seg.slot[i])]].reshape(-1)[fs : fs + n]
            bufs[spec.name] = flat
        ragckpt.save_shard(url, rank, bufs, lay, user={"step": 7}, save_id="s7",
                           extra={"rng": torch.tensor([rank, -1])} if rank != 1 else None,
                           extra_meta={"pos": str(rank)} if rank != 1 else None)
    ragckpt.commit(url)
    r = _conforms(url, state)
    assert r.user == {"step": 7}
    for rank in range(W):
        got = r.extra(rank)
        if rank == 1:
            assert got is None or got[0] == {}
        else:
            tensors, meta = got
            assert tensors["rng"].tolist() == [rank, -1] and meta == {"pos": str(rank)}


def test_resharded_output_conforms(tmp_path):
    state = odd_state()
    ragckpt.write_global(state, str(tmp_path / "a"), 5, "ragged")
    ragckpt.reshard.reshard(str(tmp_path / "a"), str(tmp_path / "b"), 2, layout="row")
    _conforms(str(tmp_path / "b"), state)


def test_the_spec_reader_sees_damage_and_missing_commits(tmp_path):
    state = {"w": special_tensor((64, 8), torch.float32)}
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, 2, "row")
    chunk = tmp_path / "ck" / "buffers" / "0" / "c.1.0"
    raw = bytearray(chunk.read_bytes())
    raw[5] ^= 0x10
    chunk.write_bytes(bytes(raw))
    assert any("crc32c mismatch" in p for p in SpecReader(url).verify())
    assert not ragckpt.open(url).verify().ok  # ragckpt agrees
    os.unlink(tmp_path / "ck" / "COMMITTED")
    assert not SpecReader(url).committed
