"""Sizes that would fill memory: a world size past the format's limit is refused before anything of
that size is allocated, a legal checkpoint whose decoded units table is gigabytes is summarised
without decoding it, and running out of memory anyway is one clear line from the CLI."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import ragckpt
from ragckpt.checkpoint import manifest as mf
from ragckpt.checkpoint import reader as reader_mod
from ragckpt.checkpoint.writer import write_table
from ragckpt.errors import FormatError
from ragckpt.format.placement import MAX_WORLD_SIZE
from ragckpt.planner.state import BufferSpec
from ragckpt.storage.checksum import crc32c
from ragckpt.storage.store import open_store

ROOT = Path(__file__).resolve().parents[2]
#: address space for the capped children: enough for torch and numpy to import, far below what a
#: 10**9-rank table (8 GB per tensor) or the bomb's decoded units table (8 GiB) takes
CAP_BYTES = 3 << 30


def _run_capped(code: str, cap: int = CAP_BYTES, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a child Python whose address space is capped at `cap` bytes."""
    prelude = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


CALLS = {
    "write_global": "ragckpt.write_global({'w': torch.zeros(4, 4)}, DST, world_size=W)",
    "write_global row": "ragckpt.write_global({'w': torch.zeros(4, 4)}, DST, world_size=W, layout='row')",
    "build ragged": "CheckpointLayout.build({'w': ((4, 4), 'float32')}, W)",
    "build row": "CheckpointLayout.build({'w': ((4, 4), 'float32'), 'b': ((3,), 'float32')}, W, 'row')",
    "build element": "CheckpointLayout.build({'w': ((4, 4), 'float32')}, W, 'element')",
    "row_layout": "L.row_layout([(4, 4)] * 8, W)",
    "element_layout": "L.element_layout([(4, 4)], W)",
    "FlatLayout": "L.FlatLayout(W, 16, ((4, 4),), (1,), (0,))",
    "PerTensorLayout": "L.PerTensorLayout(W, ((4, 4),), (1,), np.zeros((1, 1), dtype=np.int64))",
    "plan": "planner.plan([16] * 8, [4] * 8, W)",
    "plan_layout": "planner.plan_layout(['w'], [(4, 4)], W)",
    "RaggedShard.whole": "P.RaggedShard.whole(W)",
    "RaggedShard.row_chunks": "P.RaggedShard.row_chunks((4, 4), W)",
    "RaggedShard.flat_partition": "P.RaggedShard.flat_partition([(4, 4)], W)",
    "chunk_sizes": "P.chunk_sizes(4, W)",
}


def test_a_world_size_past_the_limit_is_refused_before_anything_is_allocated(tmp_path):
    """Every constructor a user can call, with world size 10**9 in a process that may not use more
    than a few GiB: one LayoutError each (before, the per-rank tables filled memory first)."""
    body = "\n".join(f"""
try:
    {call}
    print({name!r}, "NO ERROR")
except LayoutError as e:
    print({name!r}, "LayoutError", str(e))
""" for name, call in CALLS.items())
    p = _run_capped(f"""
import numpy as np, torch, ragckpt
from ragckpt.errors import LayoutError
from ragckpt.format import layout as L, placement as P
from ragckpt.planner.state import CheckpointLayout
from ragckpt.planner import planner
W, DST = 10**9, {str(tmp_path / "ck")!r}
{body}
with_tensors = CheckpointLayout.build({{'w': ((4, 4), 'float32')}}, {MAX_WORLD_SIZE})
print("limit itself", with_tensors.world_size)
""")
    assert p.returncode == 0, p.stderr
    lines = dict(line.split(" ", 1) if line.startswith("limit") else line.rsplit(" LayoutError ", 1)
                 for line in p.stdout.strip().splitlines())
    for name in CALLS:
        assert "1,000,000,000 is above the format's limit of 1,048,576 ranks" in lines[name], (name, p.stdout)
    assert lines["limit"] == f"itself {MAX_WORLD_SIZE}"  # the limit itself is legal
    assert not (tmp_path / "ck").exists()  # refused before the destination was touched


def test_a_placement_with_too_many_ranks_is_refused():
    from ragckpt.errors import LayoutError
    from ragckpt.format.placement import RaggedShard

    with pytest.raises(LayoutError, match="above the format's limit"):
        RaggedShard((0,), (0,) * (MAX_WORLD_SIZE + 1))


