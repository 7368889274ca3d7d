"""import-dcp with its DCP input on object storage: `s3://` (the moto server of conftest.py) and
`memory://`. A checkpoint saved by torch's own `dcp.save`, uploaded with plain s3fs (or written there
by torch's FsspecWriter), must import bit for bit as its local copy does, through the Python API and
the CLI, into local and S3 destinations; bad input on S3 must be a one-line error naming the object,
with nothing written at the destination; and record headers must cost a few requests, not a few per
record."""

from __future__ import annotations

import json
import os
import pickle
import random
import uuid
import warnings
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import ragckpt
from ragckpt.convert import dcp as conv
from ragckpt.convert.dcp import import_dcp
from ragckpt.storage.remote import S3Store
from tests.convert.test_dcp import write_grid_dcp
from tests.helpers import assert_bit_equal, cli_run, special_tensor

MODEL = {
    "emb.weight": special_tensor((64, 300), torch.bfloat16, 1),  # 38 KiB: head and tail windows
    "proj.weight": special_tensor((96, 128), torch.float32, 2),  # 48 KiB
    "fp8.weight": special_tensor((33, 7), torch.float8_e4m3fn, 3),
    "ids": special_tensor((17,), torch.int64, 4),
    "mask": special_tensor((5, 3), torch.bool, 5),
    "scale": special_tensor((), torch.float32, 6),  # 0-d
    "empty": special_tensor((0, 4), torch.float16, 7),  # zero-size
    "conv.weight": special_tensor((2, 3, 4, 5), torch.float32, 8).contiguous(memory_format=torch.channels_last),
}
OPTIM = {
    "state": {"proj.weight": {"exp_avg": special_tensor((96, 128), torch.float32, 9), "step": torch.tensor(7.0)}},
    "param_groups": [{"lr": 0.25, "betas": (0.9, 0.95), "weight_decay": 0.0, "params": ["proj.weight"]}],
}
TRAINER = {"epoch": 3, "run": "run7", "lrs": [0.1, 0.05]}  # non-tensor entries


def dcp_save(state: dict, path: Path, threads: int = 2) -> None:
    """torch's own save, single process; two writer threads give two files (`__0_0`, `__0_1`)."""
    with warnings.catch_warnings():  # "no process group: running single-process"
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(str(path), thread_count=threads))


def upload(s3, local: Path, name: str) -> str:
    """Put a local DCP directory under the test bucket with plain s3fs; its s3:// URL."""
    url = f"{s3.url}/{name}"
    fs = s3.fs()
    for f in sorted(os.listdir(local)):
        fs.put_file(str(local / f), f"{url[len('s3://'):]}/{f}")
    return url



def one_line_error(args: list[str], *needles: str) -> str:
    code, out, err = cli_run(*args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, out, err)
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def assert_same_import(got: ragckpt.Checkpoint, want: ragckpt.Checkpoint) -> None:
    """Two imports of one DCP checkpoint: same layout, every tensor's bytes, every non-tensor entry
    (the carried bytes, the readable param-group view, the planner data) identical; only the
    recorded source differs."""
    assert got.world_size == want.world_size
    assert sorted(got.names()) == sorted(want.names())
    for name in want.names():
        assert_bit_equal(got.read(name), want.read(name), name)
    g, w = dict(got.user["dcp"]), dict(want.user["dcp"])
    assert g.pop("source") != w.pop("source")
    assert g == w
    assert got.user.get("optim.param_groups") == want.user.get("optim.param_groups")
    assert got.verify().ok


def assert_matches_state(ck: ragckpt.Checkpoint) -> None:
    """The import holds exactly what was handed to dcp.save (view-as-bytes comparison)."""
    for k, v in MODEL.items():
        assert_bit_equal(ck.read(k), v.contiguous(), k)
    assert_bit_equal(ck.read("optim.state.proj.weight.exp_avg"), OPTIM["state"]["proj.weight"]["exp_avg"])
    assert_bit_equal(ck.read("optim.state.proj.weight.step"), torch.tensor(7.0))
    assert ck.user["optim.param_groups"]["proj.weight"] == {"lr": 0.25, "betas": [0.9, 0.95], "weight_decay": 0.0}
    carried = ck.user["dcp"]["bytes"]
    assert {"trainer.epoch", "trainer.run", "trainer.lrs"} <= set(carried)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dcp_s3") / "dcp"
    dcp_save({"model": MODEL, "optim": OPTIM, "trainer": TRAINER}, d)
    assert sorted(p.name for p in d.iterdir()) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    return d


