"""Bad input: every failure is one clear error naming the object, tensor or rank; nothing is lost."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ragckpt
from ragckpt import FormatError, IntegrityError, LayoutError, NotCommittedError
from ragckpt.errors import RagckptError, StorageError
from ragckpt.storage.checksum import crc32c
from tests.helpers import assert_bit_equal, special_tensor, spy_read_sizes


@pytest.fixture()
def ck_path(tmp_path):
    state = {"w": special_tensor((40, 8), torch.float32), "b": special_tensor((8,), torch.bfloat16, 1)}
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, 4, "row", block_bytes=256)
    return tmp_path / "ck", state


def _chunk(path, rank=1):
    return path / "buffers" / "0" / f"c.{rank}.0"


def test_flipped_byte_is_caught_on_read_and_verify(ck_path):
    path, _ = ck_path
    f = _chunk(path)
    raw = bytearray(f.read_bytes())
    raw[100] ^= 0x01
    f.write_bytes(bytes(raw))
    ck = ragckpt.open(str(path))
    with pytest.raises(IntegrityError, match=r"checksum mismatch in .*buffers/0/c\.1\.0 .*rank 1"):
        ck.read("w")
    # a partial read that touches only healthy blocks still works (per-block checksums)
    assert ck.read_flat("w", 0, 8).numel() == 8
    rep = ck.verify()
    assert not rep.ok and any("buffers/0/c.1.0" in p for p in rep.problems)


def test_truncated_object(ck_path):
    path, _ = ck_path
    f = _chunk(path, 2)
    f.write_bytes(f.read_bytes()[:50])
    ck = ragckpt.open(str(path))
    with pytest.raises(IntegrityError, match=r"buffers/0/c\.2\.0 is truncated"):
        ck.read("w")
    rep = ck.verify()
    assert any("c.2.0" in p and "expected" in p for p in rep.problems)


def test_missing_object(ck_path):
    path, _ = ck_path
    os.remove(_chunk(path, 3))
    ck = ragckpt.open(str(path))
    with pytest.raises(IntegrityError, match=r"buffers/0/c\.3\.0 is missing"):
        ck.read("w")


def test_missing_commit_marker(ck_path):
    path, _ = ck_path
    os.remove(path / "COMMITTED")
    with pytest.raises(NotCommittedError, match="not committed"):
        ragckpt.open(str(path))
    # metadata-only inspection still works, data reads refuse
    ck = ragckpt.open(str(path), allow_uncommitted=True)
    assert not ck.committed and ck.world_size == 4
    with pytest.raises(NotCommittedError):
        ck.read("w")


def test_unknown_format_version(ck_path):
    path, _ = ck_path
    doc = json.loads((path / "zarr.json").read_text())
    doc["attributes"]["ragckpt"]["format_version"] = 99
    raw = json.dumps(doc).encode()
    (path / "zarr.json").write_bytes(raw)
    # a consistent future checkpoint: its marker vouches for the new metadata
    marker = json.loads((path / "COMMITTED").read_text())
    marker["objects_crc32c"]["zarr.json"] = crc32c(raw)
    (path / "COMMITTED").write_text(json.dumps(marker))
    with pytest.raises(FormatError, match="format version 99.*reads version 1"):
        ragckpt.open(str(path))


def test_corrupt_metadata_is_caught_by_the_marker_checksum(ck_path):
    path, _ = ck_path
    doc = json.loads((path / "zarr.json").read_text())
    doc["attributes"]["ragckpt"]["layouts"][0]["shapes"][0] = [41, 8]
    (path / "zarr.json").write_text(json.dumps(doc, indent=1, sort_keys=True))
    with pytest.raises(IntegrityError, match="zarr.json.*metadata is corrupt"):
        ragckpt.open(str(path))


@pytest.mark.parametrize("table", ["meta/crc/0", "meta/units/0", "meta/extra"])
@pytest.mark.parametrize("damage", ["shape", "dtype", "reformatted"])
def test_tampered_table_documents_are_named(ck_path, table, damage):
    # COMMITTED checksums the tables' chunks, not their zarr.json: a wrong shape or dtype there would
    # reinterpret checksummed bytes, so the reader regenerates each document and compares
    path, state = ck_path
    f = path / table / "zarr.json"
    doc = json.loads(f.read_text())
    if damage == "shape":
        doc["shape"][0] -= 1
    elif damage == "dtype":
        doc["data_type"] = "int32" if doc["data_type"] != "int32" else "uint32"
    text = json.dumps(doc, indent=None if damage == "reformatted" else 1, sort_keys=True)
    f.write_text(text)
    with pytest.raises(IntegrityError, match=rf"{table}/zarr.json is not the document of a .* table.*corrupt"):
        ragckpt.open(str(path))


@pytest.mark.parametrize("obj", ["meta/crc/0/c/0", "meta/units/0/zarr.json", "meta/extra/c/0/0"])
@pytest.mark.parametrize("damage", ["deleted", "a directory", "flipped"])
def test_a_damaged_metadata_object_is_named_with_what_to_do(tmp_path, obj, damage):
    """A metadata table gone (or a directory in its place) made every command say only "object X is
    missing"; a flipped one "checksum mismatch ... is corrupt": neither said what to do."""
    url = str(tmp_path / "ck")
    ragckpt.write_global({"w": torch.arange(40.0).reshape(8, 5)}, url, 3, "row")  # row: it has meta/units
    f = tmp_path / "ck" / obj
    raw = f.read_bytes()
    f.unlink()
    if damage == "a directory":
        f.mkdir()
    elif damage == "flipped":
        f.write_bytes(bytes([raw[0] ^ 1]) + raw[1:])
    want = {"deleted": f"{f} is missing", "a directory": f"{f} is a directory", "flipped": str(f)}[damage]
    for opener in (ragckpt.open, lambda u: ragckpt.open(u).verify()):
        with pytest.raises(RagckptError) as e:
            opener(url)
        msg = str(e.value)
        assert want in msg and ("restore" in msg or "re-save" in msg), msg
        assert not isinstance(e.value, StorageError) or damage == "flipped", msg


