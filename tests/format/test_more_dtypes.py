"""complex64, complex128, uint16, uint32 and uint64 on every path: the format (global and per-rank
writes, every read, verify, plain zarr), offline and load-time resharding, DCP both ways against
torch's own dcp.save / dcp.load, Hugging Face safetensors both ways (complex128, which safetensors
cannot hold, refused by name before anything is written), the FSDP2 adapter and the CLI. Every
comparison is bit for bit, with NaN (payloads and signs included), +-inf and -0.0 planted in both
parts of the complex numbers and the top unsigned values planted in the uints (tests/helpers.py)."""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from safetensors.torch import load_file, save_file

import ragckpt
from ragckpt.convert.dcp import export_dcp, import_dcp
from ragckpt.convert.hf_export import export_hf
from ragckpt.convert.hf_import import import_hf
from ragckpt.format.dtypes import as_bytes, dtype_name, from_bytes, itemsize, storage_dtype, torch_dtype
from ragckpt.reshard.offline import reshard
from tests.convert.test_dcp import dcp_load, dcp_save
from tests.convert.test_hf_convert import cli_error, cli_run
from tests.helpers import MORE_DTYPES, assert_bit_equal, bits, special_tensor

NAMES = {dt: str(dt).split(".")[-1] for dt in MORE_DTYPES}
#: 0-d, zero-size (flat and with a zero inner dim), one element, rows fewer than ranks, primes
SHAPES = [(13, 7), (1,), (0,), (), (3, 5), (2, 0, 3), (31, 2), (1, 1)]
#: what safetensors can hold (its dtype list has C64 but no 128-bit complex)
HF_DTYPES = [dt for dt in MORE_DTYPES if dt != torch.complex128]


def more_state(dtypes=MORE_DTYPES, seed: int = 0, prefix: str = "layers") -> dict[str, torch.Tensor]:
    """Every shape of SHAPES in every dtype, specials planted."""
    return {f"{prefix}.{i}.{NAMES[dt]}": special_tensor(shape, dt, seed + 10 * j + i)
            for j, dt in enumerate(dtypes) for i, shape in enumerate(SHAPES)}


def rank_buffer(lay: ragckpt.CheckpointLayout, bi: int, state: dict[str, torch.Tensor], r: int) -> torch.Tensor:
    """Rank r's flat buffer `bi` of `lay`, built by hand from the layout's segment table (padding 0)."""
    spec = lay.buffers[bi]
    buf = torch.zeros(int(lay.rank_sizes(bi)[r]), dtype=torch_dtype(spec.dtype))
    seg = lay.layout_of(bi).rank_segments(r)
    for i in range(len(seg)):
        t = state[spec.tensors[int(seg.slot[i])]].reshape(-1)
        o, fs, n = int(seg.offset[i]), int(seg.flat_start[i]), int(seg.length[i])
        buf[o : o + n] = t[fs : fs + n]
    return buf


# -- the dtype table ----------------------------------------------------------------------------------------

def test_helpers_plant_the_special_values() -> None:
    """The data really holds what the bit comparisons are meant to protect."""
    for dt, part in ((torch.complex64, torch.float32), (torch.complex128, torch.float64)):
        t = special_tensor((13, 7), dt)
        re, im = t.real.reshape(-1)[:5], t.imag.reshape(-1)[:5]
        assert torch.isnan(re[0]) and torch.isneginf(im[0]) and torch.isnan(im[3]) and torch.isnan(re[4])
        assert re[1] == 0 and torch.signbit(re[1]) and not torch.signbit(im[1])
        assert torch.isposinf(re[2]) and im[2] == 0 and torch.signbit(im[2]) and torch.signbit(im[3])
        # a quiet NaN with a payload: a conversion through Python floats or another width would drop it
        raw = t.reshape(-1)[4:5].view(part)[0:1].view(torch.int32 if part == torch.float32 else torch.int64)
        assert raw.item() & 0xFFFF == 0xBEEF
        assert special_tensor((), dt).dim() == 0 and torch.isnan(special_tensor((), dt).real)
    for dt, top in ((torch.uint16, 0xFFFF), (torch.uint32, 0xFFFFFFFF), (torch.uint64, 2**64 - 1)):
        t = special_tensor((13, 7), dt).reshape(-1)
        assert int(t[0].item()) == top and int(t[1].item()) == (top >> 1) + 1


