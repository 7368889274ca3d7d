"""Checkpoints on S3 (moto over real HTTP) are bit-identical to checkpoints on a local disk: same
objects, same bytes, same tensors on load, same results of load-time resharding; uncommitted saves
are ignored; of two racing committers exactly one wins."""

from __future__ import annotations

import threading

import pytest
import torch

import ragckpt
from ragckpt.checkpoint.writer import write_streaming
from ragckpt.errors import DestinationExistsError, NotCommittedError, StorageError
from ragckpt.format.dtypes import dtype_name
from ragckpt.storage.store import open_store
from tests.helpers import assert_bit_equal, bits, odd_state, special_tensor, spy_read_sizes
from tests.reshard.test_reshard_exact import expected_rank_buffer

MiB = 1 << 20
#: S3's smallest parts, so every chunk object over 5 MiB goes up as a multipart upload
SMALL_PARTS = {"part_size": 5 * MiB, "multipart_threshold": 5 * MiB}

#: objects whose bytes hold timestamps or hostnames; every other object must match exactly
_VOLATILE = {"zarr.json", "COMMITTED"}


def _state() -> dict[str, torch.Tensor]:
    """Odd shapes and every dtype, plus one 12 MiB tensor so some chunk objects are multipart."""
    state = odd_state()
    state["big.weight"] = special_tensor((3 * 1024, 1024), torch.float32, 5)
    state["emb"] = special_tensor((1000, 37), torch.bfloat16, 6)
    return state


def _with_io(opts: dict, **io) -> dict:
    return {**opts, "ragckpt": {**opts.get("ragckpt", {}), **io}}


def _assert_same_objects(local_url: str, remote_url: str, opts: dict) -> int:
    local, remote = open_store(local_url), open_store(remote_url, opts)
    keys = local.list()
    assert remote.list() == keys
    compared = 0
    for k in keys:
        if k in _VOLATILE:
            continue
        assert remote.read(k) == local.read(k), f"{k} differs between local and S3"
        compared += 1
    return compared