def test_empty_buffer_lists_no_absent_table_objects(tmp_path):
    state = {"empty": torch.zeros(0, 3, dtype=torch.float16), "w": torch.arange(6, dtype=torch.float32)}
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, 3, "row")
    marker = json.loads((tmp_path / "ck" / "COMMITTED").read_text())
    assert "meta/crc/0/c/0" not in marker["objects_crc32c"]  # buffer 0 (float16) holds nothing
    assert "meta/crc/1/c/0" in marker["objects_crc32c"]
    # every object the marker checksums exists, and matches
    for key, want in marker["objects_crc32c"].items():
        assert crc32c((tmp_path / "ck" / key).read_bytes()) == want, key
    ck = ragckpt.open(url)
    assert ck.verify().ok
    assert_bit_equal(ck.read("empty"), state["empty"])


def test_unknown_dtype_in_metadata(ck_path):
    path, _ = ck_path
    os.remove(path / "COMMITTED")
    doc = json.loads((path / "zarr.json").read_text())
    doc["attributes"]["ragckpt"]["buffers"][0]["dtype"] = "complex32"
    (path / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="unknown dtype 'complex32'"):
        ragckpt.open(str(path), allow_uncommitted=True)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FormatError, match="no ragckpt checkpoint"):
        ragckpt.open(str(tmp_path))


def test_save_shard_rejects_wrong_dtype_size_and_rank(tmp_path):
    lay = ragckpt.CheckpointLayout.build({"w": ((10, 2), "float32")}, 2, "row")
    url = str(tmp_path / "ck")
    with pytest.raises(LayoutError, match=r"rank 0: buffer 'float32' has dtype bfloat16, layout says float32"):
        ragckpt.save_shard(url, 0, {"float32": torch.zeros(10, dtype=torch.bfloat16)}, lay)
    with pytest.raises(LayoutError, match=r"rank 1: buffer 'float32' has 9 elements, layout says 10"):
        ragckpt.save_shard(url, 1, {"float32": torch.zeros(9)}, lay)
    with pytest.raises(LayoutError, match="rank 2 is outside the layout's world size 2"):
        ragckpt.save_shard(url, 2, {"float32": torch.zeros(10)}, lay)
    with pytest.raises(LayoutError, match="buffer 'float32' is missing"):
        ragckpt.save_shard(url, 1, {}, lay)


def test_commit_names_missing_ranks(tmp_path):
    lay = ragckpt.CheckpointLayout.build({"w": ((10, 2), "float32")}, 3, "row")
    url = str(tmp_path / "ck")
    ragckpt.save_shard(url, 0, {"float32": torch.zeros(8)}, lay)
    with pytest.raises(FormatError, match=r"2 of 3 ranks have not finished saving \(ranks 1, 2\)"):
        ragckpt.commit(url)
    with pytest.raises(NotCommittedError):
        ragckpt.open(url)