def _zstd_zeros(nbytes: int) -> bytes:
    """A zstd frame (RFC 8878) that decodes to `nbytes` zero bytes, as RLE blocks of 128 KiB: what
    zstd makes of a table of zeros, written without allocating the table."""
    out = [struct.pack("<I", 0xFD2FB528), bytes([0xE0]), struct.pack("<Q", nbytes)]  # single segment, 8-byte size
    block, left = 128 << 10, nbytes
    while left:
        n = min(block, left)
        left -= n
        out.append(((0 if left else 1) | (1 << 1) | (n << 3)).to_bytes(3, "little") + b"\x00")  # RLE of byte 0
    return b"".join(out)


def build_wide_checkpoint(path: str, world_size: int, tensors: int) -> None:
    """A committed row-layout checkpoint of `tensors` zero-size float32 tensors over `world_size` ranks,
    made by writing the same tensors at 2 ranks and re-writing the documents and tables that depend on
    the world size with the writer's own functions (building the (T, W) units table, 8 GiB at the
    issue's size, just to write its zeros, would take a minute). The ranks' records stay those of 2
    ranks: readers never use them."""
    ragckpt.write_global({f"t{i}": torch.zeros(0) for i in range(tensors)}, path, 2, "row")
    root = Path(path)
    m = json.loads((root / "zarr.json").read_text())["attributes"]["ragckpt"]
    m["world_size"] = world_size
    m["layouts"][0]["units"]["shape"] = [tensors, world_size]
    root_doc = mf.group_doc({mf.FORMAT_NAME: m})
    (root / "zarr.json").write_bytes(root_doc)
    units = _zstd_zeros(tensors * world_size * 8)
    (root / "meta/units/0/c/0/0").write_bytes(units)
    (root / "meta/units/0/zarr.json").write_bytes(mf.table_array_doc((tensors, world_size), np.dtype(np.int64),
                                                                     compressed=True))
    b = m["buffers"][0]
    spec = BufferSpec(b["name"], b["dtype"], b["layout"], tuple(b["tensors"]))
    ch = mf.chunking(0, spec.dtype, m["max_chunk_bytes"], m["block_bytes"])
    (root / "buffers/0/zarr.json").write_bytes(mf.buffer_array_doc(spec, world_size, 0, ch))
    extra_crc = write_table(open_store(path), "meta/extra", np.full((world_size, 2), -1, dtype=np.int64))
    marker = json.loads((root / mf.COMMIT_KEY).read_text())
    marker["world_size"] = world_size
    marker["objects_crc32c"] = {mf.ROOT_META_KEY: crc32c(root_doc), "meta/units/0/c/0/0": crc32c(units),
                                "meta/extra/c/0/0": extra_crc}
    (root / mf.COMMIT_KEY).write_text(json.dumps(marker, indent=1))


def test_the_wide_checkpoint_builder_makes_a_checkpoint_ragckpt_reads(tmp_path):
    """The cheap builder, at a size whose table is read at open, against a dense reference."""
    url = str(tmp_path / "ck")
    build_wide_checkpoint(url, 16, 5)
    ck = ragckpt.open(url)
    assert ck.world_size == 16 and ck.names() == [f"t{i}" for i in range(5)]
    assert ck.layout.layouts[0].units.shape == (5, 16) and not ck.layout.layouts[0].units.any()
    assert ck.read("t3").shape == (0,)


