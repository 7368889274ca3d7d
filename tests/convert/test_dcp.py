"""import-dcp / export-dcp without processes: every dtype bit-exact, box geometry, byte-range streaming,
key mapping, non-tensor entries, atomic export and one-line errors on bad input. The references are
the tensors handed to torch's own `dcp.save`, and torch's own `dcp.load` for everything we write.
(The multi-process FSDP2 round trip is in test_dcp_fsdp.py.)"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner

import ragckpt
from cli.main import cli
from ragckpt.convert import dcp as conv
from ragckpt.convert.dcp import dcp_key_to_name, export_dcp, import_dcp, name_to_dcp_key, plan_chunks
from ragckpt.errors import DestinationExistsError, FormatError
from tests.helpers import assert_bit_equal, cli_run, special_tensor

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float64,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
SHAPES = [(13, 7), (1,), (0,), (), (3, 5), (2, 0, 3), (17,), (5, 3, 2), (1, 1), (31, 2), (4, 3, 2, 5)]


special = special_tensor
assert_same = assert_bit_equal


def odd_state(seed: int = 0) -> dict[str, torch.Tensor]:
    return {f"layers.{i}.w_{str(dt).split('.')[-1]}": special(SHAPES[i % len(SHAPES)], dt, seed + i)
            for i, dt in enumerate(DTYPES + DTYPES[:5])}


def dcp_save(state: dict, path: Path) -> None:
    with warnings.catch_warnings():  # "no process group: running single-process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))


def dcp_load(state: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path))


def zeros_like_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}


@pytest.fixture(scope="module")
def saved_odd(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    d = tmp_path_factory.mktemp("odd")
    state = odd_state()
    dcp_save({"model": state}, d / "dcp")
    return d, state


# -- import ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,W", [("ragged", 3), ("row", 4), ("element", 5), ("ragged", 1)])
def test_import_every_dtype_bit_exact(saved_odd, tmp_path: Path, layout: str, W: int) -> None:
    d, state = saved_odd
    s = import_dcp(str(d / "dcp"), str(tmp_path / "rag"), world_size=W, layout=layout)
    assert s.world_size == W and s.model_prefix == "model." and s.tensors == len(state)
    ck = ragckpt.open(str(tmp_path / "rag"))
    assert ck.world_size == W and sorted(ck.names()) == sorted(state)
    for name, t in state.items():
        assert_same(ck.read(name), t, name)
    assert ck.verify().ok


def test_import_default_world_size_from_file_names(saved_odd, tmp_path: Path) -> None:
    d, _ = saved_odd
    assert import_dcp(str(d / "dcp"), str(tmp_path / "rag")).world_size == 1  # a single-process save


def test_import_channels_last_record(tmp_path: Path) -> None:
    """DCP keeps a chunk's memory format when it saves: the strided record path must still be exact."""
    w = special((2, 3, 4, 5), torch.float32, 3).contiguous(memory_format=torch.channels_last)
    dcp_save({"model": {"conv.weight": w}}, tmp_path / "dcp")
    import_dcp(str(tmp_path / "dcp"), str(tmp_path / "rag"), world_size=2, layout="element")
    assert_same(ragckpt.open(str(tmp_path / "rag")).read("conv.weight"), w.contiguous(), "channels_last")


def test_read_flat_reads_only_the_overlapping_bytes(tmp_path: Path, monkeypatch) -> None:
    big = special((1024, 256), torch.float32, 1)  # 1 MiB in one DCP chunk
    dcp_save({"model": {"big": big}}, tmp_path / "dcp")
    read = []
    real = os.preadv

    def counting(fd, bufs, offset, *flags):
        n = real(fd, bufs, offset, *flags)
        read.append(n)
        return n

    monkeypatch.setattr(os, "preadv", counting)
    with conv.DcpCheckpoint(str(tmp_path / "dcp")) as src:
        out = torch.empty(300, dtype=torch.float32)
        src.read_flat("model.big", 70_000, 70_300, out)
    assert_same(out, big.reshape(-1)[70_000:70_300])
    assert sum(read) == 300 * 4  # exactly the asked range: no whole-chunk or whole-file read


def test_boxes_of_every_shape_against_dcp_load(tmp_path: Path) -> None:
    """Export cuts tensors into row groups and sub-row boxes; torch's own dcp.load must reassemble them,
    and import must read those boxes back: both directions over N-D boxes, checked independently."""
    state = {f"t{i}": special(s, dt, 10 + i) for i, (s, dt) in enumerate(
        [((7, 6, 5), torch.bfloat16), ((3, 11), torch.float32), ((2, 3, 4, 5), torch.int16), ((9,), torch.bool),
         ((), torch.float64), ((0, 4), torch.float16), ((5, 1, 1), torch.float8_e5m2)])}
    ragckpt.write_global(state, str(tmp_path / "rag"), 3, "element")
    for chunk_bytes in (6, 40, 1 << 20):
        out = tmp_path / f"out{chunk_bytes}"
        e = export_dcp(str(tmp_path / "rag"), str(out), max_chunk_bytes=chunk_bytes, model_prefix="")
        target = zeros_like_state(state)
        dcp_load(target, out)
        for k, v in state.items():
            assert_same(target[k], v, f"{k} @ {chunk_bytes}")
        import_dcp(str(out), str(tmp_path / f"back{chunk_bytes}"), world_size=2, layout="ragged")
        back = ragckpt.open(str(tmp_path / f"back{chunk_bytes}"))
        for k, v in state.items():
            assert_same(back.read(k), v, f"re-import {k} @ {chunk_bytes}")
        if chunk_bytes == 6:
            assert e.chunks > 100  # sub-row pieces really were used