def test_dtype_table_names_storage_and_bytes() -> None:
    """Stored as themselves (zarr v3 core data types), looked up both ways, and viewed as bytes and
    back (as_bytes is what the FSDP2 adapter checksums replicated entries with) without a copy that
    could change a bit."""
    for dt in MORE_DTYPES:
        name = NAMES[dt]
        assert dtype_name(dt) == name and torch_dtype(name) == dt
        assert storage_dtype(name) == np.dtype(name) and itemsize(name) == torch.empty(0, dtype=dt).element_size()
        for shape in ((13, 7), (), (0,), (2, 0, 3)):
            t = special_tensor(shape, dt, 3)
            raw = as_bytes(t)
            assert len(raw) == t.numel() * itemsize(name)
            assert bytes(raw) == bits(t).numpy().tobytes()
            assert_bit_equal(from_bytes(raw, name).reshape(shape), t, f"{name} {shape}")
            assert_bit_equal(from_bytes(bytes(raw), name).reshape(shape), t, f"{name} {shape} (read-only bytes)")
        with pytest.raises(ValueError, match="contiguous"):
            as_bytes(special_tensor((4, 6), dt).t())
    with pytest.raises(ragckpt.FormatError, match=r"dtype torch.complex32 is not supported; supported: .*complex64"):
        dtype_name(torch.complex32)


# -- the format ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["ragged", "row", "element"])
@pytest.mark.parametrize("W", [1, 3, 8])
def test_write_global_round_trip(tmp_path: Path, kind: str, W: int) -> None:
    state = more_state()
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, W, kind, granularity="row")
    ck = ragckpt.open(url)
    assert sorted(ck.names()) == sorted(state) and ck.world_size == W
    for name, want in state.items():
        assert ck.meta(name).dtype == dtype_name(want.dtype)
        assert_bit_equal(ck.read(name), want, name)
        m = ck.meta(name)
        rng = m.placement.ranges(m.shape)
        pieces = [ck.read_local(name, r) for r in range(W)]
        assert [p.numel() for p in pieces] == (rng[:, 1] - rng[:, 0]).tolist()
        assert_bit_equal(torch.cat(pieces), want.reshape(-1), f"{name} pieces")
    assert ck.verify().ok
    assert_same_via_plain_zarr(url, ck)
    everything = ragckpt.load(url, ck.layout, 0)  # the load-time path at the same world size
    for b in ck.layout.buffers:
        assert_bit_equal(everything[b.name], ck.read_rank(b.name, 0), b.name)


def assert_same_via_plain_zarr(url: str, ck: ragckpt.Checkpoint) -> None:
    """FORMAT.md: each buffer is a (W, Smax) zarr array of the storage dtype, which for these dtypes
    is the dtype itself; plain zarr reads every rank's row, bytes equal to ragckpt's."""
    manifest = json.loads(Path(url, "zarr.json").read_text())["attributes"]["ragckpt"]
    for bi, b in enumerate(manifest["buffers"]):
        assert b["storage_dtype"] == b["dtype"]
        doc = json.loads(Path(url, "buffers", str(bi), "zarr.json").read_text())
        assert doc["data_type"] == b["dtype"]
        assert doc["fill_value"] == ([0.0, 0.0] if b["dtype"].startswith("complex") else 0)
        arr = zarr.open_array(os.path.join(url, f"buffers/{bi}"), mode="r")
        assert arr.dtype == np.dtype(b["dtype"]) and arr.shape[0] == ck.world_size
        sizes = ck.layout.rank_sizes(bi)
        for r in range(ck.world_size):
            row = arr[r]
            got = torch.from_numpy(np.ascontiguousarray(row[: int(sizes[r])]))
            assert_bit_equal(got, ck.read_rank(b["name"], r), f"zarr buffers/{bi} rank {r}")
            assert not row[int(sizes[r]) :].view(np.uint8).any()  # never written: the fill value 0