@pytest.mark.slow
def test_write_global_on_s3_matches_local_bit_exact(s3, tmp_path):
    url, opts = s3
    opts = _with_io(opts, **SMALL_PARTS)
    state = _state()
    W = 2
    ragckpt.write_global(state, str(tmp_path / "ck"), W, max_chunk_bytes=9 * MiB)
    ragckpt.write_global(state, f"{url}/ck", W, storage_options=opts, max_chunk_bytes=9 * MiB)
    assert _assert_same_objects(str(tmp_path / "ck"), f"{url}/ck", opts) > 10
    ck = ragckpt.open(f"{url}/ck", storage_options=opts)
    assert ck.committed and ck.url == f"{url}/ck"
    local = ragckpt.open(str(tmp_path / "ck"))
    for name, t in state.items():
        assert_bit_equal(ck.read(name), t, name)
        for r in range(W):
            assert torch.equal(bits(ck.read_local(name, r)), bits(local.read_local(name, r))), (name, r)
    # partial reads: a slice from the middle of the big tensor, across rank and chunk boundaries
    n = state["big.weight"].numel()
    assert torch.equal(bits(ck.read_flat("big.weight", n // 3 - 5, 2 * n // 3 + 7)),
                       bits(state["big.weight"].reshape(-1)[n // 3 - 5 : 2 * n // 3 + 7]))
    # whole rank buffers straight into caller memory (the engine's restore path), block by block
    for bi, b in enumerate(ck.layout.buffers):
        for r in range(W):
            out = torch.empty(int(ck.layout.rank_sizes(bi)[r]), dtype=local.read_rank(bi, r, 0, 0).dtype)
            ck.read_rank(bi, r, out=out)
            assert torch.equal(bits(out), bits(local.read_rank(bi, r))), (b.name, r)
    rep = ck.verify()
    assert rep.ok, rep.problems
    # some chunk objects really went up in parts
    etags = [s3.fs().info(f"{url}/ck/{k}")["ETag"] for k in open_store(f"{url}/ck", opts).list("buffers")]
    assert any("-" in e for e in etags), "expected at least one multipart chunk object"


def test_save_shard_from_rank_threads_then_commit(s3, tmp_path):
    """The engine's path: every rank saves its own flat buffers concurrently, then one commit."""
    url, opts = s3
    state = {"w": special_tensor((301, 17), torch.float32, 1), "b": special_tensor((77,), torch.bfloat16, 2),
             "step": torch.tensor(5, dtype=torch.int64)}
    W = 4
    ragckpt.write_global(state, str(tmp_path / "ck"), W)
    local = ragckpt.open(str(tmp_path / "ck"))
    lay = local.layout
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            bufs = {b.name: local.read_rank(b.name, r) for b in lay.buffers}
            ragckpt.save_shard(f"{url}/ck", r, bufs, lay, extra={"rng": torch.tensor([r, 7])},
                               extra_meta={"pos": str(r)}, storage_options=opts)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with pytest.raises(NotCommittedError):
        ragckpt.open(f"{url}/ck", storage_options=opts)
    ragckpt.commit(f"{url}/ck", storage_options=opts)
    ck = ragckpt.open(f"{url}/ck", storage_options=opts)
    for name, t in state.items():
        assert_bit_equal(ck.read(name), t, name)
    assert ck.extra(2)[0]["rng"].tolist() == [2, 7] and ck.extra(2)[1] == {"pos": "2"}
    assert ck.verify().ok


def test_uncommitted_save_is_ignored_until_commit(s3):
    url, opts = s3
    state = {"w": special_tensor((64, 9), torch.float16, 3)}
    lay = ragckpt.CheckpointLayout.build({"w": ((64, 9), "float16")}, 2, "row")
    flat = state["w"].reshape(-1)
    sizes = lay.rank_sizes(0)

    def fill_for(bi: int, r: int):
        base = int(sizes[:r].sum())
        raw = flat[base : base + int(sizes[r])].contiguous().view(torch.uint8).numpy().data
        return lambda lo, hi: raw[lo * 2 : hi * 2]

    write_streaming(f"{url}/ck", lay, fill_for, storage_options=opts, do_commit=False)
    store = open_store(f"{url}/ck", opts)
    assert store.exists("zarr.json") and not store.exists("COMMITTED")
    with pytest.raises(NotCommittedError, match=f"{url}/ck is not committed"):
        ragckpt.open(f"{url}/ck", storage_options=opts)
    ragckpt.commit(f"{url}/ck", storage_options=opts)
    assert_bit_equal(ragckpt.open(f"{url}/ck", storage_options=opts).read("w"), state["w"])
    # a committed checkpoint is never written into again
    with pytest.raises(DestinationExistsError):
        ragckpt.write_global(state, f"{url}/ck", 2, storage_options=opts)
    with pytest.raises(DestinationExistsError, match="already committed"):
        ragckpt.commit(f"{url}/ck", storage_options=opts)
    ragckpt.write_global(state, f"{url}/ck", 3, storage_options=opts, overwrite=True)
    assert ragckpt.open(f"{url}/ck", storage_options=opts).world_size == 3


@pytest.mark.parametrize("new_world", [2, 5])
def test_load_time_resharding_from_s3_matches_local(s3, tmp_path, new_world):
    """Each rank's buffers equal the local load's and the buffer built from the tensors themselves
    (two loads that both read nothing would agree)."""
    from ragckpt.reshard.load import load

    url, opts = s3
    state = {k: v for k, v in _state().items() if k != "big.weight"}
    ragckpt.write_global(state, str(tmp_path / "ck"), 3)
    ragckpt.write_global(state, f"{url}/ck", 3, storage_options=opts)
    target = ragckpt.CheckpointLayout.build({k: (tuple(v.shape), dtype_name(v.dtype)) for k, v in state.items()},
                                            new_world, "ragged")
    for r in range(new_world):
        got = load(f"{url}/ck", target, r, storage_options=opts)
        want = load(str(tmp_path / "ck"), target, r)
        assert set(got) == set(want) == {b.name for b in target.buffers}
        for i, b in enumerate(target.buffers):
            assert torch.equal(bits(got[b.name]), bits(want[b.name])), (b.name, r)
            assert bits(got[b.name]).numpy().tobytes() == expected_rank_buffer(target, i, r, state), (b.name, r)


def test_missing_chunk_object_is_reported_with_its_url(s3):
    url, opts = s3
    state = {"w": special_tensor((100, 10), torch.float32, 4)}
    ragckpt.write_global(state, f"{url}/ck", 2, storage_options=opts)
    store = open_store(f"{url}/ck", opts)
    victim = next(k for k in store.list("buffers") if "/c." in k)
    s3.fs().rm(f"{url}/ck/{victim}")
    ck = ragckpt.open(f"{url}/ck", storage_options=opts)
    with pytest.raises(ragckpt.IntegrityError, match=f"{url}/ck/{victim}"):
        ck.read("w")
    rep = ck.verify()
    assert not rep.ok and any(f"{url}/ck/{victim}" in p for p in rep.problems)


def test_concurrent_committers_exactly_one_wins(s3_faulty):
    """Two jobs finish the same checkpoint and commit at the same moment: the conditional PUT lets
    exactly one marker land; the loser gets DestinationExistsError and the marker is the winner's."""
    url, opts, proxy, direct = s3_faulty
    state = {"w": special_tensor((50, 8), torch.float32, 8)}
    lay = ragckpt.CheckpointLayout.build({"w": ((50, 8), "float32")}, 2, "row")
    sizes = lay.rank_sizes(0)
    flat = state["w"].reshape(-1)

    def fill_for(bi: int, r: int):
        base = int(sizes[:r].sum())
        raw = flat[base : base + int(sizes[r])].contiguous().view(torch.uint8).numpy().data
        return lambda lo, hi: raw[lo * 4 : hi * 4]

    proxy.configure(serialize_conditional=True)
    for attempt in range(3):
        ck_url = f"{url}/race{attempt}"
        write_streaming(ck_url, lay, fill_for, storage_options=opts, do_commit=False)
        outcomes = _race_commits(ck_url, opts)
        assert sorted(outcomes) == ["lost", "won"], outcomes
        assert_bit_equal(ragckpt.open(f"{direct.url}/race{attempt}", storage_options=direct.storage_options).read("w"),
                         state["w"])


def _race_commits(ck_url: str, opts: dict) -> list[str]:
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def committer() -> None:
        barrier.wait()
        try:
            ragckpt.commit(ck_url, storage_options=opts)
            outcomes.append("won")
        except DestinationExistsError as e:
            outcomes.append("lost" if f"{ck_url}/COMMITTED already exists" in str(e) else f"bad message: {e}")
        except BaseException as e:  # noqa: BLE001 - reported by the caller's assertion
            outcomes.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=committer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def test_commit_whose_reply_was_lost_is_still_ours(s3_faulty):
    """The marker PUT lands but the connection dies before the reply: the retry meets '412
    Precondition Failed'. The marker holds our bytes, so the commit succeeded and must say so."""
    url, opts, proxy, direct = s3_faulty
    state = {"w": special_tensor((20, 20), torch.bfloat16, 9)}
    lay = ragckpt.CheckpointLayout.build({"w": ((20, 20), "bfloat16")}, 1, "row")
    raw = state["w"].reshape(-1).view(torch.uint8).numpy().data
    write_streaming(f"{url}/ck", lay, lambda bi, r: (lambda lo, hi: raw[lo * 2 : hi * 2]),
                    storage_options=opts, do_commit=False)
    proxy.configure(lose_reply=True, methods={"PUT"}, path_regex="/COMMITTED", max_faults_per_request=1)
    ragckpt.commit(f"{url}/ck", storage_options=opts)
    assert proxy.stats.lost_replies == 1
    assert_bit_equal(ragckpt.open(f"{direct.url}/ck", storage_options=direct.storage_options).read("w"), state["w"])
    # a marker with other bytes (another job's) is a lost race, not a success
    store = open_store(f"{url}/other", opts)
    proxy.configure()
    store.write("COMMITTED", [b"theirs"], create_only=True)
    proxy.configure(lose_reply=True, methods={"PUT"}, path_regex="/other/COMMITTED", max_faults_per_request=1)
    with pytest.raises(DestinationExistsError):
        store.write("COMMITTED", [b"ours"], create_only=True)


def test_storage_errors_name_the_checkpoint_url(s3):
    url, opts = s3
    with pytest.raises(StorageError, match="bucket 'missing-bucket-x' does not exist"):
        ragckpt.write_global({"w": torch.ones(3)}, "s3://missing-bucket-x/ck", 1, storage_options=opts)
    with pytest.raises(ragckpt.FormatError, match=f"no ragckpt checkpoint at {url}/nothing"):
        ragckpt.open(f"{url}/nothing", storage_options=opts)


def test_load_fetches_in_batches_sized_for_the_store(s3, tmp_path):
    """Object stores need many requests in flight: load-time resharding from S3 asks for two
    multipart parts' worth of ranges at once, local files are read in 4 MiB batches."""
    from ragckpt.reshard.gather import GatherStats
    from ragckpt.reshard.load import load
    from ragckpt.reshard.plan import target_layout

    url, opts = s3
    opts = _with_io(opts, part_size=8 * MiB)
    state = {"w": special_tensor((4096, 1024), torch.float32, 1)}  # 16 MiB, 4 MiB per source rank
    ragckpt.write_global(state, f"{url}/ck", 4, "row", storage_options=opts)
    ragckpt.write_global(state, str(tmp_path / "ck"), 4, "row")
    assert open_store(f"{url}/ck", opts).fetch_bytes == 16 * MiB
    assert open_store(str(tmp_path / "ck")).fetch_bytes == 4 * MiB
    target = target_layout(ragckpt.open(str(tmp_path / "ck")).layout, 1, "row")
    remote, local = GatherStats(), GatherStats()
    got = load(f"{url}/ck", target, 0, storage_options=opts, stats=remote)
    want = load(str(tmp_path / "ck"), target, 0, stats=local)
    assert torch.equal(bits(got["float32"]), bits(state["w"].reshape(-1)))
    assert torch.equal(bits(want["float32"]), bits(state["w"].reshape(-1)))
    assert remote.read_calls == 1 and remote.requests == 4  # four ranges in flight together
    assert local.read_calls == 4


def test_every_spelling_of_the_source_prefix_counts_as_the_source(s3):
    """`s3a://`, an upper-case scheme and doubled slashes open the same prefix as `s3://`; the
    overlap check compared URL text, so `reshard SRC <alias> --overwrite` deleted its own source."""
    from ragckpt.errors import DestinationError
    from ragckpt.reshard.offline import reshard

    url, opts = s3.url, s3.storage_options
    src = f"{url}/ck"
    state = {"w": special_tensor((100, 10), torch.float32, 3)}
    ragckpt.write_global(state, src, 2, storage_options=opts)
    bucket_and_prefix = src.split("://", 1)[1]
    bucket, prefix = bucket_and_prefix.split("/", 1)
    for alias in (f"s3a://{bucket_and_prefix}", f"S3://{bucket_and_prefix}", f"s3://{bucket}//{prefix}/",
                  f"s3a://{bucket_and_prefix}/inside"):
        with pytest.raises(DestinationError, match="overlaps the source"):
            reshard(src, alias, 1, overwrite=True, storage_options=opts)
    assert_bit_equal(ragckpt.open(src, storage_options=opts).read("w"), state["w"])
    reshard(src, f"s3a://{bucket_and_prefix}2", 1, storage_options=opts)  # a sibling prefix is no overlap
    assert_bit_equal(ragckpt.open(f"{src}2", storage_options=opts).read("w"), state["w"])


def test_commit_removes_an_earlier_attempts_strays_on_s3(s3):
    """As on local disks: a retry with a smaller layout leaves no stale chunk or extras object in
    the committed checkpoint (deleted in DeleteObjects batches)."""
    url, W = f"{s3.url}/ck", 6
    lay_a = ragckpt.CheckpointLayout.build({"w": ((12, 2), "float32")}, W, "row")
    for r in range(W):
        ragckpt.save_shard(url, r, {"float32": torch.full((int(lay_a.rank_sizes(0)[r]),), float(r))}, lay_a,
                           extra={"rng": torch.tensor([r])}, storage_options=s3.storage_options, save_id="a")
    lay_b = ragckpt.CheckpointLayout.build({"w": ((3, 2), "float32")}, W, "row")
    w = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    sizes = lay_b.rank_sizes(0)
    for r in range(W):
        start = int(sizes[:r].sum())
        ragckpt.save_shard(url, r, {"float32": w.reshape(-1)[start : start + int(sizes[r])].clone()}, lay_b,
                           storage_options=s3.storage_options, save_id="b")
    ragckpt.commit(url, storage_options=s3.storage_options)
    keys = open_store(url, s3.storage_options).list("")
    assert [k for k in keys if k.startswith("buffers/0/c.")] == ["buffers/0/c.0.0", "buffers/0/c.1.0", "buffers/0/c.2.0"]
    assert not [k for k in keys if k.startswith("extra/")]
    ck = ragckpt.open(url, storage_options=s3.storage_options)
    assert ck.verify().ok and torch.equal(ck.read("w"), w)


@pytest.mark.parametrize("where", ["s3", "local"])
def test_verify_holds_its_memory_budget_across_threads(s3, tmp_path, where, monkeypatch):
    """Each verify thread streams objects through one buffer of the store's fetch size: on S3 two
    32 MiB parts, so 16 threads held 1 GiB whatever the budget (a helper measured 513 MiB above the
    baseline for 8 threads on a 512 MiB checkpoint). The buffers now share `memory_bytes`."""
    from ragckpt.errors import OptionError
    from ragckpt.storage.remote import S3Store
    from ragckpt.storage.store import LocalStore

    url, opts = (f"{s3.url}/ck", s3.storage_options) if where == "s3" else (str(tmp_path / "ck"), None)
    state = {"w": special_tensor((8, 1 << 20), torch.uint8, 3)}  # 8 MiB: 1 MiB a rank
    state["v"] = special_tensor((4 << 20,), torch.float32, 4)  # 16 MiB more: 2 MiB per rank
    ragckpt.write_global(state, url, 8, "row", storage_options=opts)
    sizes = spy_read_sizes(monkeypatch, S3Store if where == "s3" else LocalStore)
    ck = ragckpt.open(url, storage_options=opts)
    assert ck.verify(workers=4, memory_bytes=4 << 20).ok
    assert sizes and max(sizes) <= 1 << 20, max(sizes)  # 4 MiB over 4 threads: whole 1 MiB blocks
    sizes.clear()
    assert ck.verify(workers=1).ok and max(sizes) > 1 << 20  # one thread may use more of the default budget
    with pytest.raises(OptionError, match="memory budget"):
        ck.verify(memory_bytes=1 << 10)