def write_grid_dcp(state: dict[str, torch.Tensor], path: Path, seed: int) -> None:
    """A DCP directory whose chunks are a random N-D grid of boxes per tensor (column and inner-dim cuts,
    as tensor parallelism saves), spread over several rank files in shuffled order; built from torch's
    own metadata classes and torch.save records, the way DCP's FileSystemWriter lays them out."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    g = torch.Generator().manual_seed(seed)
    path.mkdir()
    boxes = []
    for key, t in state.items():
        cuts = []
        for s in t.shape:
            inner = sorted({int(x) for x in torch.randint(1, max(2, s), (2,), generator=g)} - {0, s}) if s > 1 else []
            cuts.append([0, *inner, s])
        grid = [[]]
        for c in cuts:
            grid = [b + [(c[i], c[i + 1] - c[i])] for b in grid for i in range(len(c) - 1)]
        for b in grid:
            boxes.append((key, tuple(o for o, _ in b), tuple(n for _, n in b)))
    order = torch.randperm(len(boxes), generator=g).tolist()
    files = {r: open(path / f"__{r}_0.distcp", "wb") for r in range(3)}
    sdm = {k: TensorStorageMetadata(TensorProperties(dtype=v.dtype), v.shape, []) for k, v in state.items()}
    storage = {}
    for n, i in enumerate(order):
        key, off, size = boxes[i]
        piece = state[key][tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))].clone()
        f = files[n % 3]
        pos = f.tell()
        torch.save(piece, f)
        sdm[key].chunks.append(ChunkStorageMetadata(torch.Size(off), torch.Size(size)))
        storage[MetadataIndex(key, off)] = _StorageInfo(f"__{n % 3}_0.distcp", pos, f.tell() - pos)
    for f in files.values():
        f.close()
    (path / ".metadata").write_bytes(pickle.dumps(Metadata(sdm, storage_data=storage)))


def test_import_arbitrary_box_grids(tmp_path: Path) -> None:
    state = {f"model.t{i}": special(s, dt, 20 + i) for i, (s, dt) in enumerate(
        [((7, 6, 5), torch.bfloat16), ((9, 11), torch.float32), ((4, 3, 5, 6), torch.int16),
         ((13,), torch.float8_e4m3fn), ((3, 8), torch.bool)])}
    for seed in range(3):
        d = tmp_path / f"grid{seed}"
        write_grid_dcp(state, d, seed)
        target = zeros_like_state(state)
        dcp_load(target, d)  # the hand-made directory is valid DCP: torch reassembles it
        for k, v in state.items():
            assert_same(target[k], v, f"dcp.load {k}")
        s = import_dcp(str(d), str(tmp_path / f"rag{seed}"), layout="element")
        assert s.saved_world_size == 3
        ck = ragckpt.open(str(tmp_path / f"rag{seed}"))
        for k, v in state.items():
            assert_same(ck.read(k[len("model."):]), v, f"import {k} seed {seed}")


def test_plan_chunks_tile_each_tensor_once() -> None:
    for shape in [(7, 6, 5), (3, 11), (1,), (), (0, 3), (4, 1, 9)]:
        for cap in (1, 3, 8, 50, 1000):
            seen = torch.zeros(max(1, torch.Size(shape).numel()), dtype=torch.int32)
            for off, size, fs in plan_chunks(shape, 1, cap):
                n = torch.Size(size).numel()
                assert n <= max(cap, 1) or not shape
                idx = torch.arange(torch.Size(shape).numel()).reshape(shape)[
                    tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))].reshape(-1)
                assert torch.equal(idx, torch.arange(fs, fs + n)), (shape, cap, off, size)  # contiguous run
                seen[idx] += 1
            if torch.Size(shape).numel():
                assert (seen == 1).all(), (shape, cap)


# -- key mapping, non-tensor entries ----------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["model.", ""])
def test_key_mapping_is_injective_and_inverts(prefix: str) -> None:
    keys = ["model.a.weight", "model.optim.x", "model.extra.y", "optim.state.a.weight.exp_avg", "tp.col",
            "extra.z", "a.weight", "model.", "plain"]
    names = [dcp_key_to_name(k, prefix) for k in keys]
    assert len(set(names)) == len(names)
    assert [name_to_dcp_key(n, prefix) for n in names] == keys
    assert dcp_key_to_name("model.a.weight", "model.") == "a.weight"
    assert dcp_key_to_name("optim.state.a.exp_avg", prefix) == "optim.state.a.exp_avg"


def test_nested_optimizer_and_objects_round_trip(tmp_path: Path) -> None:
    w = special((4, 3), torch.float32, 5)
    ea = special((4, 3), torch.float32, 6)
    state = {
        "model": {"w": w},
        "optim": {"state": {"w": {"exp_avg": ea, "step": torch.tensor(3.0)}},
                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.0, "params": ["w"]}]},
        "trainer": {"epoch": 3, "run": "run7", "lrs": [0.1, 0.05]},
    }
    dcp_save(state, tmp_path / "dcp")
    s = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "rag"), world_size=2)
    ck = ragckpt.open(str(tmp_path / "rag"))
    assert s.names["optim.state.w.step"] == "optim.state.w.step" and s.names["model.w"] == "w"
    assert_same(ck.read("optim.state.w.exp_avg"), ea)
    assert_same(ck.read("optim.state.w.step"), torch.tensor(3.0))
    assert ck.user["optim.param_groups"]["w"] == {"lr": 0.1, "betas": [0.9, 0.99], "weight_decay": 0.0}
    assert "trainer.epoch" in ck.user["dcp"]["bytes"]
    export_dcp(str(tmp_path / "rag"), str(tmp_path / "out"))
    target = {"model": {"w": torch.zeros(4, 3)},
              "optim": {"state": {"w": {"exp_avg": torch.zeros(4, 3), "step": torch.tensor(0.0)}},
                        "param_groups": [{"lr": 0.0, "betas": (0, 0), "weight_decay": 1.0, "params": ["x"]}]},
              "trainer": {"epoch": 0, "run": "", "lrs": []}}
    dcp_load(target, tmp_path / "out")
    assert_same(target["model"]["w"], w)
    assert_same(target["optim"]["state"]["w"]["exp_avg"], ea)
    assert target["optim"]["param_groups"] == state["optim"]["param_groups"]  # betas stays a tuple
    assert target["trainer"] == state["trainer"]


def test_bare_model_state_dict(tmp_path: Path) -> None:
    state = {"enc.weight": special((6, 2), torch.bfloat16, 1), "enc.bias": special((6,), torch.bfloat16, 2)}
    dcp_save(state, tmp_path / "dcp")
    s = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "rag"), world_size=2)
    assert s.model_prefix == "" and sorted(ragckpt.open(str(tmp_path / "rag")).names()) == sorted(state)
    export_dcp(str(tmp_path / "rag"), str(tmp_path / "out"))  # prefix "" recorded at import
    target = zeros_like_state(state)
    dcp_load(target, tmp_path / "out")
    for k, v in state.items():
        assert_same(target[k], v, k)


def test_export_native_checkpoint_with_param_groups(tmp_path: Path) -> None:
    """A checkpoint that never saw DCP: hyperparameters come from user metadata `optim.param_groups`."""
    w, m = special((5, 2), torch.float32, 1), special((5, 2), torch.float32, 2)
    ragckpt.write_global({"w": w, "optim.state.w.exp_avg": m}, str(tmp_path / "rag"), 2,
                         user={"optim.param_groups": {"w": {"lr": 0.25, "betas": [0.5, 0.75]}}})
    e = export_dcp(str(tmp_path / "rag"), str(tmp_path / "out"))
    assert e.model_prefix == "model." and e.non_tensor_entries == 2
    target = {"model": {"w": torch.zeros(5, 2)}, "optim": {"state.w.exp_avg": torch.zeros(5, 2),
                                                          "param_groups.w.lr": 0.0, "param_groups.w.betas": ()}}
    dcp_load(target, tmp_path / "out")
    assert_same(target["model"]["w"], w)
    assert_same(target["optim"]["state.w.exp_avg"], m)
    assert target["optim"]["param_groups.w.lr"] == 0.25 and target["optim"]["param_groups.w.betas"] == (0.5, 0.75)


# -- export atomicity -------------------------------------------------------------------------------

def test_export_refuses_existing_and_overwrites_atomically(saved_odd, tmp_path: Path) -> None:
    d, state = saved_odd
    import_dcp(str(d / "dcp"), str(tmp_path / "rag"), world_size=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.distcp").write_bytes(b"old")
    with pytest.raises(DestinationExistsError):
        export_dcp(str(tmp_path / "rag"), str(out))
    assert (out / "stale.distcp").exists()
    export_dcp(str(tmp_path / "rag"), str(out), overwrite=True)
    assert not (out / "stale.distcp").exists()
    target = {"model": zeros_like_state(state)}
    dcp_load(target, out)
    for k, v in state.items():
        assert_same(target["model"][k], v, k)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "rag"]  # no temp or old trees left


def test_export_failure_leaves_nothing(saved_odd, tmp_path: Path, monkeypatch) -> None:
    d, _ = saved_odd
    import_dcp(str(d / "dcp"), str(tmp_path / "rag"), world_size=2)
    calls = []
    real = torch.save

    def flaky(obj, f):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(obj, f)

    monkeypatch.setattr(conv.torch, "save", flaky)
    with pytest.raises(OSError):
        export_dcp(str(tmp_path / "rag"), str(tmp_path / "out"), workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rag"]


# -- CLI and bad input ------------------------------------------------------------------------------


def assert_one_line_error(args: list[str], *needles: str) -> str:
    code, out, err = cli_run(*args)
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_cli_round_trip_json(saved_odd, tmp_path: Path) -> None:
    d, state = saved_odd
    code, out, err = cli_run("import-dcp", str(d / "dcp"), str(tmp_path / "rag"), "--world-size", "3",
                             "--layout", "row", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["world_size"] == 3 and s["tensors"] == len(state) and s["layout"] == "row"
    code, out, err = cli_run("export-dcp", str(tmp_path / "rag"), str(tmp_path / "out"), "--json", "--chunk-mib", "0.001")
    assert code == 0, err
    assert json.loads(out)["tensors"] == len(state)
    target = {"model": zeros_like_state(state)}
    dcp_load(target, tmp_path / "out")
    for k, v in state.items():
        assert_same(target["model"][k], v, k)
    code, out, _ = cli_run("import-dcp", "--help")
    assert code == 0 and "Example" in out and "--world-size" in out
    code, out, _ = cli_run("export-dcp", "--help")
    assert code == 0 and "Example" in out


def assert_usage_error(args: list[str], option: str, *needles: str) -> str:
    """A bad option value: click's usage error naming the option (exit 2), never a traceback."""
    code, out, err = cli_run(*args)
    assert code == 2 and f"Invalid value for '{option}'" in err and "Traceback" not in err, (code, out, err)
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "1e-9", "0.0009", "1e400"])
def test_chunk_mib_must_be_finite_and_at_least_1_kib(saved_odd, tmp_path: Path, value: str) -> None:
    """inf was a traceback, nan a `ValueError:` line, and 0, -1 and 1e-9 silently gave 1-byte chunks."""
    d, _ = saved_odd
    import_dcp(str(d / "dcp"), str(tmp_path / "rag"), world_size=2)
    assert_usage_error(["export-dcp", str(tmp_path / "rag"), str(tmp_path / "out"), f"--chunk-mib={value}"],
                       "--chunk-mib", "1 KiB")
    assert not (tmp_path / "out").exists()