@pytest.mark.parametrize("block_bytes", [1000, 24, 8])
def test_reads_at_block_boundaries_that_split_an_element_alignment(tmp_path: Path, block_bytes: int) -> None:
    """A checksum block of 1000 bytes puts complex128 elements at addresses 8 bytes off their size:
    torch crashed the process (SIGSEGV) copying such a piece; every range now reads bit-exactly."""
    url = str(tmp_path / "ck")
    x = special_tensor((97,), torch.complex128, 3)
    ragckpt.write_global({"c": x, "u": special_tensor((41,), torch.uint64, 4)}, url, 3, "element",
                         block_bytes=block_bytes)
    ck = ragckpt.open(url)
    assert ck.verify().ok
    for a in range(0, 90, 7):
        assert_bit_equal(ck.read_flat("c", a, a + 5), x[a : a + 5])
    assert_bit_equal(ck.read("c"), x)
    assert from_bytes(memoryview(bytearray(as_bytes(x)))[8:8 + 32], "complex128").data_ptr() % 16 == 0


@pytest.mark.parametrize("W", [1, 3, 8])
def test_save_shard_per_rank_and_read_rank_in_place(tmp_path: Path, W: int) -> None:
    """The engine's path: each rank saves its own flat buffers (params and a moment sharing one
    layout, per-rank extras of the new dtypes), one commit; restart reads every buffer in place."""
    state = more_state(seed=5)
    lay = ragckpt.CheckpointLayout.build({k: (tuple(v.shape), dtype_name(v.dtype)) for k, v in state.items()}, W,
                                         "ragged")
    moment = {f"optim.state.{k}.exp_avg": special_tensor(tuple(v.shape), torch.complex64, 50 + i)
              for i, (k, v) in enumerate(state.items()) if v.dtype == torch.complex64}
    lay = lay.with_buffer("optim.exp_avg", "complex64", like="complex64", tensors=list(moment))
    url = str(tmp_path / "ck")
    everything = {**state, **moment}
    for r in reversed(range(W)):
        bufs = {b.name: rank_buffer(lay, bi, everything, r) for bi, b in enumerate(lay.buffers)}
        extra = {NAMES[dt]: special_tensor((3,), dt, r) for dt in HF_DTYPES}  # extras are safetensors
        ragckpt.save_shard(url, r, bufs, lay, extra=extra)
    ragckpt.commit(url)
    ck = ragckpt.open(url)
    assert ck.verify().ok
    for name, want in everything.items():
        assert_bit_equal(ck.read(name), want, name)
    for r in range(W):
        for bi, b in enumerate(lay.buffers):
            want = rank_buffer(lay, bi, everything, r)
            out = torch.full_like(want, 7) if want.numel() else want.clone()
            got = ck.read_rank(b.name, r, out=out)
            assert got.data_ptr() == out.data_ptr()  # verified in place
            assert_bit_equal(out, want, f"{b.name} rank {r}")
        tensors, _ = ck.extra(r)
        for dt in HF_DTYPES:
            assert_bit_equal(tensors[NAMES[dt]], special_tensor((3,), dt, r), f"extra {NAMES[dt]}")


def test_a_complex128_extra_is_refused_by_name_before_anything_is_written(tmp_path: Path) -> None:
    lay = ragckpt.CheckpointLayout.build({"w": ((4,), "float32")}, 1, "row")
    url = tmp_path / "ck"
    for save in (ragckpt.save_shard, ragckpt.save_shard_async):
        with pytest.raises(ragckpt.FormatError, match=r"rank 0: extra 'f' is complex128, which the extras object "
                                                      r"\(safetensors\) cannot hold"):
            save(str(url), 0, {"float32": torch.zeros(4)}, lay, extra={"f": torch.zeros(2, dtype=torch.complex128)})
    assert not url.exists()


