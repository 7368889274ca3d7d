"""Python API misuse: one clear error before anything is written or deleted, never silent wrong data
(from an adversarial review of the public API)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import ragckpt
from ragckpt import LayoutError, OutOfRangeError, UnknownNameError
from ragckpt.format.dtypes import torch_dtype
from ragckpt.format.placement import RaggedShard
from tests.helpers import assert_bit_equal


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# -- commit: every rank must have saved for the same layout and attempt ------------------------------------

def test_commit_refuses_a_rank_saved_with_another_tensor_order(tmp_path):
    url = str(tmp_path / "ck")
    ab = ragckpt.CheckpointLayout.build({"a": ((2, 2), "float32"), "b": ((2, 2), "float32")}, 2, "row")
    ba = ragckpt.CheckpointLayout.build({"b": ((2, 2), "float32"), "a": ((2, 2), "float32")}, 2, "row")
    ragckpt.save_shard(url, 0, {"float32": torch.zeros(4)}, ab)
    ragckpt.save_shard(url, 1, {"float32": torch.ones(4)}, ba)  # same sizes, other meaning
    with pytest.raises(ragckpt.FormatError, match=r"rank 1 saved for another layout .*ranks/1\.json\) than rank 0.s "
                       r"metadata .*if rank 0 has not re-saved yet, commit after it has"):
        ragckpt.commit(url)


def test_commit_refuses_records_out_of_order_or_malformed_before_writing(tmp_path):
    """Records swapped by a mis-ordered gather committed a checkpoint whose every read then said
    "checksum mismatch ... restore it", blaming the disk; malformed ones gave bare KeyErrors."""
    lay = ragckpt.CheckpointLayout.build({"w": ((6, 4), "float32")}, 3)
    url = str(tmp_path / "ck")
    docs = [ragckpt.save_shard(url, r, {"float32": torch.arange(8.0) + 100 * r}, lay) for r in range(3)]
    before = _files(tmp_path / "ck")
    cases = [({0: docs[1], 1: docs[0], 2: docs[2]}, ragckpt.FormatError, r"rank_manifests\[0\] is the record of rank 1"),
             ({0: {}}, ragckpt.FormatError, r"rank_manifests\[0\] is not a save_shard record"),
             ({0: None}, ragckpt.FormatError, r"rank_manifests\[0\] is not a save_shard record \(got NoneType\)"),
             ({0: {**docs[0], "buffers": {"0": 5}}}, ragckpt.FormatError, "buffer 0 is no"),
             ({3: docs[0]}, LayoutError, "key 3, not a rank of this 3-rank checkpoint"),
             ({"0": docs[0]}, LayoutError, "key '0'"),
             (docs[::-1], ragckpt.FormatError, r"rank_manifests\[0\] is the record of rank 2"),
             (docs[:2], LayoutError, "a list of 2 records for a 3-rank checkpoint; give every rank's record"),
             (set(), TypeError, "got a set")]
    for given, err, msg in cases:
        with pytest.raises(err, match=msg):
            ragckpt.commit(url, rank_manifests=given)
    assert _files(tmp_path / "ck") == before  # nothing written: no tables, no marker
    # a record in storage that names another rank (a copied file) is refused the same way
    (tmp_path / "ck" / "ranks" / "2.json").write_bytes((tmp_path / "ck" / "ranks" / "1.json").read_bytes())
    with pytest.raises(ragckpt.FormatError, match=r"ranks/2\.json is the record of rank 1, not of rank 2"):
        ragckpt.commit(url)
    ragckpt.commit(url, rank_manifests=docs)  # as all_gather_object gives them: a list in rank order
    assert_bit_equal(ragckpt.open(url).read("w").reshape(-1)[:8], torch.arange(8.0))


def test_save_id_tells_a_retry_from_an_earlier_attempt(tmp_path):
    url = str(tmp_path / "ck")
    lay = ragckpt.CheckpointLayout.build({"w": ((8, 4), "float32")}, 2, "row")
    for r in range(2):  # attempt 1 wrote both ranks, then died before commit
        ragckpt.save_shard(url, r, {"float32": torch.zeros(16)}, lay, save_id="step100-try1")
    ragckpt.save_shard(url, 0, {"float32": torch.ones(16)}, lay, save_id="step100-try2")  # the retry, rank 0 only
    with pytest.raises(ragckpt.FormatError, match=r"re-save rank 1 with the layout and save_id rank 0 used, or, "
                                                  r"if rank 0 has not re-saved yet, commit after it has$"):
        ragckpt.commit(url)
    ragckpt.save_shard(url, 1, {"float32": torch.ones(16)}, lay, save_id="step100-try2")
    ragckpt.commit(url)
    assert torch.equal(ragckpt.open(url).read("w"), torch.ones(8, 4))


# -- write_global checks its input before touching the destination ---------------------------------------

@pytest.mark.parametrize("bad, match", [
    ({"a": torch.ones(4, 4), "b": torch.arange(6)}, r"tensor 'b' is \(6,\) int64, the layout expects \(6,\) float32"),
    ({"a": torch.ones(2, 4), "b": torch.ones(6)}, r"tensor 'a' is \(2, 4\)"),
    ({"a": torch.ones(4, 4), "b": torch.ones(6), "c": torch.ones(1)}, "tensor 'c' is not in the layout"),
    ({"a": torch.ones(4, 4)}, "tensor 'b' of the layout is missing"),
])
def test_write_global_checks_state_against_a_given_layout(tmp_path, bad, match):
    lay = ragckpt.CheckpointLayout.build({"a": ((4, 4), "float32"), "b": ((6,), "float32")}, 2, "row")
    with pytest.raises(LayoutError, match=match):
        ragckpt.write_global(bad, str(tmp_path / "ck"), 2, lay)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("kwargs, err, match", [
    ({"user": {"cfg": {1, 2}}}, ValueError, "user metadata is not plain JSON"),
    ({"user": {"lr": math.nan}}, ValueError, "user metadata is not plain JSON"),
    ({"user": [1, 2]}, TypeError, "user metadata must be a dict"),
    ({"block_bytes": 0}, ValueError, "block_bytes must be an integer from 1 to 1,073,741,824, got 0"),
    ({"block_bytes": 1 << 31}, ValueError, "block_bytes must be an integer from 1 to 1,073,741,824"),
    ({"max_chunk_bytes": -1}, ValueError, "max_chunk_bytes must be an integer from 1 to"),
])
def test_bad_arguments_never_cost_the_existing_checkpoint(tmp_path, kwargs, err, match):
    url = str(tmp_path / "ck")
    state = {"a": torch.arange(8.0)}
    ragckpt.write_global(state, url, 2)
    before = _files(tmp_path / "ck")
    with pytest.raises(err, match=match):
        ragckpt.write_global({"a": torch.zeros(8)}, url, 2, overwrite=True, **kwargs)
    assert _files(tmp_path / "ck") == before
    with pytest.raises(err, match=match):  # and a fresh destination is left untouched too
        ragckpt.write_global(state, str(tmp_path / "fresh"), 2, **kwargs)
    assert not (tmp_path / "fresh").exists()


def test_write_global_rejects_values_without_data(tmp_path):
    with pytest.raises(TypeError, match=r"tensor 'x' is a list"):
        ragckpt.write_global({"x": [1, 2]}, str(tmp_path / "a"), 2)
    with pytest.raises(ValueError, match="meta device"):
        ragckpt.write_global({"x": torch.empty(4, device="meta")}, str(tmp_path / "b"), 2)


# -- save_shard arguments ------------------------------------------------------------------------------------

def test_save_shard_argument_checks(tmp_path):
    url = str(tmp_path / "ck")
    lay = ragckpt.CheckpointLayout.build({"w": ((8,), "float32")}, 2, "row")
    buf = torch.zeros(4)
    with pytest.raises(TypeError, match=r"extra 'step' is a int"):
        ragckpt.save_shard(url, 0, {"float32": buf}, lay, extra={"step": 5})
    with pytest.raises(TypeError, match=r"buffer 'float32' is a list"):
        ragckpt.save_shard(url, 0, {"float32": [0.0] * 4}, lay)
    with pytest.raises(LayoutError, match="buffer 'bf16' is not in the layout"):
        ragckpt.save_shard(url, 0, {"float32": buf, "bf16": buf}, lay)
    with pytest.raises(TypeError, match="rank must be an integer"):
        ragckpt.save_shard(url, 1.0, {"float32": buf}, lay)
    with pytest.raises(ValueError, match="block_bytes"):
        ragckpt.save_shard(url, 0, {"float32": buf}, lay, block_bytes=-64)
    assert not (tmp_path / "ck").exists()
    # extras that share memory (views of one tensor) are fine: they are copied
    t = torch.arange(10)
    for r in range(2):
        ragckpt.save_shard(url, r, {"float32": torch.full((4,), float(r))}, lay, extra={"x": t, "y": t[2:5]})
    ragckpt.commit(url)
    ex, _ = ragckpt.open(url).extra(1)
    assert torch.equal(ex["y"], t[2:5]) and torch.equal(ex["x"], t)


def test_save_shard_refuses_non_zero_layout_padding(tmp_path):
    lay = ragckpt.CheckpointLayout.build({"w": ((5,), "float32")}, 2, "element")  # 3 + 3 elements, 1 of padding
    buf = torch.full((3,), 7.0)
    with pytest.raises(LayoutError, match=r"rank 1: buffer 'float32' holds non-zero values in layout padding "
                                          r"\(elements \[2, 3\)\)"):
        ragckpt.save_shard(str(tmp_path / "ck"), 1, {"float32": buf}, lay)
    buf[2] = 0
    ragckpt.save_shard(str(tmp_path / "ck"), 1, {"float32": buf}, lay)


# -- readers ---------------------------------------------------------------------------------------------------

@pytest.fixture()
def ck(tmp_path):
    url = str(tmp_path / "ck")
    ragckpt.write_global({"a": torch.arange(24.0).reshape(6, 4)}, url, 3, "row")
    return ragckpt.open(url)


def test_read_flat_fills_an_nd_out_in_flat_order(ck):
    out = torch.empty(3, 8)
    ck.read_flat("a", out=out)
    assert_bit_equal(out.reshape(-1), torch.arange(24.0))
    with pytest.raises(ValueError, match="1-D or contiguous"):
        ck.read_flat("a", out=torch.empty(8, 3).t())


def test_read_rank_out_must_be_a_tensor_with_memory(ck):
    """A meta `out` raised numpy's "can't convert meta device type tensor", a list an AttributeError,
    neither naming the buffer or rank."""
    with pytest.raises(TypeError, match="buffer 'float32' rank 1: out must be a tensor with memory .*got a meta tensor"):
        ck.read_rank("float32", 1, out=torch.empty(8, device="meta"))
    with pytest.raises(TypeError, match="buffer 'float32' rank 1: out must be a tensor .*got list"):
        ck.read_rank("float32", 1, out=[0.0] * 8)
    out = torch.empty(8)
    assert ck.read_rank("float32", 1, out=out) is out
    assert_bit_equal(out, torch.arange(8.0, 16.0))


def test_read_flat_out_must_be_a_tensor_with_memory(ck):
    """A meta `out` was returned as it was, nothing read and nothing said."""
    with pytest.raises(TypeError, match="tensor 'a': out must be a tensor with memory .*got a meta tensor"):
        ck.read_flat("a", out=torch.empty(24, device="meta"))
    with pytest.raises(TypeError, match="tensor 'a': out must be a tensor .*got list"):
        ck.read_flat("a", out=[0.0] * 24)


def test_rank_and_range_arguments_are_checked(ck):
    for bad in (3, -1):
        with pytest.raises(OutOfRangeError, match=rf"rank {bad} is outside .* 3 ranks"):
            ck.read_local("a", bad)
        with pytest.raises(OutOfRangeError, match=rf"rank {bad}"):
            ck.read_rank("float32", bad)
        with pytest.raises(OutOfRangeError, match=rf"rank {bad}"):
            ck.extra(bad)
    for start, stop in ((-2, 3), (5, 2), (0, 100)):
        with pytest.raises(OutOfRangeError, match=rf"range \[{start}, {stop}\) is outside its 8 elements"):
            ck.read_rank("float32", 0, start, stop)
    assert ck.read_rank("float32", 0, 3, 3, out=torch.empty(0)).numel() == 0
    with pytest.raises(OutOfRangeError):
        ck.read_flat("a", 0, 25)
    with pytest.raises(UnknownNameError) as e:
        ck.read("nope")
    assert isinstance(e.value, KeyError) and str(e.value).startswith("tensor 'nope' is not in")


@pytest.mark.parametrize("shape, start, stop", [((2, 3), 0, 100), ((2, 0, 3), 0, 1), ((2, 3), 0.5, 2), ((2, 3), 4, 2)])
def test_flat_range_to_boxes_checks_its_range(shape, start, stop):
    with pytest.raises(LayoutError):
        ragckpt.flat_range_to_boxes(shape, start, stop)
    assert ragckpt.flat_range_to_boxes((2, 0, 3), 0, 0) == []


def test_layout_builders_reject_zero_and_non_integer_sizes():
    for call in (lambda: ragckpt.element_layout([(4,)], 0), lambda: ragckpt.element_layout([(4,)], 2, align=0),
                 lambda: ragckpt.row_layout([()], 0), lambda: RaggedShard.flat_partition([(4,)], 0),
                 lambda: ragckpt.CheckpointLayout.build({"a": ((4,), "float32")}, 2.5, "row")):
        with pytest.raises(LayoutError, match="must be a positive integer"):
            call()
    with pytest.raises(ValueError, match="non-negative"):
        ragckpt.aligned_empty(-1, torch.float32)
    with pytest.raises(ragckpt.FormatError, match="unknown dtype 'fp32'; supported"):
        ragckpt.CheckpointLayout.build({"a": ((4,), "fp32")}, 2, "row")


def test_user_metadata_stays_plain_json(tmp_path):
    url = str(tmp_path / "ck")
    ragckpt.write_global({"a": torch.ones(2)}, url, 1, user={"lr": 1e-3, "tags": ["x"], "n": None})
    doc = json.loads((tmp_path / "ck" / "zarr.json").read_text())
    assert doc["attributes"]["ragckpt"]["user"] == {"lr": 1e-3, "tags": ["x"], "n": None}


def test_fractional_or_negative_sizes_are_refused_not_truncated():
    for call in (lambda: RaggedShard((0,), (1.5, 2.5)),
                 lambda: ragckpt.CheckpointLayout.build({"a": ((4.5,), "float32")}, 2, "row"),
                 lambda: ragckpt.CheckpointLayout.build({"a": ((-4,), "float32")}, 2, "ragged"),
                 lambda: ragckpt.plan([4], [-3], 2)):
        with pytest.raises(LayoutError, match="must be non-negative integers"):
            call()


def test_rank0_save_shard_with_a_wrong_buffer_writes_nothing(tmp_path):
    lay = ragckpt.CheckpointLayout.build({"w": ((8,), "float32")}, 2, "row")
    with pytest.raises(LayoutError, match="has dtype float64, layout says float32"):
        ragckpt.save_shard(str(tmp_path / "ck"), 0, {"float32": torch.zeros(4, dtype=torch.float64)}, lay)
    assert not (tmp_path / "ck").exists()


def test_rank0_save_shard_never_replaces_another_datasets_zarr_json(tmp_path):
    """Pointed at a plain zarr array or group (or a directory whose zarr.json is any other file),
    rank 0 replaced its zarr.json with a checkpoint's and the dataset lost its metadata. An earlier
    attempt at the same save is still redone."""
    import zarr

    lay = ragckpt.CheckpointLayout.build({"w": ((4, 3), "float32")}, 2, "row")
    zarr.create_array(str(tmp_path / "array"), shape=(4,), dtype="f4")
    zarr.open_group(str(tmp_path / "group"), mode="w")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "zarr.json").write_text("my notes")
    for name, what in (("array", "a plain zarr group or array"), ("group", "a plain zarr group or array"),
                       ("text", "a file")):
        before = (tmp_path / name / "zarr.json").read_bytes()
        with pytest.raises(ragckpt.DestinationExistsError, match=rf"zarr.json belongs to {what}, not to a ragckpt "
                                                                   r"checkpoint; save_shard would replace it"):
            ragckpt.save_shard(str(tmp_path / name), 0, {"float32": torch.ones(6)}, lay)
        assert (tmp_path / name / "zarr.json").read_bytes() == before
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == sorted(
            {"array": ["zarr.json"], "group": ["zarr.json"], "text": ["zarr.json"]}[name])
    url = str(tmp_path / "retry")
    ragckpt.save_shard(url, 0, {"float32": torch.zeros(6)}, lay)
    ragckpt.save_shard(url, 0, {"float32": torch.ones(6)}, lay)  # rank 0 again: its own zarr.json is redone
    ragckpt.save_shard(url, 1, {"float32": torch.full((6,), 2.0)}, lay)
    ragckpt.commit(url)
    assert torch.equal(ragckpt.open(url).read("w"), torch.tensor([1.0] * 6 + [2.0] * 6).reshape(4, 3))


def test_one_element_views_with_any_stride_are_accepted(tmp_path):
    """A 1-element view such as `x[::2]` of a 2-element tensor counts as contiguous (torch says so);
    reading into it and saving from it used to fail viewing it as bytes."""
    lay = ragckpt.CheckpointLayout.build({"w": ((2,), "float32")}, 2, "element")
    url = str(tmp_path / "ck")
    for r, v in enumerate((3.5, -1.0)):
        ragckpt.save_shard(url, r, {"float32": torch.tensor([v, 99.0])[::2]}, lay)
    ragckpt.commit(url)
    out = torch.zeros(2)[::2]
    ragckpt.open(url).read_rank("float32", 1, 0, 1, out=out)
    assert out.item() == -1.0
    assert torch.equal(ragckpt.open(url).read("w"), torch.tensor([3.5, -1.0]))


def test_numpy_integer_ranks_work_like_ints_and_other_types_are_refused(tmp_path):
    """A rank taken from an array (`np.int64`): save_shard wrote half a rank and then failed to
    serialise its record; load called it out of range."""
    state = {"w": torch.arange(24.0).reshape(8, 3)}
    lay = ragckpt.CheckpointLayout.build({"w": ((8, 3), torch.float32)}, 2, "row")
    ref = str(tmp_path / "ref")
    ragckpt.write_global(state, ref, world_size=2, layout="row")
    url = str(tmp_path / "ck")
    for r in np.arange(2):
        assert ragckpt.save_shard(url, r, ragckpt.load(ref, lay, r), lay)["rank"] == int(r)
    ragckpt.commit(url)
    assert_bit_equal(ragckpt.open(url).read("w"), state["w"])
    got = ragckpt.load(url, lay, np.int32(1))["float32"]
    assert_bit_equal(got, state["w"][4:].reshape(-1))
    with pytest.raises(TypeError, match="rank must be an integer, got 1.0"):
        ragckpt.load(url, lay, 1.0)
    with pytest.raises(LayoutError, match="rank 2 is outside the target layout's world size 2"):
        ragckpt.load(url, lay, np.int64(2))


def test_load_into_a_meta_tensor_is_refused(tmp_path):
    url = str(tmp_path / "ck")
    ragckpt.write_global({"w": torch.ones(4, 2)}, url, world_size=1)
    lay = ragckpt.open(url).layout
    with pytest.raises(LayoutError, match="buffer 'float32' is on the meta device and has no memory to load into"):
        ragckpt.load(url, lay, 0, into={"float32": torch.empty(8, device="meta")})


def test_with_buffer_takes_a_torch_dtype_as_build_does():
    lay = ragckpt.CheckpointLayout.build({"w": ((4, 2), torch.float32)}, 2, "ragged")
    by_name = lay.with_buffer("m", "bfloat16", "float32", ["m.w"])
    by_dtype = lay.with_buffer("m", torch.bfloat16, "float32", ["m.w"])
    assert by_dtype.buffers == by_name.buffers and by_dtype.buffers[-1].dtype == "bfloat16"


# -- the second adversarial review: what was silently accepted or raised bare ---------------------------------

@pytest.mark.parametrize("call, err, match", [
    (lambda: ragckpt.CheckpointLayout.build({0: ((4,), "float32")}, 2), LayoutError, "tensor name 0 is not a str"),
    (lambda: ragckpt.CheckpointLayout.build({b"w": ((4,), "float32")}, 2), LayoutError, "tensor name b'w'"),
    (lambda: ragckpt.CheckpointLayout.build({"w": ((5, 4), "float32")}, 2, "row", "element"), LayoutError,
     "granularity applies to ragged layouts only, and this layout is 'row'"),
    (lambda: ragckpt.CheckpointLayout.build({"w": ((5, 4), "float32")}, 2, "element", "whole"), LayoutError,
     "granularity applies to ragged layouts only, and this layout is 'element'"),
    (lambda: ragckpt.CheckpointLayout.build({"w": ((5, 4), "float32")}, 2, "row", align=64), LayoutError,
     "align applies to flat layouts"),
    (lambda: ragckpt.CheckpointLayout.build({"model.w": ((4, 4), "float32")}, 2, "ragged", {"model.W": "element"}),
     UnknownNameError, "granularity names 1 tensor.*'model.W'"),
    (lambda: ragckpt.CheckpointLayout.build({"w": ((3,), "float32")}, 2, "ragged", align=2**40), LayoutError,
     "align 1099511627776 would pad the layout with"),
    (lambda: ragckpt.CheckpointLayout.build({"w": ((3,), "float32")}, 2, "ragged", align=2.0), LayoutError,
     "align must be a positive integer"),
    (lambda: ragckpt.CheckpointLayout.build({"h": ((2**40, 2**40), "float32")}, 2), LayoutError,
     "tensor 'h' of shape .* more than a layout can address"),
    # sizes that wrap int64 must not slip past the padding check (total_bytes came out 0 or negative)
    (lambda: ragckpt.CheckpointLayout.build({"w": ((3,), "float32")}, 4, "ragged", align=2**62), LayoutError,
     "align 4611686018427387904 at 4 ranks would pad"),
    (lambda: ragckpt.CheckpointLayout.build({"w": ((3,), "float32")}, 2**20, "ragged", align=2**43), LayoutError,
     "align 8796093022208 at 1048576 ranks would pad"),
    (lambda: ragckpt.CheckpointLayout.build({"w": ((3,), "float32")}, 4, "element", align=2**63), LayoutError,
     "would pad"),
    (lambda: ragckpt.CheckpointLayout.build({"w": ((3,), "float32")}, 2, "flat", align=64), LayoutError,
     "cannot build a 'flat' layout automatically; use ragged, row or element"),
    (lambda: ragckpt.CheckpointLayout.build({"w": ((3,), "float32")}, 2, "flat", "element"), LayoutError,
     "cannot build a 'flat' layout"),
])
def test_layouts_refuse_what_they_would_ignore_or_overflow(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_granularity_policies_that_name_every_tensor_or_a_default_still_work():
    """Accepted, and each tensor planned by its own policy: element-granular 'a' flattens both dims,
    whole 'b' is owned by one rank."""
    lay = ragckpt.CheckpointLayout.build({"a": ((4, 4), "float32"), "b": ((6,), "int64")}, 2, "ragged",
                                         {"a": "element", "b": "whole", "*": "row"})
    assert lay.names() == ["a", "b"]
    placements = {n: lay.layout_of(lay.locate(n)[0]).placement(lay.locate(n)[1]) for n in ("a", "b")}
    assert {n: p.dims for n, p in placements.items()} == {"a": (0, 1), "b": ()}
    assert sum(1 for u in placements["b"].local_units if u) == 1
    assert ragckpt.CheckpointLayout.build({"w": ((5, 4), "float32")}, 2, "element", align=4).kind == "element"


@pytest.mark.parametrize("kwargs, err, match", [
    ({"overwrite": "false"}, TypeError, "overwrite must be True or False, got 'false'"),
    ({"workers": 1.5}, ragckpt.OptionError, "workers must be an integer of at least 1, got 1.5"),
])
def test_write_global_flags_and_counts_are_checked_before_anything_is_replaced(tmp_path, kwargs, err, match):
    url = str(tmp_path / "ck")
    ragckpt.write_global({"a": torch.arange(8.0)}, url, 2)
    before = _files(tmp_path / "ck")
    with pytest.raises(err, match=match):
        ragckpt.write_global({"a": torch.zeros(8)}, url, 2, overwrite=kwargs.pop("overwrite", True), **kwargs)
    assert _files(tmp_path / "ck") == before


def test_every_overwrite_flag_must_be_a_bool(tmp_path):
    """overwrite="false" is truthy: it replaced an existing checkpoint or model."""
    from ragckpt.convert.dcp import export_dcp, import_dcp
    from ragckpt.convert.hf_export import export_hf
    from ragckpt.convert.hf_import import import_hf
    from ragckpt.reshard.offline import reshard

    src = str(tmp_path / "src")
    ragckpt.write_global({"w": torch.arange(8.0)}, src, 2)
    calls = [lambda: reshard(src, str(tmp_path / "d1"), 1, overwrite="false"),
             lambda: export_hf(src, str(tmp_path / "d2"), overwrite="no"),
             lambda: export_dcp(src, str(tmp_path / "d3"), overwrite=0),
             lambda: import_hf(str(tmp_path / "d2"), str(tmp_path / "d4"), 1, overwrite="false"),
             lambda: import_dcp(str(tmp_path / "d3"), str(tmp_path / "d5"), overwrite="false")]
    for call in calls:
        with pytest.raises(TypeError, match="overwrite must be True or False"):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("kwargs, match", [({"workers": 1.5}, "workers must be an integer"),
                                           ({"threads": 0}, "threads must be an integer of at least 1"),
                                           ({"from_world_size": "2"}, "from_world_size must be an integer")])
def test_reshard_counts_are_checked(tmp_path, kwargs, match):
    from ragckpt.reshard.offline import reshard

    src = str(tmp_path / "src")
    ragckpt.write_global({"w": torch.arange(8.0)}, src, 2)
    with pytest.raises(ragckpt.OptionError, match=match):
        reshard(src, str(tmp_path / "dst"), 1, **kwargs)
    with pytest.raises(ragckpt.OptionError, match="world_size must be an integer of at least 1, got '2'"):
        reshard(src, str(tmp_path / "dst"), "2")
    assert not (tmp_path / "dst").exists()


def test_tensors_without_plain_memory_are_named_before_writing(tmp_path):
    c = torch.randn(2, dtype=torch.complex64).conj()
    with pytest.raises(TypeError, match="tensor 's' is a sparse_coo tensor; save its dense form"):
        ragckpt.write_global({"s": torch.eye(3).to_sparse()}, str(tmp_path / "a"), 1)
    with pytest.raises(ValueError, match="tensor 'c' is a lazily conjugated"):
        ragckpt.write_global({"c": c}, str(tmp_path / "a"), 1)
    lay = ragckpt.CheckpointLayout.build({"c": ((2,), "complex64")}, 1)
    with pytest.raises(ValueError, match="rank 0: buffer 'complex64' is a lazily conjugated"):
        ragckpt.save_shard(str(tmp_path / "a"), 0, {"complex64": c}, lay)
    lay = ragckpt.CheckpointLayout.build({"w": ((4,), "float32")}, 1)
    with pytest.raises(ragckpt.FormatError, match="extra name '__metadata__' cannot be stored"):
        ragckpt.save_shard(str(tmp_path / "a"), 0, {"float32": torch.zeros(4)}, lay,
                           extra={"__metadata__": torch.zeros(2)})
    assert not (tmp_path / "a").exists()
    # the resolved forms save and read back bit-exactly
    ragckpt.write_global({"c": c.resolve_conj()}, str(tmp_path / "b"), 1)
    assert_bit_equal(ragckpt.open(str(tmp_path / "b")).read("c"), c.resolve_conj())


def test_load_checks_every_target_buffer_before_filling_any(tmp_path):
    src = str(tmp_path / "src")
    ragckpt.write_global({"w": torch.randn(4, 3), "c": torch.randn(2, dtype=torch.complex64)}, src, 2)
    ck = ragckpt.open(src)
    tl = ragckpt.reshard.target_layout(ck.layout, 1)
    n = int(tl.rank_sizes(tl.buffer_index("float32"))[0])
    good = torch.full((n,), 7.0)
    with pytest.raises(TypeError, match="buffer 'complex64' is of type ndarray, not a torch.Tensor"):
        ragckpt.load(ck, tl, 0, into={"float32": good, "complex64": np.zeros(2, np.complex64)})
    with pytest.raises(LayoutError, match="buffer 'complex64' is a lazily conjugated"):
        ragckpt.load(ck, tl, 0, into={"float32": good, "complex64": torch.zeros(2, dtype=torch.complex64).conj()})
    assert torch.equal(good, torch.full((n,), 7.0))  # not filled: the bad buffer came later
    with pytest.raises(TypeError, match="target_layout must be a CheckpointLayout"):
        ragckpt.load(ck, None, 0)
    with pytest.raises(TypeError, match="into must map buffer names to tensors, got a list"):
        ragckpt.load(ck, tl, 0, into=[good])


def test_load_matches_every_tensor_with_the_checkpoint_before_filling_any_buffer(tmp_path):
    """A shape, dtype or name mismatch in a later buffer used to be found after the earlier buffers
    were already overwritten with checkpoint data: the engine's buffers were left half loaded."""
    src = str(tmp_path / "src")
    ragckpt.write_global({"w": torch.randn(4, 3), "i": torch.arange(5)}, src, 2)
    ck = ragckpt.open(src)
    for bad, error in (({"w": ((4, 3), "float32"), "i": ((6,), "int64")}, "tensor 'i': checkpoint shape"),
                       ({"w": ((4, 3), "float32"), "j": ((5,), "int64")}, "tensor 'j' of buffer 'int64' is not in"),
                       ({"w": ((4, 3), "float32"), "i": ((5,), "int32")}, "tensor 'i': checkpoint dtype int64")):
        tl = ragckpt.CheckpointLayout.build(bad, 1, "row")
        into = {b.name: torch.full((int(tl.rank_sizes(i)[0]),), 7, dtype=torch_dtype(b.dtype))
                for i, b in enumerate(tl.buffers)}
        with pytest.raises(ragckpt.RagckptError, match=error):
            ragckpt.load(ck, tl, 0, into=into)
        assert all(bool((t == 7).all()) for t in into.values()), "a buffer was filled before the mismatch was found"