def test_second_commit_loses(tmp_path):
    """A second commit (a retried commit step, the loser of two racing committers) is refused before
    it writes anything: re-writing the tables under a committed checkpoint's readers tore them, and
    a crash right then left COMMITTED beside an empty table."""
    url = str(tmp_path / "ck")
    ragckpt.write_global({"a": torch.ones(4)}, url, 2)
    meta = tmp_path / "ck/meta"
    before = {p: (p.stat().st_mtime_ns, p.stat().st_ino, p.read_bytes()) for p in meta.rglob("*") if p.is_file()}
    with pytest.raises(ragckpt.DestinationExistsError, match="already committed; nothing to do"):
        ragckpt.commit(url)
    assert {p: (p.stat().st_mtime_ns, p.stat().st_ino, p.read_bytes()) for p in meta.rglob("*") if p.is_file()} == before
    with pytest.raises(ragckpt.DestinationExistsError, match="already committed"):
        lay = ragckpt.open(url).layout
        ragckpt.save_shard(url, 0, {"float32": torch.zeros(2)}, lay)


def test_unknown_tensor_name(ck_path):
    path, _ = ck_path
    with pytest.raises(KeyError, match="tensor 'nope' is not in this checkpoint"):
        ragckpt.open(str(path)).read("nope")


def test_crash_mid_save_leaves_an_unmistakably_incomplete_checkpoint(tmp_path):
    """A writer dying half way (here: its data source fails on rank 5 of 8) leaves no marker: readers
    refuse it, `info` says so, and a rerun replaces it."""
    from click.testing import CliRunner

    from cli.main import cli
    from ragckpt.checkpoint.writer import write_streaming

    state = {"w": special_tensor((64, 4), torch.float32)}
    lay = ragckpt.CheckpointLayout.build({"w": ((64, 4), "float32")}, 8, "row")
    url = str(tmp_path / "ck")
    flat = state["w"].reshape(-1)

    def fill_for(bi, rank):
        start = int(lay.rank_sizes(0)[:rank].sum())

        def fill(lo, hi):
            if rank == 5:
                raise OSError("simulated crash while writing rank 5")
            return ragckpt.format.dtypes.as_bytes(flat[start + lo : start + hi].clone())
        return fill

    with pytest.raises(OSError, match="simulated crash"):
        write_streaming(url, lay, fill_for, workers=1)
    with pytest.raises(NotCommittedError, match="not committed"):
        ragckpt.open(url)
    r = CliRunner().invoke(cli, ["info", url])
    assert r.exit_code == 0 and "NOT COMMITTED" in r.output
    with pytest.raises(FormatError, match=r"have not finished saving \(ranks 5"):
        ragckpt.commit(url)  # nobody can commit it by accident either
    ragckpt.write_global(state, url, 8, "row", overwrite=True)
    assert_bit_equal(ragckpt.open(url).read("w"), state["w"])


@pytest.fixture()
def rank_ck(tmp_path):
    """Two ranks of 2.5 KiB fp32 buffers, checksummed in 256-byte blocks, one object per rank."""
    state = {"w": special_tensor((40, 32), torch.float32)}
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, 2, "row", block_bytes=256)
    return tmp_path / "ck"


def test_in_place_rank_read_names_the_corrupt_block(rank_ck):
    # the engine's restore path verifies each block as it lands: the error names the first bad one
    f = _chunk(rank_ck, 1)
    raw = bytearray(f.read_bytes())
    raw[3 * 256 + 10] ^= 0x40
    f.write_bytes(bytes(raw))
    ck = ragckpt.open(str(rank_ck))
    out = torch.empty(int(ck.layout.rank_sizes(0)[1]), dtype=torch.float32)
    with pytest.raises(IntegrityError, match=r"checksum mismatch in .*buffers/0/c\.1\.0 .*rank 1, block 3\)"):
        ck.read_rank(0, 1, out=out)
    # an aligned range that ends before the bad block reads fine
    ck.read_rank(0, 1, 0, 3 * 64, out=out[: 3 * 64])
    assert_bit_equal(out[: 3 * 64], ck.read_flat("w", 640, 640 + 3 * 64), "rank 1 blocks 0-2")