# -- resharding ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("src_kind,dst_kind", [("ragged", "row"), ("row", "element"), ("element", "ragged")])
def test_reshard_offline_and_at_load_time(tmp_path: Path, src_kind: str, dst_kind: str) -> None:
    """8 -> 1, 3 and 8 ranks, to another layout kind: the offline reshard holds every tensor, and
    `ragckpt.load` of the source into the resharded layout gives exactly its rank buffers."""
    state = more_state(seed=7)
    # many tiny tensors: thousands of short runs take the batched (index-array) copy paths
    state.update({f"small.{i}.{NAMES[dt]}": special_tensor((3,), dt, 100 + i)
                  for i in range(40) for dt in MORE_DTYPES})
    src = str(tmp_path / "src")
    ragckpt.write_global(state, src, 8, src_kind)
    for W2 in (1, 3, 8):
        dst = str(tmp_path / f"to{W2}")
        reshard(src, dst, W2, layout=dst_kind)
        ck2 = ragckpt.open(dst)
        assert ck2.world_size == W2 and ck2.kind == dst_kind and ck2.verify().ok
        for name, want in state.items():
            assert_bit_equal(ck2.read(name), want, f"{name} at {W2}")
        for r in range(W2):
            got = ragckpt.load(src, ck2.layout, r)
            for b in ck2.layout.buffers:
                assert_bit_equal(got[b.name], ck2.read_rank(b.name, r), f"load {b.name} rank {r} of {W2}")


def test_row_shards_over_many_ranks(tmp_path: Path) -> None:
    """A row layout over 100 ranks cuts each tensor into 100 short pieces: the scatter of write_global
    and the gathers of reshard and load move them in batches of index arrays, not one slice each."""
    state = {f"w.{NAMES[dt]}": special_tensor((200, 3), dt, i) for i, dt in enumerate(MORE_DTYPES)}
    src = str(tmp_path / "src")
    ragckpt.write_global(state, src, 100, "row")
    ck = ragckpt.open(src)
    for name, want in state.items():
        assert_bit_equal(ck.read(name), want, name)
        assert_bit_equal(ck.read_local(name, 99), want[198:].reshape(-1), f"{name} rank 99")
    reshard(src, str(tmp_path / "dst"), 7, layout="element")
    ck2 = ragckpt.open(str(tmp_path / "dst"))
    for name, want in state.items():
        assert_bit_equal(ck2.read(name), want, name)
    for r in (0, 6):
        got = ragckpt.load(src, ck2.layout, r)
        for b in ck2.layout.buffers:
            assert_bit_equal(got[b.name], ck2.read_rank(b.name, r), f"load {b.name} rank {r}")


def test_reshard_cli(tmp_path: Path) -> None:
    state = more_state(seed=9)
    ragckpt.write_global(state, str(tmp_path / "src"), 3, "row")
    code, _, err = cli_run("reshard", str(tmp_path / "src"), str(tmp_path / "dst"), "--to", "8", "--layout", "ragged")
    assert code == 0, err
    ck = ragckpt.open(str(tmp_path / "dst"))
    assert ck.world_size == 8
    for name, want in state.items():
        assert_bit_equal(ck.read(name), want, name)


# -- the command line shows the names -----------------------------------------------------------------------

def test_info_and_ls_show_the_dtype_names(tmp_path: Path) -> None:
    state = {f"w.{NAMES[dt]}": special_tensor((6, 2), dt) for dt in MORE_DTYPES}
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, 2)
    code, out, err = cli_run("info", url)
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("dtypes"))
    assert all(f"{NAMES[dt]} x1" in line for dt in MORE_DTYPES), line
    code, out, err = cli_run("info", url, "--json")
    assert code == 0 and json.loads(out)["dtypes"] == {NAMES[dt]: 1 for dt in MORE_DTYPES}, err
    code, out, err = cli_run("ls", url, "-l")
    assert code == 0, err
    rows = {x.split()[0]: x.split() for x in out.splitlines() if x.strip()}
    for dt in MORE_DTYPES:
        assert NAMES[dt] in rows[f"w.{NAMES[dt]}"], out
    code, out, err = cli_run("ls", url, "-l", "--json")
    assert code == 0, err
    assert {e["name"]: e["dtype"] for e in json.loads(out)} == {f"w.{NAMES[dt]}": NAMES[dt] for dt in MORE_DTYPES}


# -- DCP ----------------------------------------------------------------------------------------------------