@pytest.mark.parametrize("background", [False, True])
def test_save_arguments_json_or_safetensors_would_change_or_refuse_raise_at_the_call(tmp_path, background):
    """Found by a hunt through the engine API: user metadata whose keys JSON stores as one (it writes
    1 as "1"; a mix of key types also failed inside the writer, from the future of a background save),
    text with a lone surrogate, and extras or extra_meta that are not mappings were raw internal
    errors or silently changed. Each is now refused where the call is made, before anything is
    written; int keys alone (a config's id2label) are stored as JSON writes them."""
    lay = ragckpt.CheckpointLayout.build({"w": ((4,), "float32")}, 1)
    url = str(tmp_path / "ck")
    save = ragckpt.save_shard_async if background else ragckpt.save_shard
    cases = [
        (dict(user={"step": 7, 1: "note", "1": "other"}), ValueError,
         r"user has the keys 1 and '1', which JSON stores as one key '1'"),
        (dict(user={"a": {None: 1, "null": 2}}), ValueError, r"user\['a'\] has the keys None and 'null'"),
        (dict(user={"k": ["ok", "v\udc80"]}), ValueError, r"user\['k'\]\[1\] is 'v\\udc80', not valid Unicode"),
        (dict(extra_meta={"k": "v\udc80"}), TypeError, r"extra_meta\['k'\] = 'v\\udc80': extra_meta must map str"),
        (dict(extra_meta=[("a", "b")]), TypeError, "rank 0: extra_meta must map str to str, got a list"),
        (dict(extra=[torch.ones(2)]), TypeError, "rank 0: extra must map names to tensors, got a list"),
        (dict(buffers=None), TypeError, "rank 0: buffers must map names to tensors, got a NoneType"),
        (dict(extra={"r\udc80": torch.ones(2)}), ragckpt.FormatError, r"extra name 'r\\udc80' cannot be stored"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            save(url, 0, kwargs.pop("buffers", {"float32": torch.arange(4.0)}), lay, **kwargs)
        assert not Path(url).exists(), kwargs
    done = save(url, 0, {"float32": torch.arange(4.0)}, lay, extra_meta={"k": "v"},
                user={"n": {"1": ["x", 2.5]}, "step": 7, "id2label": {0: "a", 1: "b"}, 2: None})
    if background:
        done.result()
    ragckpt.commit(url)
    assert ragckpt.open(url).user == {"n": {"1": ["x", 2.5]}, "step": 7, "id2label": {"0": "a", "1": "b"}, "2": None}


def test_layouts_refuse_names_the_metadata_cannot_record():
    """`with_buffer` (and a layout built by hand) took any names: every rank then saved its data and
    the commit called the metadata corrupt."""
    base = ragckpt.CheckpointLayout.build({"w": ((4,), "float32")}, 2)
    for args, match in ((("m", "float32", "float32", [1]), "tensor name 1 is not a str"),
                        (("m", "float32", "float32", ["w.\udc80"]), r"tensor name 'w.\\udc80' is not valid Unicode"),
                        ((7, "float32", "float32", ["m.w"]), "buffer name 7 is not a str"),
                        (("m", "float32", "float32", "ab"), "tensors must be a sequence of tensor names, not the str")):
        with pytest.raises(LayoutError, match=match):
            base.with_buffer(*args)
    assert base.with_buffer("m", "float32", "float32", ["m.w"]).names() == ["w", "m.w"]


def test_read_rank_names_a_buffer_index_it_does_not_have(tmp_path):
    """A bad index read "missing" objects (IndexError for 5; for -1 and True a healthy checkpoint was
    called incomplete or damaged); a float bound reached torch as a raw TypeError."""
    url = str(tmp_path / "ck")
    ragckpt.write_global({"w": torch.arange(6.0), "i": torch.arange(3)}, url, 2)
    ck = ragckpt.open(url)
    for bad in (5, -1, True, 1.0):
        with pytest.raises(OutOfRangeError, match=rf"buffer {bad!r} is neither the name nor the index \(0..1\)"):
            ck.read_rank(bad, 0)
    with pytest.raises(TypeError, match="stop must be an integer element index, got 2.0"):
        ck.read_rank("float32", 0, 0, 2.0)
    with pytest.raises(TypeError, match="start must be an integer element index, got 0.5"):
        ck.read_flat("w", 0.5)
    assert torch.equal(ck.read_rank(np.int64(1), 0), ck.read_rank("int64", 0)) and ck.verify().ok


def test_a_row_layout_buffer_without_tensors_saves_and_commits(tmp_path):
    """Its units table is (0, W): hashing it without a copy must not trip over the empty shape."""
    from ragckpt.format.layout import row_layout
    from ragckpt.planner.state import BufferSpec

    base = ragckpt.CheckpointLayout.build({"w": ((4, 2), "float32")}, 2, "row")
    lay = ragckpt.CheckpointLayout(2, "row", [*base.layouts, row_layout([], 2)],
                                   [*base.buffers, BufferSpec("none", "float32", 1, ())])
    for r in range(2):
        ragckpt.save_shard(str(tmp_path / "ck"), r, {"float32": torch.arange(4.0) + 4 * r,
                                                     "none": torch.zeros(0)}, lay)
    ragckpt.commit(str(tmp_path / "ck"))
    ck = ragckpt.open(str(tmp_path / "ck"))
    assert ck.verify().ok and torch.equal(ck.read("w"), torch.arange(8.0).reshape(4, 2))


def test_load_allocates_a_buffer_given_as_none(tmp_path):
    src = str(tmp_path / "src")
    ragckpt.write_global({"w": torch.arange(12.0).reshape(4, 3), "i": torch.arange(5)}, src, 2)
    ck = ragckpt.open(src)
    tl = ragckpt.reshard.target_layout(ck.layout, 1)
    out = ragckpt.load(ck, tl, 0, into={"float32": None})
    assert list(out) == ["float32"] and torch.equal(out["float32"][:12], torch.arange(12.0))


def test_an_unsupported_dtype_names_the_tensor_that_has_it(tmp_path):
    """"dtype torch.float8_e4m3fnuz is not supported" alone did not say which buffer, extra or tensor."""
    lay = ragckpt.CheckpointLayout.build({"a": ((4,), "float32")}, 1)
    odd = torch.zeros(2, dtype=torch.float8_e4m3fnuz)
    with pytest.raises(ragckpt.FormatError, match="rank 0: extra 'e': dtype torch.float8_e4m3fnuz is not supported"):
        ragckpt.save_shard(str(tmp_path / "x"), 0, {"float32": torch.zeros(4)}, lay, extra={"e": odd})
    with pytest.raises(ragckpt.FormatError, match="rank 0: buffer 'float32': dtype torch.float8_e4m3fnuz"):
        ragckpt.save_shard(str(tmp_path / "y"), 0, {"float32": torch.zeros(4, dtype=torch.float8_e4m3fnuz)}, lay)
    with pytest.raises(ragckpt.FormatError, match="tensor 'q': dtype torch.float8_e4m3fnuz"):
        ragckpt.write_global({"q": odd}, str(tmp_path / "z"), 2)
    assert not any(tmp_path.iterdir())


def test_a_record_from_a_rank_that_saved_elsewhere_is_named_as_such(tmp_path):
    """A rank given another URL returns a record that storage never held: the commit says so, not
    only that another save must be rewriting the directory."""
    lay = ragckpt.CheckpointLayout.build({"w": ((8,), "float32")}, 2, "row")
    url = str(tmp_path / "ck")
    docs = {0: ragckpt.save_shard(url, 0, {"float32": torch.ones(4)}, lay),
            1: ragckpt.save_shard(str(tmp_path / "typo"), 1, {"float32": torch.ones(4)}, lay)}
    with pytest.raises(ragckpt.FormatError, match=r"the record of rank 1 \(ranks/1\.json\) is not in storage though "
                                                  r"the rank returned it: it saved to another URL"):
        ragckpt.commit(url, rank_manifests=docs)
    assert not (tmp_path / "ck" / "COMMITTED").exists()


def test_a_pathlib_path_is_a_checkpoint_location_everywhere(tmp_path):
    """Every entry point raised "'PosixPath' object is not subscriptable"; save_shard_async queued its
    write on the background thread first. A path now works as its text does; other types are a
    TypeError that names them."""
    state = {"w": torch.arange(12.0).reshape(4, 3)}
    lay = ragckpt.CheckpointLayout.build({"w": ((4, 3), "float32")}, 2, "row")
    ragckpt.write_global(state, tmp_path / "g", world_size=2)
    ck = ragckpt.open(tmp_path / "g")
    assert torch.equal(ck.read("w"), state["w"]) and ck.verify().ok
    ragckpt.reshard.reshard(tmp_path / "g", tmp_path / "r", 3)
    assert ragckpt.compare(tmp_path / "g", tmp_path / "r").ok
    got = ragckpt.load(tmp_path / "r", lay, 1)
    assert torch.equal(got["float32"], state["w"].reshape(-1)[6:])
    ragckpt.save_shard(tmp_path / "s", 0, {"float32": state["w"].reshape(-1)[:6]}, lay)
    ragckpt.save_shard_async(tmp_path / "s", 1, {"float32": state["w"].reshape(-1)[6:]}, lay).result()
    ragckpt.commit(tmp_path / "s")
    assert torch.equal(ragckpt.open(str(tmp_path / "s")).read("w"), state["w"])
    for bad in (b"/tmp/x", 7, None):
        with pytest.raises(TypeError, match=rf"the checkpoint path or URL must be a str or a path, got "
                                            rf"{type(bad).__name__}"):
            ragckpt.save_shard_async(bad, 0, {"float32": torch.zeros(6)}, lay)
        with pytest.raises(TypeError, match="the checkpoint path or URL must be a str or a path"):
            ragckpt.open(bad)


def test_misplaced_arguments_of_the_engine_api_are_type_errors(tmp_path):
    """A dict for the layout, a dict for the staging buffers, the Checkpoint for its layout: bare
    AttributeErrors from deep inside; a budget of 0, '4MiB' or 2**70 was taken or failed late."""
    lay = ragckpt.CheckpointLayout.build({"w": ((4,), "float32")}, 1, "row")
    url = str(tmp_path / "ck")
    for call in (lambda: ragckpt.save_shard(url, 0, {"float32": torch.zeros(4)}, {"w": 1}),
                 lambda: ragckpt.save_shard_async(url, 0, {"float32": torch.zeros(4)}, {"w": 1})):
        with pytest.raises(TypeError, match="rank 0: layout must be a CheckpointLayout"):
            call()
    with pytest.raises(TypeError, match="rank 0: staging must be a ragckpt.StagingBuffers"):
        ragckpt.save_shard_async(url, 0, {"float32": torch.zeros(4)}, lay, staging={})
    assert not (tmp_path / "ck").exists()
    ragckpt.save_shard(url, 0, {"float32": torch.arange(4.0)}, lay)
    ragckpt.commit(url)
    ck = ragckpt.open(url)
    with pytest.raises(TypeError, match=r"src must be a CheckpointLayout \(an open checkpoint's is ck.layout\), got "
                                        "Checkpoint"):
        ragckpt.reshard.target_layout(ck, 2)
    for bad in (0, -5, 7.9, "4MiB", True):
        with pytest.raises(ragckpt.OptionError, match="budget_bytes must be an integer of at least 1"):
            ragckpt.load(ck, lay, 0, budget_bytes=bad)
    with pytest.raises(ragckpt.OptionError, match="budget_bytes must be at most"):
        ragckpt.load(ck, lay, 0, budget_bytes=2**70)
    assert torch.equal(ragckpt.load(ck, lay, 0, budget_bytes=4096)["float32"], torch.arange(4.0))