def _peak_rss_of(args: list[str]) -> tuple[int, int, str, str]:
    """Run the `ragckpt` command with `args` in a child; its exit code, peak RSS in bytes (its own,
    from wait4), stdout and stderr."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen([sys.executable, "-m", "cli.main", *args], cwd=ROOT, stdout=out, stderr=err)
        try:
            _, status, usage = os.wait4(p.pid, 0)
        finally:
            p.returncode = 0  # reaped by wait4
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024, out.read().decode(), err.read().decode()


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("wide") / "ck")
    build_wide_checkpoint(url, MAX_WORLD_SIZE, 1000)
    return url


def test_info_and_ls_of_a_checkpoint_with_a_huge_units_table_read_only_what_they_print(wide_checkpoint, tmp_path):
    """World size 1,048,576 and 1,000 zero-size tensors: a 256 KB units table that decodes to 8 GiB.
    `info` and `ls -l` took 30 s and 8 GiB decoding it; what they print follows from the shapes."""
    tiny = str(tmp_path / "tiny")
    ragckpt.write_global({"w": torch.zeros(3, 2)}, tiny, 2, "row")
    code, base, out, err = _peak_rss_of(["info", "--json", tiny])
    assert code == 0, err
    code, peak, out, err = _peak_rss_of(["info", "--json", wide_checkpoint])
    assert code == 0, err
    s = json.loads(out)
    assert (s["world_size"], s["tensors"], s["bytes"], s["data_bytes"], s["padding_bytes"], s["layout"]) == \
        (MAX_WORLD_SIZE, 1000, 0, 0, 0, "row")
    assert peak - base < 256 << 20, (peak, base)
    code, peak, out, err = _peak_rss_of(["ls", "-l", "--json", wide_checkpoint])
    assert code == 0, err
    rows = json.loads(out)
    assert len(rows) == 1000 and rows[7] == {"name": "t7", "shape": [0], "dtype": "float32", "bytes": 0,
                                             "buffer": "float32", "dims": 1}
    assert peak - base < 256 << 20, (peak, base)


def test_running_out_of_memory_is_one_line_from_the_cli(wide_checkpoint):
    """verify does need the units table (it checks every rank's objects): under a memory cap that
    is an allocation failure, which the CLI printed as "internal error (MemoryError: )"."""
    p = _run_capped(f"""
import sys
from cli.main import main
sys.argv = ["ragckpt", "verify", {wide_checkpoint!r}]
main()
""")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    assert lines[0].startswith("error: out of memory:") and "internal error" not in lines[0], lines


def test_a_deferred_units_table_that_breaks_the_layout_is_refused_when_read(tmp_path, monkeypatch):
    """A table too large to read at open is checked when first used: units that do not cover their
    tensor (checksums recomputed to match, as a forger would) are a FormatError naming the table."""
    url = str(tmp_path / "ck")
    ragckpt.write_global({"w": torch.arange(24.0).reshape(6, 4), "b": torch.ones(3)}, url, 3, "row")
    from numcodecs import Zstd

    bad = np.array([[2, 2, 3], [1, 1, 1]], dtype=np.int64)  # 7 rows for a 6-row tensor
    raw = bytes(Zstd(level=3).encode(bad))
    (tmp_path / "ck/meta/units/0/c/0/0").write_bytes(raw)
    marker = json.loads((tmp_path / "ck/COMMITTED").read_text())
    marker["objects_crc32c"]["meta/units/0/c/0/0"] = crc32c(raw)
    (tmp_path / "ck/COMMITTED").write_text(json.dumps(marker))
    with pytest.raises(FormatError, match="inconsistent layout"):
        ragckpt.open(url)  # read at open: the table is small
    monkeypatch.setattr(reader_mod, "EAGER_TABLE_BYTES", 0)
    ck = ragckpt.open(url)  # deferred: what needs no table still works
    assert ck.names() == ["w", "b"] and ck.meta("w").sharded_dims == 1
    with pytest.raises(FormatError, match=r"meta/units/0 describes an inconsistent layout \(tensor #0 .*units "
                                          r"cover 28 elements, expected 24\).*corrupt"):
        ck.read("w")
    with pytest.raises(FormatError, match="meta/units/0 describes an inconsistent layout"):
        ck.verify()


def test_a_deferred_units_table_reads_and_verifies_as_one_read_at_open(tmp_path, monkeypatch):
    url = str(tmp_path / "ck")
    state = {"w": torch.arange(24.0).reshape(6, 4), "b": torch.arange(3, dtype=torch.int16)}
    ragckpt.write_global(state, url, 4, "row")
    monkeypatch.setattr(reader_mod, "EAGER_TABLE_BYTES", 0)
    ck = ragckpt.open(url)
    assert ck.layout.layouts[0].pending and ck.layout.total_bytes() == 24 * 4 + 3 * 2
    for name, t in state.items():
        assert torch.equal(ck.read(name), t)
    assert not ck.layout.layouts[0].pending
    assert ck.verify().ok
    (tmp_path / "ck/meta/units/0/c/0/0").write_bytes(b"not zstd")
    with pytest.raises(ragckpt.IntegrityError, match="meta/units/0/c/0/0"):
        ragckpt.open(url)