@pytest.fixture(scope="module")
def local_import(saved: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The reference: the local copy imported at the world sizes the tests use."""
    out = {}
    for w in (1, 3):
        dst = str(tmp_path_factory.mktemp("ref") / f"rag{w}")
        import_dcp(str(saved), dst, world_size=w)
        out[w] = dst
    return out


# -- bit-exact imports -------------------------------------------------------------------------------

def test_python_import_from_s3_equals_local(s3, saved: Path, local_import: dict[int, str], tmp_path: Path) -> None:
    url = upload(s3, saved, "dcp")
    s = import_dcp(url, str(tmp_path / "rag"), world_size=3, storage_options=s3.storage_options)
    assert s.source == url and s.saved_world_size == 1 and s.tensors == len(MODEL) + 2
    got = ragckpt.open(str(tmp_path / "rag"))
    assert got.user["dcp"]["source"] == url
    assert_same_import(got, ragckpt.open(local_import[3]))
    assert_matches_state(got)


def test_cli_import_from_s3_to_s3_equals_local(s3, saved: Path, local_import: dict[int, str]) -> None:
    url = upload(s3, saved, "dcp")
    dst = f"{s3.url}/rag"
    code, out, err = cli_run("import-dcp", url, dst, "--json", *s3.cli_args())
    assert code == 0, err
    s = json.loads(out)
    assert s["source"] == url and s["destination"] == dst and s["world_size"] == 1
    got = ragckpt.open(dst, storage_options=s3.storage_options)
    assert_same_import(got, ragckpt.open(local_import[1]))
    assert_matches_state(got)
    # DST inside the DCP prefix is refused, before anything is written there
    one_line_error(["import-dcp", url, f"{url}/rag", *s3.cli_args()], "overlaps the source")
    assert not s3.fs().find(f"{url[len('s3://'):]}/rag")


def test_box_grids_over_three_rank_files_from_s3(s3, tmp_path: Path) -> None:
    """Chunks cut on every dimension, shuffled over three rank files: each read_flat box is
    intersected with the chunks it overlaps and read by range from the objects."""
    state = {f"model.t{i}": special_tensor(shape, dt, 40 + i) for i, (shape, dt) in enumerate(
        [((7, 6, 5), torch.bfloat16), ((9, 11), torch.float32), ((4, 3, 5, 6), torch.int16),
         ((13,), torch.float8_e4m3fn), ((3, 8), torch.bool), ((300, 40), torch.float32)])}
    write_grid_dcp(state, tmp_path / "grid", 1)
    url = upload(s3, tmp_path / "grid", "grid")
    s = import_dcp(url, str(tmp_path / "rag"), layout="element", storage_options=s3.storage_options)
    assert s.saved_world_size == 3
    ck = ragckpt.open(str(tmp_path / "rag"))
    for k, v in state.items():
        assert_bit_equal(ck.read(k[len("model."):]), v, k)


def test_read_flat_without_the_header_pass(s3, saved: Path) -> None:
    """A chunk read before `check_records` fetches its header windows on the spot."""
    url = upload(s3, saved, "dcp")
    with conv.DcpCheckpoint(url, s3.storage_options) as src:
        out = torch.empty(300 * 7, dtype=torch.bfloat16)
        src.read_flat("model.emb.weight", 300 * 5, 300 * 12, out)
        assert_bit_equal(out, MODEL["emb.weight"].reshape(-1)[300 * 5 : 300 * 12])
        one = torch.empty(1, dtype=torch.float32)
        src.read_flat("model.scale", 0, 1, one)
        assert_bit_equal(one.reshape(()), MODEL["scale"])


def test_memory_url_through_fsspec_store(saved: Path, local_import: dict[int, str], tmp_path: Path) -> None:
    """A memory:// DCP imports like the local copy, and holds what was saved (a reference import
    that lost the data would agree)."""
    fs = fsspec.filesystem("memory")
    root = f"/dcp-{uuid.uuid4().hex[:12]}"
    try:
        for f in os.listdir(saved):
            fs.pipe_file(f"{root}/{f}", (saved / f).read_bytes())
        import_dcp(f"memory://{root}", str(tmp_path / "rag"))
        ck = ragckpt.open(str(tmp_path / "rag"))
        assert_same_import(ck, ragckpt.open(local_import[1]))
        assert_matches_state(ck)
    finally:
        fs.rm(root, recursive=True)


def test_saved_straight_to_s3_by_torchs_fsspec_writer(s3, tmp_path: Path) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    state = {"model": {"w": special_tensor((40, 33), torch.bfloat16, 11), "b": special_tensor((33,), torch.float32, 12)},
             "meta": {"note": "straight to S3"}}
    url = f"{s3.url}/direct"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FsspecWriter(url, **s3.storage_options))
    import_dcp(url, str(tmp_path / "rag"), storage_options=s3.storage_options)
    ck = ragckpt.open(str(tmp_path / "rag"))
    for k, v in state["model"].items():
        assert_bit_equal(ck.read(k), v, k)
    assert "meta.note" in ck.user["dcp"]["bytes"]


# -- few requests -----------------------------------------------------------------------------------

def test_record_headers_and_small_records_cost_few_requests(s3, tmp_path: Path, monkeypatch) -> None:
    """400 small tensors and 30 larger ones, 60 non-tensor entries: the listing, `.metadata`, the
    entries and every record header come in a handful of coalesced requests per file (a request per
    zip read would be thousands), and small records' elements come with their headers."""
    small = {f"s{i}": special_tensor((16,), torch.float32, 100 + i) for i in range(400)}
    mid = {f"m{i}": special_tensor((64, 128), torch.float32, 600 + i) for i in range(30)}  # 32 KiB each
    extra = {f"hp{i}": {"lr": 0.001 * i, "name": f"group{i}"} for i in range(30)}
    dcp_save({"model": {**small, **mid}, "hp": extra}, tmp_path / "dcp")
    url = upload(s3, tmp_path / "dcp", "many")
    gets: list[tuple[str, int | None, int | None]] = []
    real = S3Store._get

    async def counting(self, key, start=None, stop=None, into=None):  # a spy: the real request still runs
        gets.append((key, start, stop))
        return await real(self, key, start, stop, into)

    monkeypatch.setattr(S3Store, "_get", counting)
    with conv.DcpCheckpoint(url, s3.storage_options) as src:
        assert len(gets) == 1 and gets[0][0] == ".metadata"
        raw = src.read_all_bytes()
        assert len(raw) == 60 and len(gets) <= 3  # one coalesced range per file
        before = len(gets)
        src.check_records()
        headers = len(gets) - before
        # small records: a few merged ranges; 32 KiB ones: head and tail windows of neighbours merge
        assert headers <= 30 + 2 * 2 + 4, headers
        before = len(gets)
        for k, v in small.items():
            out = torch.empty(16, dtype=torch.float32)
            src.read_flat(f"model.{k}", 0, 16, out)
            assert_bit_equal(out, v, k)
        assert len(gets) == before  # served from the header pass
    gets.clear()
    import_dcp(url, str(tmp_path / "rag"), world_size=2, storage_options=s3.storage_options)
    assert len(gets) <= 1 + 3 + 38 + 30, len(gets)  # metadata, entries, headers, one read per 32 KiB record
    ck = ragckpt.open(str(tmp_path / "rag"))
    for k, v in {**small, **mid}.items():
        assert_bit_equal(ck.read(k), v, k)