@pytest.mark.parametrize("layout,W", [("ragged", 3), ("row", 8), ("element", 1)])
def test_dcp_import_and_export_against_torch(tmp_path: Path, layout: str, W: int) -> None:
    """torch's dcp.save -> import-dcp -> ragckpt holds the tensors; export-dcp (small chunks: a
    tensor spans several records) -> torch's dcp.load gives them back, and so does importing the
    export again (ragckpt's own reader of torch.save records, ComplexFloatStorage included)."""
    state = more_state(seed=11)
    dcp_save({"model": state}, tmp_path / "dcp")
    s = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "rag"), world_size=W, layout=layout)
    assert s.tensors == len(state)
    ck = ragckpt.open(str(tmp_path / "rag"))
    assert ck.verify().ok
    for name, want in state.items():
        assert_bit_equal(ck.read(name), want, name)
    export_dcp(str(tmp_path / "rag"), str(tmp_path / "out"), max_chunk_bytes=200)
    got = {"model": {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}}
    dcp_load(got, tmp_path / "out")
    for name, want in state.items():
        assert_bit_equal(got["model"][name], want, f"dcp.load {name}")
    import_dcp(str(tmp_path / "out"), str(tmp_path / "again"), world_size=2)
    ck = ragckpt.open(str(tmp_path / "again"))
    for name, want in state.items():
        assert_bit_equal(ck.read(name), want, f"re-import {name}")


def test_dcp_cli_both_ways(tmp_path: Path) -> None:
    state = more_state(seed=13)
    dcp_save({"model": state}, tmp_path / "dcp")
    code, _, err = cli_run("import-dcp", str(tmp_path / "dcp"), str(tmp_path / "rag"), "--world-size", "3")
    assert code == 0, err
    code, _, err = cli_run("export-dcp", str(tmp_path / "rag"), str(tmp_path / "out"), "--chunk-mib", "0.001")
    assert code == 0, err
    got = {"model": {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}}
    dcp_load(got, tmp_path / "out")
    for name, want in state.items():
        assert_bit_equal(got["model"][name], want, name)


def test_dcp_import_refuses_a_dtype_ragckpt_does_not_store(tmp_path: Path) -> None:
    with warnings.catch_warnings():  # "ComplexHalf support is experimental"
        warnings.simplefilter("ignore")
        half = torch.zeros(2, dtype=torch.complex32)
    dcp_save({"model": {"x": half, "y": torch.zeros(3)}}, tmp_path / "dcp")
    line = cli_error("import-dcp", str(tmp_path / "dcp"), str(tmp_path / "rag"), "--world-size", "1")
    assert "tensor 'model.x' has dtype torch.complex32, which ragckpt does not store" in line, line
    assert not (tmp_path / "rag").exists()


# -- Hugging Face safetensors -------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,W", [("ragged", 3), ("row", 8), ("element", 1)])
def test_hf_both_ways_against_safetensors(tmp_path: Path, layout: str, W: int) -> None:
    """safetensors' save_file -> import-hf -> ragckpt -> export-hf -> safetensors' load_file, bit for
    bit, with the header codes safetensors itself writes (C64, U16, U32, U64)."""
    state = more_state(HF_DTYPES, seed=17, prefix="model.layers")
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    import_hf(str(tmp_path / "model.safetensors"), str(tmp_path / "ck"), W, layout=layout)
    ck = ragckpt.open(str(tmp_path / "ck"))
    for name, want in state.items():
        assert_bit_equal(ck.read(name), want, name)
    res = export_hf(str(tmp_path / "ck"), str(tmp_path / "hf"), max_shard_size=2000)
    assert len(res.files) > 1  # sharded, with an index
    got, codes = {}, {}
    for f in res.files:
        got.update(load_file(tmp_path / "hf" / f))
        raw = (tmp_path / "hf" / f).read_bytes()
        header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
        codes.update({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})
    assert set(got) == set(state)
    assert codes == {k: {"complex64": "C64", "uint16": "U16", "uint32": "U32", "uint64": "U64"}[k.split(".")[-1]]
                     for k in state}
    for name, want in state.items():
        assert_bit_equal(got[name], want, f"export {name}")


def test_hf_cli_both_ways_and_casts_leave_complex_alone(tmp_path: Path) -> None:
    """`--dtype bf16` casts floating-point tensors only: complex64 and the uints are copied as they are."""
    state = more_state(HF_DTYPES, seed=19, prefix="model.layers")
    state["model.norm.weight"] = special_tensor((6,), torch.float32, 3)
    (tmp_path / "model").mkdir()
    save_file(state, tmp_path / "model" / "model.safetensors")
    code, _, err = cli_run("import-hf", str(tmp_path / "model"), str(tmp_path / "ck"), "--world-size", "3")
    assert code == 0, err
    code, _, err = cli_run("export-hf", str(tmp_path / "ck"), str(tmp_path / "hf"), "--dtype", "bf16")
    assert code == 0, err
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert got["model.norm.weight"].dtype == torch.bfloat16
    for name, want in state.items():
        if name != "model.norm.weight":
            assert_bit_equal(got[name], want, name)