def test_export_memory_budget_is_an_option(saved_odd, tmp_path: Path) -> None:
    """export-dcp takes --memory like the other streaming commands (it held workers x 64 MiB whatever
    the machine); too small a budget is a usage error before anything is written."""
    d, state = saved_odd
    import_dcp(str(d / "dcp"), str(tmp_path / "rag"), world_size=2)
    code, out, err = cli_run("export-dcp", str(tmp_path / "rag"), str(tmp_path / "out"), "--memory", "1MiB")
    assert (code, err) == (2, "error: memory budget (--memory / memory_bytes) of 1048576 bytes is too small; "
                              "give at least 4 MiB\n"), (code, out)
    assert not (tmp_path / "out").exists()
    code, out, err = cli_run("export-dcp", str(tmp_path / "rag"), str(tmp_path / "out"), "--memory", "8MiB",
                             "--workers", "2")
    assert code == 0, err
    got = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    dcp_load({"model": got}, tmp_path / "out")
    for k, v in state.items():
        assert_same(got[k], v, k)


def test_workers_and_world_size_are_validated(saved_odd, tmp_path: Path) -> None:
    d, _ = saved_odd
    rag = str(tmp_path / "rag")
    import_dcp(str(d / "dcp"), rag, world_size=2)
    for n in ("0", "-1"):
        assert_usage_error(["import-dcp", str(d / "dcp"), str(tmp_path / "o"), "--workers", n], "--workers")
        assert_usage_error(["export-dcp", rag, str(tmp_path / "o"), "--workers", n], "--workers")
    # a huge world size used to end in numpy's _ArrayMemoryError traceback
    for w in ("0", "1000000000"):
        assert_usage_error(["import-dcp", str(d / "dcp"), str(tmp_path / "o"), "-w", w], "--world-size", "1048576")
    assert not (tmp_path / "o").exists()
    code, out, _ = cli_run("import-dcp", "--help")
    assert code == 0 and "1,048,576" in out