# -- bad input on S3 ---------------------------------------------------------------------------------

def nothing_at(s3, dst: str) -> bool:
    if dst.startswith("s3://"):
        return not s3.fs().find(dst[len("s3://"):])
    return not os.path.exists(dst)


@pytest.mark.parametrize("dst_on_s3", [False, True])
def test_bad_dcp_on_s3_is_one_line_naming_the_object(s3, saved: Path, tmp_path: Path, dst_on_s3: bool) -> None:
    fs = s3.fs()
    dst = f"{s3.url}/rag" if dst_on_s3 else str(tmp_path / "rag")
    opts = s3.cli_args()

    gone = upload(s3, saved, "gone")
    fs.rm(f"{gone[len('s3://'):]}/__0_0.distcp")
    one_line_error(["import-dcp", gone, dst, *opts], f"{gone}/__0_0.distcp is missing", "rank 0")
    assert nothing_at(s3, dst)

    cut = upload(s3, saved, "cut")
    data = (saved / "__0_1.distcp").read_bytes()
    fs.pipe_file(f"{cut[len('s3://'):]}/__0_1.distcp", data[:-100])
    one_line_error(["import-dcp", cut, dst, *opts], f"{cut}/__0_1.distcp is truncated: {len(data) - 100} bytes")
    assert nothing_at(s3, dst)

    nomd = upload(s3, saved, "nomd")
    fs.rm(f"{nomd[len('s3://'):]}/.metadata")
    one_line_error(["import-dcp", nomd, dst, *opts], "no .metadata", f"{nomd}/.metadata is missing")
    assert nothing_at(s3, dst)

    empty = f"{s3.url}/nothing-here"
    one_line_error(["import-dcp", empty, dst, *opts], f"{empty}/.metadata is missing", "nothing is stored")
    assert nothing_at(s3, dst)

    nobucket = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/dcp"
    one_line_error(["import-dcp", nobucket, dst, *opts], nobucket, "does not exist")
    assert nothing_at(s3, dst)

    # a damaged record inside an object of intact length: named with its URL and byte offset
    dmg = upload(s3, saved, "damaged")
    md = pickle.loads((saved / ".metadata").read_bytes())
    info = next(i for idx, i in md.storage_data.items() if idx.fqn == "model.proj.weight")
    raw = bytearray((saved / info.relative_path).read_bytes())
    raw[info.offset : info.offset + 4] = b"XXXX"
    fs.pipe_file(f"{dmg[len('s3://'):]}/{info.relative_path}", bytes(raw))
    one_line_error(["import-dcp", dmg, dst, *opts], f"{dmg}/{info.relative_path} at byte {info.offset}",
                   "not a torch.save record")
    assert nothing_at(s3, dst)

    garbage = upload(s3, saved, "garbage")
    fs.pipe_file(f"{garbage[len('s3://'):]}/.metadata", random.Random(3).randbytes(300))
    one_line_error(["import-dcp", garbage, dst, *opts], f"{garbage}/.metadata is corrupt")
    assert nothing_at(s3, dst)


def test_export_dcp_stays_local_only(s3, saved: Path, tmp_path: Path) -> None:
    import_dcp(str(saved), str(tmp_path / "rag"))
    one_line_error(["export-dcp", str(tmp_path / "rag"), f"{s3.url}/out", *s3.cli_args()],
                   "must be a local path", "export to a local directory")
    assert nothing_at(s3, f"{s3.url}/out")