def test_hf_export_refuses_complex128_by_name_before_writing(tmp_path: Path) -> None:
    """safetensors has no 128-bit complex type: a complex128 model tensor fails the export with one
    line naming it and its dtype, and nothing is created. Optimizer state is not exported unless
    asked for (--all-tensors), so a complex128 moment is skipped without it and refused with it."""
    url = str(tmp_path / "ck")
    state = {"model.freqs_cis": special_tensor((8, 4), torch.complex128), "model.w": special_tensor((4,), torch.uint16)}
    ragckpt.write_global(state, url, 2)
    line = cli_error("export-hf", url, str(tmp_path / "hf"))
    assert "tensor 'model.freqs_cis' is complex128, which safetensors cannot store" in line, line
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ragckpt.FormatError, match="tensor 'model.freqs_cis' is complex128, which safetensors"):
        export_hf(url, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
    # leaving it out works
    code, _, err = cli_run("export-hf", url, str(tmp_path / "hf"), "--include", "model.w")
    assert code == 0, err
    assert_bit_equal(load_file(tmp_path / "hf" / "model.safetensors")["model.w"], state["model.w"], "model.w")

    opt = {"model.w": special_tensor((4,), torch.complex64),
           "optim.state.model.w.exp_avg": special_tensor((4,), torch.complex128, 1)}
    ragckpt.write_global(opt, str(tmp_path / "opt"), 2)
    code, _, err = cli_run("export-hf", str(tmp_path / "opt"), str(tmp_path / "hf2"))
    assert code == 0, err
    assert list(load_file(tmp_path / "hf2" / "model.safetensors")) == ["model.w"]
    line = cli_error("export-hf", str(tmp_path / "opt"), str(tmp_path / "hf3"), "--all-tensors")
    assert "tensor 'optim.state.model.w.exp_avg' is complex128" in line, line
    assert not (tmp_path / "hf3").exists()


def test_hf_import_refuses_a_dtype_ragckpt_does_not_store(tmp_path: Path) -> None:
    """Other writers' codes that safetensors-rs knows but ragckpt does not store are refused by name."""
    doc = json.dumps({"x": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [0, 2]}}).encode()
    doc += b" " * (-len(doc) % 8)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(doc)) + doc + b"\0\0")
    line = cli_error("import-hf", str(tmp_path), str(tmp_path / "ck"), "--world-size", "2")
    assert "tensor 'x' has dtype F8_E8M0, which ragckpt does not support" in line, line


# -- FSDP2 state dicts --------------------------------------------------------------------------------------