def test_in_place_rank_read_of_a_truncated_or_missing_object(rank_ck):
    ck = ragckpt.open(str(rank_ck))
    out = torch.empty(int(ck.layout.rank_sizes(0)[0]), dtype=torch.float32)
    f = _chunk(rank_ck, 0)
    f.write_bytes(f.read_bytes()[:700])
    with pytest.raises(IntegrityError, match=r"buffers/0/c\.0\.0 is truncated: wanted bytes \[0, 2560\), file ends at 700"):
        ck.read_rank(0, 0, out=out)
    os.remove(f)
    with pytest.raises(IntegrityError, match=r"buffers/0/c\.0\.0 is missing"):
        ck.read_rank(0, 0, out=out)


def test_verify_streams_large_objects_and_checks_their_padding(tmp_path, monkeypatch):
    # ranks of 4.5 MiB in 3 MiB objects: verify reads at most `fetch_bytes` at a time whatever the
    # object size, and still finds a flipped byte deep inside an object and dirt in the edge padding
    from ragckpt.storage.base import LOCAL_FETCH_BYTES
    from ragckpt.storage.store import LocalStore

    url = str(tmp_path / "ck")
    state = {"w": torch.arange(9 * 2**18, dtype=torch.int32)}
    ragckpt.write_global(state, url, 2, "element", max_chunk_bytes=3 << 20)
    reads = spy_read_sizes(monkeypatch, LocalStore)
    ck = ragckpt.open(url)
    assert ck.layout.rank_sizes(0).tolist() == [9 << 17, 9 << 17]
    assert ck.verify().ok and max(reads) <= LOCAL_FETCH_BYTES and sum(reads) == 12 << 20
    obj = tmp_path / "ck" / "buffers" / "0" / "c.0.1"  # rank 0's second object: 1.5 MiB of data, then padding
    raw = bytearray(obj.read_bytes())
    raw[(3 << 20) - 1] = 1
    obj.write_bytes(bytes(raw))
    assert ragckpt.open(url).verify().problems == [
        f"{url}/buffers/0/c.0.1: non-zero bytes in the edge padding (buffer 'int32', rank 0)"]
    raw[(3 << 20) - 1] = 0
    raw[(1 << 20) + 5] ^= 0x10
    obj.write_bytes(bytes(raw))
    assert ragckpt.open(url).verify().problems == [
        f"{url}/buffers/0/c.0.1: checksum mismatch (buffer 'int32', rank 0)"]


@pytest.mark.parametrize("crash_at", [1, 2, 3])
def test_overwrite_interrupted_while_deleting_leaves_no_committed_checkpoint(tmp_path, monkeypatch, crash_at):
    """`overwrite` removes the old commit marker (durably) before anything else: a crash while the
    old objects are being deleted leaves an uncommitted checkpoint, never a committed one with
    objects missing. Here the process 'dies' after removing `crash_at` directories. (The in-place
    path: a local destination with room for both is set aside instead, see test_durability.py.)"""
    import shutil

    from ragckpt.storage import destination

    monkeypatch.setattr(destination.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 1 << 40, 0))
    state = {"w": special_tensor((64, 8), torch.float32), "b": special_tensor((9,), torch.bfloat16)}
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, 3)
    real, calls = shutil.rmtree, []
    real_unlink, removed = os.unlink, []

    def rmtree(path, *a, **k):
        real(path, *a, **k)
        removed.append(os.path.basename(path))
        calls.append(path)
        if len(calls) == crash_at:
            raise OSError("simulated crash while deleting")

    def unlink(path, *a, **k):
        real_unlink(path, *a, **k)
        removed.append(os.path.basename(path))

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(OSError, match="simulated crash") as e:
        ragckpt.write_global(state, url, 2, overwrite=True)
    monkeypatch.undo()
    assert e.value.ragckpt_note == f"the previous contents of {url} were deleted by --overwrite"
    assert removed[0] == "COMMITTED"  # first, whatever order the directory lists its entries in
    assert not os.path.exists(tmp_path / "ck/COMMITTED")
    with pytest.raises((NotCommittedError, FormatError)):  # uncommitted, or no longer a checkpoint at all
        ragckpt.open(url)
    ragckpt.write_global(state, url, 2, overwrite=True)
    for k, v in state.items():
        assert_bit_equal(ragckpt.open(url).read(k), v)