def copy_dcp(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_random_metadata_bytes_never_allocate_what_a_damaged_length_says(tmp_path: Path) -> None:
    """Random bytes as `.metadata`: the C unpickler allocates whatever a damaged length field says
    or grows its memo to whatever index a damaged PUT carries (one such file once took 24 GB, and
    the test process with it). Every one is a one-line error."""
    import resource
    import struct

    from ragckpt.convert.dcp_format import load_metadata

    rng = random.Random(1)
    samples = [rng.randbytes(300) for _ in range(3000)]
    samples += [b"\x80\x04\x8d" + struct.pack("<Q", 20 << 30) + b"abc",  # BINUNICODE8 of 20 GB
                b"\x80\x04\x96" + struct.pack("<Q", 20 << 30) + b"abc",  # BYTEARRAY8 of 20 GB
                b"\x80\x04K\x05r" + struct.pack("<I", 400_000_000) + b"."]  # a valid pickle, memo index 400M
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for raw in samples:
        (tmp_path / ".metadata").write_bytes(raw)
        with pytest.raises(FormatError, match="corrupt or truncated|does not hold DCP Metadata|is incomplete"):
            load_metadata(str(tmp_path))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20  # KiB: under 1 GiB more


def test_bad_inputs_fail_in_one_line(saved_odd, tmp_path: Path) -> None:
    d, _ = saved_odd
    dst = str(tmp_path / "rag")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(["import-dcp", str(tmp_path / "empty"), dst], "no .metadata")
    assert_one_line_error(["import-dcp", str(tmp_path / "nowhere"), dst], "not a directory")
    # corrupt and truncated metadata
    bad = copy_dcp(d / "dcp", tmp_path / "garbage")
    (bad / ".metadata").write_bytes(random.Random(7).randbytes(300))
    assert_one_line_error(["import-dcp", str(bad), dst], ".metadata", "corrupt")
    trunc = copy_dcp(d / "dcp", tmp_path / "trunc_md")
    raw = (trunc / ".metadata").read_bytes()
    (trunc / ".metadata").write_bytes(raw[: len(raw) // 2])
    assert_one_line_error(["import-dcp", str(trunc), dst], "corrupt or truncated")
    # a pickle that would run code is refused, and the code does not run
    evil = copy_dcp(d / "dcp", tmp_path / "evil")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (evil / ".metadata").write_bytes(pickle.dumps(Evil()))
    assert_one_line_error(["import-dcp", str(evil), dst], "posix.system")
    assert not marker.exists()
    # a truncated .distcp file
    cut = copy_dcp(d / "dcp", tmp_path / "cut")
    data = cut / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    assert_one_line_error(["import-dcp", str(cut), dst], "__0_0.distcp is truncated")
    # a missing rank file
    gone = copy_dcp(d / "dcp", tmp_path / "gone")
    (gone / "__0_0.distcp").unlink()
    assert_one_line_error(["import-dcp", str(gone), dst], "missing", "rank 0")
    # a damaged record inside an intact-length file
    dmg = copy_dcp(d / "dcp", tmp_path / "damaged")
    with open(dmg / "__0_0.distcp", "r+b") as f:
        f.write(b"XXXX")
    assert_one_line_error(["import-dcp", str(dmg), dst], "not a torch.save record")
    assert not (tmp_path / "rag").exists() or not ragckpt.open(dst, allow_uncommitted=True).committed
    # world sizes (0 and huge values are usage errors: test_workers_and_world_size_are_validated)
    anon = copy_dcp(d / "dcp", tmp_path / "anon")
    md = pickle.loads((anon / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = "data.distcp"
    (anon / "__0_0.distcp").rename(anon / "data.distcp")
    (anon / ".metadata").write_bytes(pickle.dumps(md))
    assert_one_line_error(["import-dcp", str(anon), dst], "pass --world-size")
    assert cli_run("import-dcp", str(anon), dst, "--world-size", "2")[0] == 0
    # export errors
    assert_one_line_error(["export-dcp", str(tmp_path / "nothing"), str(tmp_path / "o")], "no ragckpt checkpoint")
    assert_one_line_error(["export-dcp", dst, str(tmp_path / "garbage")], "already exists", "not empty", "--overwrite")


def _resized(key: str, size: list[int], chunks: list | None = None):
    def change(md) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        t = md.state_dict_metadata[key]
        md.state_dict_metadata[key] = TensorStorageMetadata(t.properties, torch.Size(size),
                                                            t.chunks if chunks is None else chunks)
    return change


def _stored_at(key: str, offset: int):
    def change(md) -> None:
        for idx, info in md.storage_data.items():
            if idx.fqn == key:
                info.offset = offset
    return change


@pytest.mark.parametrize("damage, needle", [
    (_resized("model.w", [0, 2**70], []), "tensor 'model.w' has size [0, 1180591620717411303424], not a shape"),
    (_resized("model.w", [8, 4], [None]), "tensor 'model.w' of shape [8, 4] lists a chunk with None"),
    (_resized("model.w", [32]), "tensor 'model.w' of shape [32] lists a chunk with offsets [0, 0] and sizes [8, 4]"),
    (_stored_at("model.w", -5), "entry 'model.w' is stored at offset -5"),
], ids=["huge-dimension", "chunk-none", "chunk-of-another-rank", "negative-offset"])
def test_metadata_that_unpickles_but_lies_is_named(tmp_path: Path, damage, needle: str) -> None:
    """Metadata that loads but describes impossible tensors (found by a hunt through the CLI): these
    were internal errors (an overflow, an AttributeError) or errors naming nothing (a reshape's
    ValueError, EINVAL from pread)."""
    ragckpt.write_global({"w": torch.randn(8, 4), "b": torch.randn(4)}, str(tmp_path / "ck"), 2)
    export_dcp(str(tmp_path / "ck"), str(tmp_path / "dcp"))
    md = pickle.loads((tmp_path / "dcp" / ".metadata").read_bytes())
    damage(md)
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(md))
    line = assert_one_line_error(["import-dcp", str(tmp_path / "dcp"), str(tmp_path / "out"), "-w", "2"],
                                 f"{tmp_path / 'dcp' / '.metadata'}: ", needle, "the metadata is corrupt")
    assert not (tmp_path / "out").exists(), line


@pytest.mark.parametrize("form", ["mapping", "torch-list", "neither"])
def test_export_takes_param_groups_in_either_documented_form(tmp_path: Path, form: str) -> None:
    """ENGINE.md allows torch's list of groups too; export-dcp iterated it as a mapping and died with
    an AttributeError (an internal error), found by a review."""
    hyper = {"mapping": {"w": {"lr": 0.1, "betas": [0.9, 0.95]}},
             "torch-list": [{"lr": 0.1, "betas": [0.9, 0.95], "params": ["w"]}],
             "neither": [{"lr": 0.1}]}[form]
    ragckpt.write_global({"w": torch.ones(4)}, str(tmp_path / "ck"), 1, user={"optim.param_groups": hyper})
    if form == "neither":
        assert_one_line_error(["export-dcp", str(tmp_path / "ck"), str(tmp_path / "dcp")],
                              "'optim.param_groups' is neither the {param: {hyperparameter: value}} mapping")
        return
    export_dcp(str(tmp_path / "ck"), str(tmp_path / "dcp"))
    got = {"model": {"w": torch.zeros(4)}, "optim": {"param_groups.w.lr": 0.0, "param_groups.w.betas": (0.0, 0.0)}}
    dcp_load(got, tmp_path / "dcp")
    assert got["optim"] == {"param_groups.w.lr": 0.1, "param_groups.w.betas": (0.9, 0.95)}
    assert torch.equal(got["model"]["w"], torch.ones(4))


def test_export_refuses_a_name_whose_key_would_read_back_as_another(tmp_path: Path) -> None:
    """`extra.model.foo` goes out as DCP key `model.foo`, which the model prefix makes `foo` on the
    way back: silently renamed (found by a review)."""
    ragckpt.write_global({"w": torch.ones(2), "extra.model.foo": torch.zeros(2)}, str(tmp_path / "ck"), 1)
    assert_one_line_error(["export-dcp", str(tmp_path / "ck"), str(tmp_path / "dcp")],
                          "tensor 'extra.model.foo' would be exported as DCP key 'model.foo', which import-dcp reads "
                          "back as 'foo'")
    assert not (tmp_path / "dcp").exists()
    export_dcp(str(tmp_path / "ck"), str(tmp_path / "dcp"), model_prefix="net.")
    import_dcp(str(tmp_path / "dcp"), str(tmp_path / "back"))
    assert sorted(ragckpt.open(str(tmp_path / "back")).names()) == ["extra.model.foo", "w"]


def test_metadata_loader_rejects_foreign_pickles(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(FormatError, match="does not hold DCP Metadata"):
        conv.DcpCheckpoint(str(tmp_path))
    buf = io.BytesIO()
    torch.save(torch.zeros(2), buf)  # a torch.save zip is not DCP metadata either
    (tmp_path / ".metadata").write_bytes(buf.getvalue())
    with pytest.raises(FormatError, match="corrupt or truncated"):
        conv.DcpCheckpoint(str(tmp_path))


@pytest.mark.parametrize("wrapping", ["bare", "model", "model+rng", "model+optimizer", "override", "model+ema+optim",
                                      "bare+optim"])
def test_a_hugging_face_state_dict_keeps_its_names(tmp_path: Path, wrapping: str) -> None:
    """A bare `dcp.save(hf_model.state_dict())` has keys `model.embed_tokens.weight` beside
    `lm_head.weight`: not the `{"model": ...}` wrapper. Taking any `model.` key for the wrapper
    renamed the tensors and pushed `lm_head.weight` into `extra.`, which export-hf then left out.
    Wrapped saves with other top-level entries (an RNG state, an `optimizer` group) still count
    as wrapped, and `model_prefix=` overrides the guess."""
    sd = {"model.embed_tokens.weight": special_tensor((8, 4), torch.float32, 1),
          "model.norm.weight": special_tensor((4,), torch.float32, 2),
          "lm_head.weight": special_tensor((8, 4), torch.bfloat16, 3)}
    other = {"rng": torch.arange(5, dtype=torch.uint8)} if wrapping == "model+rng" else {}
    other |= {"optimizer": {"m": torch.ones(3)}} if wrapping == "model+optimizer" else {}
    # flattened optimizer state names each parameter as the model does: it tells the two apart where
    # an EMA copy beside the model (all `.weight` keys) made a wrapped save pass for a bare one
    moments = {f"optim.state.{k}.exp_avg": torch.zeros(v.shape) for k, v in sd.items()}
    if wrapping == "model+ema+optim":
        other = {"ema": {k: v.clone() for k, v in sd.items()}, "optim": {k[6:]: v for k, v in moments.items()}}
    saved = sd if wrapping == "bare" else {"model": sd, **other}
    if wrapping == "bare+optim":
        saved = {**sd, "optim": {k[6:]: v for k, v in moments.items()}}
    prefix = None
    if wrapping == "override":  # a bare model whose only top-level module is `model`: looks wrapped
        sd = {k: v for k, v in sd.items() if k.startswith("model.")}
        saved, prefix = sd, ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(saved, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    import_dcp(str(tmp_path / "dcp"), str(tmp_path / "ck"), world_size=2, model_prefix=prefix)
    ck = ragckpt.open(str(tmp_path / "ck"))
    assert sorted(n for n in ck.names() if not n.startswith(("extra.", "optim."))) == sorted(sd)
    for k, v in sd.items():
        assert_bit_equal(ck.read(k), v)
    if wrapping.endswith("+optim"):  # every moment names a parameter of the checkpoint
        assert sorted(n for n in ck.names() if n.startswith("optim.")) == sorted(moments)
    if wrapping == "model+ema+optim":
        assert sorted(n for n in ck.names() if n.startswith("extra.")) == sorted(f"extra.ema.{k}" for k in sd)


def test_export_warns_about_what_a_torch_optimizer_will_miss(tmp_path: Path) -> None:
    """An engine that saved Adam moments but kept the step in user metadata exports a DCP checkpoint
    that torch's own optimizer load rejects ("Missing key ... .step"): the export says so, in the
    summary and on the CLI. With the steps and param_groups saved, a real AdamW loads it exactly."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    def trained(lr: float, seed: int):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        opt = torch.optim.AdamW(m.parameters(), lr=lr)
        m(torch.randn(5, 4)).sum().backward()
        opt.step()
        return m, opt

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    m, opt = trained(0.1, 0)
    msd, osd = get_state_dict(m, opt, options=flat)
    tensors = {**msd, **{f"optim.{k}": v for k, v in osd.items() if torch.is_tensor(v)}}
    groups = {k[len("param_groups."):].rsplit(".", 1)[0]: {} for k in osd if k.startswith("param_groups.")}
    for k, v in osd.items():
        if k.startswith("param_groups."):
            fqn, hp = k[len("param_groups."):].rsplit(".", 1)
            groups[fqn][hp] = list(v) if isinstance(v, tuple) else v

    no_step = {k: v for k, v in tensors.items() if not k.endswith(".step")}
    ragckpt.write_global(no_step, str(tmp_path / "engine"), 2)
    res = CliRunner().invoke(cli, ["export-dcp", str(tmp_path / "engine"), str(tmp_path / "out1")])
    assert res.exit_code == 0, res.output
    assert "note: optimizer state of 4 parameter(s) has moments but no step" in res.stdout
    assert "note: no optim.param_groups" in res.stdout
    m2, opt2 = trained(0.5, 1)
    target = {"model": get_state_dict(m2, opt2, options=flat)[0], "optim": get_state_dict(m2, opt2, options=flat)[1]}
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: optim\.state\.\S+\.step"):
        dcp_load(target, tmp_path / "out1")

    # the hyperparameters an engine might record by hand: torch's AdamW keeps 11, and dcp.load asks
    # for every one of them
    few = {fqn: {k: hp[k] for k in ("lr", "betas", "eps", "weight_decay")} for fqn, hp in groups.items()}
    ragckpt.write_global(tensors, str(tmp_path / "few"), 2, user={"optim.param_groups": few})
    (note,) = export_dcp(str(tmp_path / "few"), str(tmp_path / "out_few")).warnings
    assert note.startswith("optim.param_groups of 4 parameter(s) with Adam moments lack hyperparameters torch's "
                           "Adam and AdamW keep (for '0.bias': amsgrad, "), note
    with pytest.raises(CheckpointException, match=r"Missing key in checkpoint state_dict: optim\.param_groups\."):
        dcp_load({"model": get_state_dict(m2, opt2, options=flat)[0], "optim": get_state_dict(m2, opt2, options=flat)[1]},
                 tmp_path / "out_few")
    ragckpt.write_global(tensors, str(tmp_path / "full"), 2, user={"optim.param_groups": groups})
    e = export_dcp(str(tmp_path / "full"), str(tmp_path / "out2"))
    assert e.warnings == []
    msd2, osd2 = get_state_dict(m2, opt2, options=flat)
    target = {"model": msd2, "optim": osd2}
    dcp_load(target, tmp_path / "out2")
    set_state_dict(m2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"], options=flat)
    for k, v in get_state_dict(m2, opt2, options=flat)[1].items():
        assert (assert_same(v, osd[k]) is None) if torch.is_tensor(v) else v == osd[k], k


def test_export_says_what_it_cannot_hold(tmp_path: Path) -> None:
    """User metadata keys of one's own and per-rank extras have no place in a DCP checkpoint: the
    export names them in notes instead of dropping them silently. ragckpt's own keys (what
    import-dcp, import-hf and reshard record) are no user metadata of that kind."""
    state = {"model.w": torch.arange(8.0).reshape(4, 2)}
    lay = ragckpt.CheckpointLayout.build({"model.w": ((4, 2), torch.float32)}, 2, "row")
    src = str(tmp_path / "ck")
    for r in range(2):
        ragckpt.save_shard(src, r, {"float32": state["model.w"][2 * r: 2 * r + 2].reshape(-1)}, lay,
                           extra={"rng": torch.tensor([r], dtype=torch.uint8)} if r == 1 else None,
                           user={"step": 7, "data_pos": [3, 4]})
    ragckpt.commit(src)
    code, out, err = cli_run("export-dcp", src, str(tmp_path / "dcp"))
    assert code == 0, err
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert any("user metadata (data_pos, step) is not in the export" in n for n in notes), out
    assert any("per-rank extras of 1 rank(s)" in n for n in notes), out
    back = {"model.w": torch.zeros(4, 2)}
    dcp_load({"model": back}, tmp_path / "dcp")
    assert_bit_equal(back["model.w"], state["model.w"])
    # an import of a DCP save, resharded: only ragckpt's own keys, nothing to say
    dcp_save({"model": state}, tmp_path / "plain")
    import_dcp(str(tmp_path / "plain"), str(tmp_path / "imp"), world_size=2)
    ragckpt.reshard.reshard(str(tmp_path / "imp"), str(tmp_path / "imp3"), 3)
    assert export_dcp(str(tmp_path / "imp3"), str(tmp_path / "again")).warnings == []


# -- memory ----------------------------------------------------------------------------------------

MEMORY_PROBE = """
import json, sys
import torch.distributed.checkpoint, torch.distributed.checkpoint.filesystem  # imports are not data
from ragckpt.convert.dcp import export_dcp, import_dcp

def status(key):  # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forking parent
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

op, src, dst = sys.argv[1:4]
base = status("VmRSS")
if op == "import":
    import_dcp(src, dst, world_size=16, layout="element", workers=4, memory_bytes=32 << 20)  # 4 ranks per worker
elif op == "export":
    export_dcp(src, dst, workers=4, max_chunk_bytes=8 << 20)
else:
    export_dcp(src, dst, workers=4, memory_bytes=32 << 20)  # default 64 MiB chunks: 4 of them do not fit
print(json.dumps({"above": status("VmHWM") - base}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for RSS")
def test_memory_stays_bounded_while_data_does_not(tmp_path: Path) -> None:
    """192 MiB of tensors through import-dcp (32 MiB budget) and export-dcp (8 MiB chunks), 4 workers
    each: peak RSS stays near the budget, not the checkpoint's size. Import once held a 256 MiB
    destination chunk per worker whatever the budget, and then, with 4 MiB chunks, 45-75 MiB: every
    read went through a fresh staging buffer and every rank got a fresh chunk buffer, which the
    workers' malloc arenas kept; export kept its freed chunks the same way (131 MiB here, 240 MiB
    for 384 MiB of data)."""
    g = torch.Generator().manual_seed(3)
    state = {f"layers.{i}.w": torch.randint(-2**15, 2**15, (2048, 4096), dtype=torch.int16, generator=g)
             .view(torch.bfloat16) for i in range(12)}
    dcp_save({"model": state}, tmp_path / "dcp")

    def probe(*args: str) -> int:
        p = subprocess.run([sys.executable, "-c", MEMORY_PROBE, *args], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[2], timeout=300)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout.strip().splitlines()[-1])["above"]

    up = probe("import", str(tmp_path / "dcp"), str(tmp_path / "rag"))
    down = probe("export", str(tmp_path / "rag"), str(tmp_path / "out"))
    budget = probe("export-budget", str(tmp_path / "rag"), str(tmp_path / "out2"))
    assert up < 40 << 20, up >> 20  # 32 MiB budget: about 20 MiB measured
    assert down < 48 << 20, down >> 20  # 4 workers x 8 MiB chunks: about 36 MiB measured
    # the budget cuts chunks smaller: 16 MiB tensors in whole (the default 64 MiB chunk) made it 70 MiB
    assert budget < 40 << 20, budget >> 20
    for out in ("out", "out2"):
        got = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
        dcp_load({"model": got}, tmp_path / out)
        for k, v in state.items():
            assert_same(got[k], v, k)


def test_import_options_are_checked_whatever_the_memory_budget(saved_odd, tmp_path: Path) -> None:
    """A bad max_chunk_bytes was hidden by the budget's smaller chunk (and accepted); a numpy integer
    budget was refused as 'too small'."""
    import numpy as np

    d, state = saved_odd
    for bad in (2**50, 1e9):
        with pytest.raises(ValueError, match="max_chunk_bytes must be an integer"):
            import_dcp(str(d / "dcp"), str(tmp_path / "x"), world_size=2, max_chunk_bytes=bad)
    with pytest.raises(ragckpt.OptionError,
                       match=r"memory budget \(--memory / memory_bytes\) must be a whole number of bytes, got '64MiB'"):
        import_dcp(str(d / "dcp"), str(tmp_path / "x"), world_size=2, memory_bytes="64MiB")
    assert not (tmp_path / "x").exists()
    import_dcp(str(d / "dcp"), str(tmp_path / "ok"), world_size=2, memory_bytes=np.int64(64 << 20))
    ck = ragckpt.open(str(tmp_path / "ok"))
    for k, v in state.items():
        assert_same(ck.read(k), v, k)


def test_export_creates_missing_parents_of_its_output_like_every_other_command(saved_odd, tmp_path: Path) -> None:
    """export-dcp alone refused 'new/a/dcp' when 'new/a' did not exist; a file where a parent should be
    is still one line naming the destination, and nothing is created."""
    d, state = saved_odd
    import_dcp(str(d / "dcp"), str(tmp_path / "rag"), world_size=2)
    code, out, err = cli_run("export-dcp", str(tmp_path / "rag"), str(tmp_path / "new" / "a" / "dcp"))
    assert code == 0, err
    got = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    dcp_load({"model": got}, tmp_path / "new" / "a" / "dcp")
    for k, v in state.items():
        assert_same(got[k], v, k)
    (tmp_path / "file").write_text("x")
    code, out, err = cli_run("export-dcp", str(tmp_path / "rag"), str(tmp_path / "file" / "dcp"))
    assert code == 2 and err.count("\n") == 1 and str(tmp_path / "file" / "dcp") in err, err


def test_overwrite_through_a_symlinked_out_dir_writes_its_target(tmp_path: Path) -> None:
    """`latest -> disk/dcp_out` as OUT_DIR: --overwrite swapped the new export in for the link itself,
    so readers of the real path kept the old export and the link was gone; reshard and export-hf keep
    the link and replace its target."""
    for name, fill in (("a", 0.0), ("b", 1.0)):
        ragckpt.write_global({"w": torch.full((4,), fill)}, str(tmp_path / name), 2)
    real, link = tmp_path / "disk" / "dcp_out", tmp_path / "latest"
    real.mkdir(parents=True)
    os.symlink(real, link)
    export_dcp(str(tmp_path / "a"), str(link))
    export_dcp(str(tmp_path / "b"), str(link), overwrite=True)
    assert link.is_symlink() and os.path.realpath(link) == str(real)
    for where in (link, real):
        got = {"model": {"w": torch.zeros(4)}}
        dcp_load(got, where)
        assert torch.equal(got["model"]["w"], torch.ones(4)), where
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["dcp_out"]  # no temporary siblings left