def test_fsdp2_state_dict_save_and_load(group: None, tmp_path: Path) -> None:
    """A torchtitan-style complex64 `freqs_cis` buffer (a plain tensor, saved once and checksummed
    as a replica) and Shard(0) DTensors of every new dtype save and load back in place. (gloo cannot
    scatter uints, so the DTensors are built from their local shards, as FSDP2 does.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from ragckpt.integrations.fsdp2 import load_state_dict, save_state_dict

    mesh = init_device_mesh("cpu", (1,))

    def make(seed: int | None) -> dict:
        def val(shape: tuple[int, ...], dt: torch.dtype, s: int) -> torch.Tensor:
            return special_tensor(shape, dt, s) if seed is not None else torch.zeros(shape, dtype=dt)

        model = {"freqs_cis": val((16, 4), torch.complex64, 1)}
        for i, dt in enumerate(MORE_DTYPES):
            model[f"layers.{i}.w_{NAMES[dt]}"] = DTensor.from_local(val((5, 3), dt, 10 + i), mesh, [Shard(0)])
            model[f"layers.{i}.b_{NAMES[dt]}"] = val((3,), dt, 20 + i)
            model[f"layers.{i}.s_{NAMES[dt]}"] = val((), dt, 30 + i)
        return {"model": model, "optim": {"state.layers.0.w_complex64.exp_avg":
                                          DTensor.from_local(val((5, 3), torch.complex64, 40), mesh, [Shard(0)])}}

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    url = str(tmp_path / "ck")
    src = make(0)
    save_state_dict(url, src)
    ck = ragckpt.open(url)
    assert ck.verify().ok
    assert ck.meta("freqs_cis").dtype == "complex64"
    for key, t in src["model"].items():
        assert_bit_equal(ck.read(key), local(t), key)
    dst = make(None)
    ptrs = {k: local(v).data_ptr() for k, v in dst["model"].items()}
    load_state_dict(url, dst)
    for key, t in src["model"].items():
        assert local(dst["model"][key]).data_ptr() == ptrs[key]  # filled in place
        assert_bit_equal(local(dst["model"][key]), local(t), key)
    k = "state.layers.0.w_complex64.exp_avg"
    assert_bit_equal(local(dst["optim"][k]), local(src["optim"][k]), k)


def test_bool_bytes_other_than_0_and_1_are_stored_as_they_are(tmp_path: Path) -> None:
    """torch's bool copy (copy_, clone, slice assignment) turns every nonzero byte into 1: write_global's
    flat layouts and the staging copies of save_shard and save_shard_async stored [0, 1, 2, 255, 7]
    as [0, 1, 1, 1, 1], while row layouts, reshard and import-hf kept the bytes."""
    raw = torch.tensor([0, 1, 2, 255, 7, 0, 9, 128], dtype=torch.uint8)
    flag = raw.view(torch.bool)
    for kind in ("ragged", "element", "row"):
        ragckpt.write_global({"flag": flag}, str(tmp_path / kind), 3, layout=kind)
        got = ragckpt.open(str(tmp_path / kind)).read("flag")
        assert got.view(torch.uint8).tolist() == raw.tolist(), kind
    lay = ragckpt.CheckpointLayout.build({"flag": ((8,), "bool")}, 1, "row")
    wide = torch.zeros(16, dtype=torch.uint8)
    wide[::2] = raw
    strided = wide.view(torch.bool)[::2]  # not contiguous: save_shard stages a copy
    extra = {"mask": strided, "one": raw[3:4].view(torch.bool).reshape(())}  # extras were cloned: same fault
    ragckpt.save_shard(str(tmp_path / "sync"), 0, {"bool": strided}, lay, extra=extra)
    ragckpt.commit(str(tmp_path / "sync"))
    ragckpt.save_shard_async(str(tmp_path / "async"), 0, {"bool": flag}, lay, extra=extra).result()
    ragckpt.commit(str(tmp_path / "async"))
    for where in ("sync", "async"):
        ck = ragckpt.open(str(tmp_path / where))
        assert ck.read("flag").view(torch.uint8).tolist() == raw.tolist(), where
        tensors, _ = ck.extra(0)
        assert tensors["mask"].view(torch.uint8).tolist() == raw.tolist(), where
        assert tensors["one"].view(torch.uint8).item() == 255, where
        out = torch.zeros(8, dtype=torch.bool)
        ck.read_rank("bool", 0, out=out)
        assert out.view(torch.uint8).tolist() == raw.tolist(), where
        into = torch.zeros(8, dtype=torch.bool)
        ragckpt.load(ck, lay, 0, into={"bool": into})
        assert into.view(torch.uint8).tolist() == raw.tolist(), where


def test_plain_zarr_walks_every_table_of_the_hierarchy(tmp_path: Path) -> None:
    """meta/units and meta/crc had no group document, so zarr's walk of the hierarchy (and any
    zarr-level copy) skipped the checksum and units tables; they opened only by path."""
    state = {"a": torch.arange(12.0).reshape(6, 2), "b": torch.ones(3, dtype=torch.bfloat16)}
    ragckpt.write_global(state, str(tmp_path / "ck"), 3, layout="row")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ranks/ and COMMITTED are not zarr nodes, as FORMAT.md says
        members = {n for n, _ in zarr.open_group(str(tmp_path / "ck"), mode="r").members(max_depth=None)}
    assert {"meta/crc/0", "meta/crc/1", "meta/units/0", "meta/units/1", "meta/extra"} <= members, members
    assert ragckpt.open(str(tmp_path / "ck")).verify().ok
