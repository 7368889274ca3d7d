"""export-hf / import-hf against safetensors' own writer and loader: every dtype bit-exact, every
layout, sharding like Hugging Face, selection/renaming/casting, bad input as one-line errors, and
memory that stays bounded while the data does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ragckpt
from ragckpt.convert.hf_export import export_hf
from ragckpt.convert.hf_import import import_hf
from ragckpt.convert.safetensors_io import OutTensor, assign_shards
from ragckpt.errors import DestinationExistsError, FormatError, LayoutError
from ragckpt.sizes import parse_size
from tests.helpers import ALL_DTYPES, assert_bit_equal, bits, cli_error, cli_run, special_tensor

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mixed_state() -> dict[str, torch.Tensor]:
    """Every supported dtype with NaN/inf/-0 planted, plus the awkward shapes: 0-d, empty, 1-D,
    a row count smaller than the world size, and a 3-D tensor."""
    st = {}
    for i, dt in enumerate(ALL_DTYPES):
        name = str(dt).split(".")[-1]
        st[f"model.layers.{i}.w_{name}"] = special_tensor((37, 11), dt, seed=i)
    st["model.scalar"] = special_tensor((), torch.float32, seed=100)
    st["model.empty"] = torch.zeros((0, 4), dtype=torch.bfloat16)
    st["model.bias"] = special_tensor((5,), torch.bfloat16, seed=101)
    st["model.two_rows"] = special_tensor((2, 9), torch.float8_e4m3fn, seed=102)
    st["model.cube"] = special_tensor((3, 4, 5), torch.float16, seed=103)
    return st


def assert_same(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and tuple(got[k].shape) == tuple(v.shape), k
        assert torch.equal(bits(got[k]), bits(v)), k




# -- bit-exactness ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout,world", [("ragged", 3), ("row", 4), ("element", 5), ("ragged", 1)])
def test_every_dtype_bit_exact_both_ways(tmp_path, layout, world):
    state = mixed_state()
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    import_hf(str(tmp_path / "model.safetensors"), str(tmp_path / "ck"), world, layout=layout)
    ck = ragckpt.open(str(tmp_path / "ck"))
    assert ck.world_size == world and ck.kind == layout
    assert_same({n: ck.read(n) for n in ck.names()}, state)
    res = export_hf(str(tmp_path / "ck"), str(tmp_path / "out"))
    assert res.files == ["model.safetensors"] and res.cast == 0
    assert_same(load_file(tmp_path / "out" / "model.safetensors"), state)


def test_sharded_input_with_index_and_streaming_block_sizes(tmp_path):
    """A sharded source (index + 3 files) and tensors bigger than the export block: with a 4 MiB
    budget every tensor is cut into 1 MiB reads and reassembled at the right offsets."""
    big = {f"model.layers.{i}.weight": special_tensor((700, 1000), torch.bfloat16, seed=i) for i in range(3)}
    small = {"model.norm.weight": special_tensor((1000,), torch.float32, seed=9)}
    src = tmp_path / "src"
    src.mkdir()
    files = {"model-00001-of-00003.safetensors": {k: big[k] for k in list(big)[:2]},
             "model-00002-of-00003.safetensors": {k: big[k] for k in list(big)[2:]},
             "model-00003-of-00003.safetensors": small}
    for f, part in files.items():
        save_file(part, src / f, metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, part in files.items() for k in part}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "stray.safetensors").write_bytes(b"not read: the index decides")
    res = import_hf(str(src), str(tmp_path / "ck"), 4, memory_bytes=4 << 20)
    assert len(res.files) == 3
    out = export_hf(str(tmp_path / "ck"), str(tmp_path / "out"), memory_bytes=4 << 20, max_shard_size="2MB")
    assert len(out.files) == 3  # 1.4 MB tensors: one per 2 MB shard, the norm joins the last
    got = {}
    for f in out.files:
        got.update(load_file(tmp_path / "out" / f))
    assert_same(got, {**big, **small})


# -- export options -----------------------------------------------------------------------------------------

def test_shard_assignment_like_hugging_face():
    ts = [OutTensor(f"t{i}", "uint8", (n,)) for i, n in enumerate([40, 40, 30, 150, 10, 90])]
    shards = assign_shards(ts, 100)
    assert [[t.name for t in s] for s in shards] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("500MB") == 5 * 10**8
    assert parse_size("1234") == 1234 and parse_size(" 1.5 kb ") == 1500
    with pytest.raises(ValueError, match="'5 gigs' is not a size"):
        parse_size("5 gigs")


def test_export_into_a_shared_group_directory_keeps_its_setgid_and_group_write(tmp_path):
    """Making the directories it creates readable must add permissions, not replace the mode: a
    team directory's setgid bit (files inherit its group) and group write were stripped."""
    import stat

    team = tmp_path / "team"
    team.mkdir()
    os.chmod(team, 0o2775)
    ragckpt.write_global({"model.w": torch.arange(6.0)}, str(tmp_path / "ck"), 2)
    old = os.umask(0o002)
    try:
        export_hf(str(tmp_path / "ck"), str(team / "run1" / "hf"))
    finally:
        os.umask(old)
    for d in (team / "run1", team / "run1" / "hf"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o2775, (d, oct(os.stat(d).st_mode))


def test_sharded_export_layout_index_and_modes(tmp_path):
    state = {f"model.layers.{i}.w": special_tensor((64, 64), torch.float32, seed=i) for i in range(12)}
    ragckpt.write_global(state, str(tmp_path / "ck"), 3)
    old = os.umask(0o077)  # a restrictive umask must not make the model unreadable for other users
    try:
        res = export_hf(str(tmp_path / "ck"), str(tmp_path / "out"), max_shard_size=40000)
        export_hf(str(tmp_path / "ck"), str(tmp_path / "new" / "nested"))
    finally:
        os.umask(old)
    out = tmp_path / "out"
    for d in (out, tmp_path / "new", tmp_path / "new" / "nested"):  # the directories it created, too
        assert os.stat(d).st_mode & 0o777 == 0o755, d
    assert res.files == [f"model-{i:05d}-of-00006.safetensors" for i in range(1, 7)]
    assert sorted(os.listdir(out)) == sorted([*res.files, "model.safetensors.index.json"])  # no temp files left
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 12 * 64 * 64 * 4
    got = {}
    for f in res.files:
        assert os.stat(out / f).st_mode & 0o777 == 0o644
        assert os.path.getsize(out / f) <= 40000 + 1024  # data within the limit, plus the header
        with safe_open(out / f, "pt") as h:
            assert h.metadata() == {"format": "pt"}
            for k in h.keys():
                assert index["weight_map"][k] == f
                got[k] = h.get_tensor(k)
    assert_same(got, state)
    # shards follow the layer order (natural sort: layers.2 before layers.10)
    assert index["weight_map"]["model.layers.0.w"] == res.files[0]
    assert index["weight_map"]["model.layers.11.w"] == res.files[-1]


def test_optimizer_state_excluded_by_default(tmp_path):
    w = special_tensor((8, 4), torch.float32, seed=1)
    state = {"model.w": w, "optim.state.model.w.exp_avg": torch.ones(8, 4), "optim.state.model.w.step": torch.tensor(3.0),
             "extra.rng": torch.arange(5)}
    ragckpt.write_global(state, str(tmp_path / "ck"), 2)
    res = export_hf(str(tmp_path / "ck"), str(tmp_path / "a"))
    assert res.excluded == 3
    assert_same(load_file(tmp_path / "a" / "model.safetensors"), {"model.w": w})
    res = export_hf(str(tmp_path / "ck"), str(tmp_path / "b"), all_tensors=True)
    assert_same(load_file(tmp_path / "b" / "model.safetensors"), state)


def test_include_rename_and_cast(tmp_path):
    state = {"model.embed.weight": special_tensor((16, 8), torch.float32, seed=1),
             "model.layers.0.q.weight": special_tensor((8, 8), torch.float16, seed=2),
             "model.layers.0.q.scale": special_tensor((8,), torch.float8_e4m3fn, seed=3),
             "model.layers.0.ids": torch.arange(8, dtype=torch.int64),
             "lm_head.weight": special_tensor((16, 8), torch.bfloat16, seed=4)}
    ragckpt.write_global(state, str(tmp_path / "ck"), 2)
    rmap = tmp_path / "rename.json"
    rmap.write_text(json.dumps({"model.layers.0.q.weight": "model.layers.0.self_attn.q_proj.weight"}))
    code, out, err = cli_run("export-hf", str(tmp_path / "ck"), str(tmp_path / "out"), "--include", "model.layers.*",
                             "--include", "model.embed.*", "--rename-map", str(rmap), "--dtype", "bf16", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["renamed"] == 1 and summary["excluded"] == 1 and summary["cast"] == 2
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == {"model.embed.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.q.scale",
                        "model.layers.0.ids"}
    # float tensors cast exactly as torch casts them; fp8 (scale semantics) and ints untouched
    assert torch.equal(bits(got["model.embed.weight"]), bits(state["model.embed.weight"].to(torch.bfloat16)))
    assert torch.equal(bits(got["model.layers.0.self_attn.q_proj.weight"]),
                       bits(state["model.layers.0.q.weight"].to(torch.bfloat16)))
    assert torch.equal(bits(got["model.layers.0.q.scale"]), bits(state["model.layers.0.q.scale"]))
    assert torch.equal(got["model.layers.0.ids"], state["model.layers.0.ids"])


def test_overwrite_policy_and_stale_shards(tmp_path):
    state = {f"model.w{i}": special_tensor((32, 32), torch.float32, seed=i) for i in range(4)}
    ragckpt.write_global(state, str(tmp_path / "ck"), 2)
    out = tmp_path / "out"
    export_hf(str(tmp_path / "ck"), str(out), max_shard_size=5000)  # 4 shards + index
    (out / "tokenizer.json").write_text("{}")
    with pytest.raises(DestinationExistsError, match="already holds model weights"):
        export_hf(str(tmp_path / "ck"), str(out))
    res = export_hf(str(tmp_path / "ck"), str(out), overwrite=True)  # now a single file
    assert res.files == ["model.safetensors"]
    assert sorted(os.listdir(out)) == ["model.safetensors", "tokenizer.json"]  # stale shards and index gone
    assert_same(load_file(out / "model.safetensors"), state)


@pytest.mark.parametrize("where", ["model.safetensors", "model.safetensors.index.json", "config.json"])
def test_a_directory_where_a_file_goes_is_named_before_anything_is_written(tmp_path, where):
    """It used to fail at the final rename, naming the temporary file (`.model.safetensors.<hex>.tmp:
    Is a directory`), which the user never made."""
    ragckpt.write_global({"model.w": torch.ones(3)}, str(tmp_path / "ck"), 1)
    out = tmp_path / "out"
    (out / where).mkdir(parents=True)
    (out / where / "keep").write_text("x")
    line = cli_error("export-hf", str(tmp_path / "ck"), str(out), "--overwrite", "--config",
                     str(_write_json(tmp_path / "cfg.json", {"model_type": "toy"})))
    assert line == f"error: {out / where} is a directory, where export-hf writes a file; move it away or choose " \
                   "another OUT_DIR"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [where, f"{where}/keep"]
    if where == "config.json":  # an export that writes no config.json does not care
        export_hf(str(tmp_path / "ck"), str(out), overwrite=True, write_config=False)
        assert load_file(out / "model.safetensors")["model.w"].equal(torch.ones(3))


def _write_json(path, doc):
    path.write_text(json.dumps(doc))
    return path


# -- bad input: one clear line, never a traceback ----------------------------------------------------------

def test_bad_inputs_fail_with_one_line(tmp_path):
    good = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    dst = str(tmp_path / "dst")

    (tmp_path / "notst").mkdir()
    (tmp_path / "notst" / "model.safetensors").write_bytes(b"PK\x03\x04" + b"\x00" * 60)  # a zip, say
    assert "not a safetensors file" in cli_error("import-hf", str(tmp_path / "notst"), dst, "-w", "2")

    save_file(good, tmp_path / "full.safetensors")
    raw = (tmp_path / "full.safetensors").read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    (tmp_path / "trunc_header.safetensors").write_bytes(raw[: 8 + hlen // 2])
    line = cli_error("import-hf", str(tmp_path / "trunc_header.safetensors"), dst, "-w", "2")
    assert "truncated header" in line and "trunc_header.safetensors" in line

    (tmp_path / "trunc_data.safetensors").write_bytes(raw[:-10])
    line = cli_error("import-hf", str(tmp_path / "trunc_data.safetensors"), dst, "-w", "2")
    assert "past the end of the file" in line and ("'b'" in line or "'a'" in line)

    idx = tmp_path / "idx"
    idx.mkdir()
    save_file(good, idx / "model-00001-of-00001.safetensors")
    (idx / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors",
                        "c": "model-00001-of-00001.safetensors"}}))
    line = cli_error("import-hf", str(idx), dst, "-w", "2")
    assert "'c'" in line and "does not contain it" in line

    (idx / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00009-of-00009.safetensors"}}))
    assert "model-00009-of-00009.safetensors" in cli_error("import-hf", str(idx), dst, "-w", "2")

    save_file({"u": torch.zeros(4, dtype=torch.float8_e4m3fnuz)}, tmp_path / "fnuz.safetensors")
    assert "F8_E4M3FNUZ" in cli_error("import-hf", str(tmp_path / "fnuz.safetensors"), dst, "-w", "2")

    (tmp_path / "empty").mkdir()
    assert "no safetensors files" in cli_error("import-hf", str(tmp_path / "empty"), dst, "-w", "2")
    assert not os.path.exists(dst)  # nothing was written for any of these

    ragckpt.write_global({"x.w": torch.ones(4), "y.w": torch.zeros(4)}, str(tmp_path / "ck"), 2)
    rmap = tmp_path / "clash.json"
    rmap.write_text(json.dumps({"x.w": "w", "y.w": "w"}))
    line = cli_error("export-hf", str(tmp_path / "ck"), str(tmp_path / "o"), "--rename-map", str(rmap))
    assert "name clash" in line and "'w'" in line
    rmap.write_text(json.dumps({"nope": "w"}))
    assert "'nope'" in cli_error("export-hf", str(tmp_path / "ck"), str(tmp_path / "o"), "--rename-map", str(rmap))
    rmap.write_text("{not json")
    assert "not valid JSON" in cli_error("export-hf", str(tmp_path / "ck"), str(tmp_path / "o"), "--rename-map", str(rmap))
    assert "matched nothing" in cli_error("export-hf", str(tmp_path / "ck"), str(tmp_path / "o"), "--include", "z*")
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.parametrize("config", [b"{nope", b"\xff\xfe\x00\x01", b"[1, 2]", b"null"])
def test_garbled_config_json_is_refused(tmp_path, config):
    """A config.json that is not a JSON object used to be dropped silently, so the export of the
    checkpoint later had no config to write back."""
    model = tmp_path / "m"
    model.mkdir()
    save_file({"a": torch.ones(4)}, model / "model.safetensors")
    (model / "config.json").write_bytes(config)
    line = cli_error("import-hf", str(model), str(tmp_path / "dst"), "-w", "2")
    assert line == f"error: {model / 'config.json'} is not a JSON object; fix or remove it"
    assert not (tmp_path / "dst").exists()


def test_workers_and_world_size_are_validated(tmp_path):
    """--workers 0 ran (or failed with `ValueError: max_workers must be greater than 0`); a huge
    --world-size ended in numpy's _ArrayMemoryError traceback."""
    save_file({"a": torch.ones(4)}, tmp_path / "model.safetensors")
    ragckpt.write_global({"a": torch.ones(4)}, str(tmp_path / "ck"), 2)
    for n in ("0", "-3"):
        for args in (["import-hf", str(tmp_path / "model.safetensors"), str(tmp_path / "o"), "-w", "2"],
                     ["export-hf", str(tmp_path / "ck"), str(tmp_path / "o")]):
            code, _, err = cli_run(*args, "--workers", n)
            assert code == 2 and "Invalid value for '--workers'" in err and "Traceback" not in err, err
    code, _, err = cli_run("import-hf", str(tmp_path / "model.safetensors"), str(tmp_path / "o"), "-w", "1000000000")
    assert code == 2 and "Invalid value for '--world-size'" in err and "1048576" in err, err
    assert not (tmp_path / "o").exists()
    code, out, _ = cli_run("import-hf", "--help")
    assert code == 0 and "1,048,576" in out


def test_parse_errors_name_file_and_tensor(tmp_path):
    """Header validation beyond the CLI: overlapping tensors, offsets that contradict the shape."""
    def write(path, header: dict, data: bytes) -> None:
        js = json.dumps(header).encode()
        path.write_bytes(len(js).to_bytes(8, "little") + js + data)

    write(tmp_path / "overlap.safetensors", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                             "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))
    with pytest.raises(FormatError, match="overlap"):
        import_hf(str(tmp_path / "overlap.safetensors"), str(tmp_path / "d"), 2)
    write(tmp_path / "shape.safetensors", {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(FormatError, match=r"shape.safetensors: tensor 'a' data_offsets"):
        import_hf(str(tmp_path / "shape.safetensors"), str(tmp_path / "d"), 2)
    (tmp_path / "huge.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(FormatError, match="header length"):
        import_hf(str(tmp_path / "huge.safetensors"), str(tmp_path / "d"), 2)


F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("case, header, data, match", [
    ("list_dtype", '{"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}', 8, "'a' has a malformed header"),
    ("string_shape", '{"a": {"dtype": "U8", "shape": "12", "data_offsets": [0, 2]}}', 2, "'a' has a malformed header"),
    ("float_offsets", '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.5, 8.9]}}', 8,
     "'a' has a malformed header"),
    ("float_shape", '{"a": {"dtype": "F32", "shape": [2.7], "data_offsets": [0, 8]}}', 8, "'a' has a malformed header"),
    ("bool_shape", '{"a": {"dtype": "F32", "shape": [true, 2], "data_offsets": [0, 8]}}', 8, "malformed header"),
    ("three_offsets", '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}}', 8, "malformed header"),
    ("entry_not_object", '{"a": 3}', 0, "'a' has a malformed header"),
    ("duplicate_name", '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                       '"a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}', 12, "lists 'a' twice"),
    ("metadata_not_strings", '{"__metadata__": {"format": 3}, "a": ' + json.dumps(F32_2) + '}', 8,
     "__metadata__ must be a JSON object of strings"),
    ("hole", '{"a": ' + json.dumps(F32_2) + ', "b": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]}}', 32,
     "16 bytes before tensor 'b' belong to no tensor"),
    ("hole_at_start", '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}', 12,
     "4 bytes before tensor 'a' belong to no tensor"),
    ("trailing_bytes", '{"a": ' + json.dumps(F32_2) + '}', 16, "8 bytes after the last tensor belong to no tensor"),
    ("lone_surrogate_name", '{"a\\ud800": ' + json.dumps(F32_2) + '}', 8, "is not valid UTF-8"),
])
def test_headers_that_safetensors_refuses_are_refused_before_anything_is_written(tmp_path, case, header, data,
                                                                                 match):
    """Each of these is a corrupt or lying header: safetensors' own loader refuses every one. They
    used to be imported (a float offset truncated, a string shape split into digits, the second of
    two entries of one name silently winning, a hole or trailing bytes ignored) or, for a list
    dtype, to end in an internal error."""
    from safetensors import SafetensorError

    js = header.encode()
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(len(js).to_bytes(8, "little") + js + bytes(range(data)))
    with pytest.raises(SafetensorError):
        load_file(str(path))
    dst = tmp_path / "d"
    with pytest.raises(FormatError, match=match):
        import_hf(str(path), str(dst), 2)
    assert not dst.exists()
    line = cli_error("import-hf", str(path), str(dst), "--world-size", "2")
    assert f"{case}.safetensors" in line and not dst.exists()


def test_inputs_python_parses_but_a_checkpoint_cannot_hold_are_named_before_anything_is_written(tmp_path):
    """Found by a hunt through the CLI with bad input: a zero-element tensor with a dimension of 2**63
    passed the header check, and the import failed at commit blaming DST's own metadata (which it
    left behind); an index whose weight_map maps a tensor to a list was an internal error; NaN or
    Infinity in config.json (Python's parser takes them) was refused as "user metadata" nobody gave."""
    dst = tmp_path / "dst"
    js = json.dumps({"a": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}).encode()
    (tmp_path / "huge.safetensors").write_bytes(len(js).to_bytes(8, "little") + js)
    line = cli_error("import-hf", str(tmp_path / "huge.safetensors"), str(dst), "-w", "2")
    assert "huge.safetensors: tensor 'a' has a dimension of 2**62 or more" in line and not dst.exists()
    with pytest.raises(LayoutError, match="'a' of shape .* has a dimension beyond"):  # and writers refuse it too
        ragckpt.CheckpointLayout.build({"a": ((0, 2**63), "float32")}, 2, "row")

    model = tmp_path / "model"
    model.mkdir()
    save_file({"a": torch.ones(2)}, model / "m1.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": ["m1.safetensors"]}}))
    line = cli_error("import-hf", str(model), str(dst), "-w", "2")
    assert "weight_map maps tensor 'a' to [\"m1.safetensors\"], which is not a file name" in line
    (model / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "not a valid index" in cli_error("import-hf", str(model), str(dst), "-w", "2")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "m1.safetensors"}}))
    (model / "config.json").write_text('{"rope_scaling": {"factor": Infinity}, "x": 1}')
    line = cli_error("import-hf", str(model), str(dst), "-w", "2")
    assert line == f"error: {model / 'config.json'} holds Infinity, which JSON does not allow and the checkpoint " \
                   "cannot record; fix or remove it"
    (model / "config.json").write_text('{"label": "a\\ud800b"}')
    line = cli_error("import-hf", str(model), str(dst), "-w", "2")
    assert line == f"error: {model / 'config.json'} cannot be recorded in the checkpoint (config.json['label'] is " \
                   "'a\\ud800b', not valid Unicode text); fix or remove it"
    assert not dst.exists()
    (model / "config.json").write_text('{"x": 1}')
    import_hf(str(model), str(dst), 2)  # the same model with a plain config imports
    assert ragckpt.open(str(dst)).user["hf"]["config"] == {"x": 1}


def test_tensor_names_safetensors_cannot_hold_are_named_as_the_checkpoints_own(tmp_path):
    """An empty name or '__metadata__' (writers accept both) used to be blamed on a rename map nobody
    gave; a rename map nested too deeply was an internal error; a lone surrogate is refused by writers."""
    for name in ("", "__metadata__"):
        ck = str(tmp_path / f"ck{len(name)}")
        ragckpt.write_global({name: torch.arange(3.0), "w": torch.zeros(2)}, ck, 2)
        line = cli_error("export-hf", ck, str(tmp_path / "o"))
        assert f"tensor '{name}' cannot keep its name in safetensors" in line and "--rename-map" in line, line
        rmap = tmp_path / "rename.json"
        rmap.write_text(json.dumps({"w": name}))
        assert f"rename map gives 'w' the invalid name '{name}'" in cli_error(
            "export-hf", ck, str(tmp_path / "o"), "--include", "w", "--rename-map", str(rmap))
        rmap.write_text(json.dumps({name: "renamed"}))
        export_hf(ck, str(tmp_path / f"o{len(name)}"), rename_map=str(rmap), write_config=False)
        assert load_file(str(tmp_path / f"o{len(name)}" / "model.safetensors"))["renamed"].equal(torch.arange(3.0))
    rmap.write_text("[" * 100_000 + "]" * 100_000)
    line = cli_error("export-hf", ck, str(tmp_path / "o"), "--rename-map", str(rmap))
    assert line == f"error: rename map {rmap}: not valid JSON (nested too deeply)"
    assert not (tmp_path / "o").exists()
    with pytest.raises(LayoutError, match="lone surrogate"):
        ragckpt.write_global({"a\ud800": torch.ones(2)}, str(tmp_path / "sur"), 1)
    assert not (tmp_path / "sur").exists()


# -- bounded memory -----------------------------------------------------------------------------------------

MEMORY_PROBE = textwrap.dedent("""
    import json, sys
    import torch  # imports are not data: the converters load torch on first use (ragckpt.lazy)
    from ragckpt.convert.hf_export import export_hf
    from ragckpt.convert.hf_import import import_hf
    def status(key):  # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forking parent
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))
    def rss():
        return status("VmRSS")
    op, src, dst = sys.argv[1:4]
    base = rss()
    if op == "import":
        import_hf(src, dst, 8, memory_bytes=32 << 20, workers=4)
    elif op == "cast":
        export_hf(src, dst, memory_bytes=32 << 20, workers=4, dtype="fp32")
    else:
        export_hf(src, dst, memory_bytes=32 << 20, workers=4)
    peak = status("VmHWM")
    print(json.dumps({"above": peak - base}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for RSS")
def test_memory_stays_bounded_while_data_does_not(tmp_path):
    """192 MiB of weights go through import and export with a 32 MiB budget: each process's peak
    RSS grows by well under the model size (a load-everything converter would need all of it)."""
    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.w": torch.randint(-2**15, 2**15, (2048, 4096), dtype=torch.int16, generator=g)
             .view(torch.bfloat16) for i in range(12)}
    save_file(state, tmp_path / "model.safetensors")
    size = sum(t.numel() * t.element_size() for t in state.values())
    del state

    def probe(*args: str) -> int:
        p = subprocess.run([sys.executable, "-c", MEMORY_PROBE, *args], capture_output=True, text=True, cwd=REPO,
                           timeout=300)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout.strip().splitlines()[-1])["above"]

    up = probe("import", str(tmp_path / "model.safetensors"), str(tmp_path / "ck"))
    down = probe("export", str(tmp_path / "ck"), str(tmp_path / "out"))
    # a cast export writes twice the bytes: each thread casts into one reused buffer (a fresh tensor
    # per part stayed in the threads' malloc arenas: 128 MiB here for this 32 MiB budget)
    cast = probe("cast", str(tmp_path / "ck"), str(tmp_path / "out32"))
    assert up < 28 << 20, up  # 16 MiB measured; a fresh chunk per rank (8 ranks, 4 workers) made it 32
    assert down < 48 << 20 and down < size / 3, down
    assert cast < 48 << 20, cast
    a, b = tmp_path / "model.safetensors", tmp_path / "out" / "model.safetensors"
    c = tmp_path / "out32" / "model.safetensors"
    with safe_open(a, "pt") as ha, safe_open(b, "pt") as hb, safe_open(c, "pt") as hc:
        assert set(ha.keys()) == set(hb.keys()) == set(hc.keys())
        for k in ha.keys():
            want = ha.get_tensor(k)
            assert torch.equal(bits(want), bits(hb.get_tensor(k))), k
            # the bounded cast still casts every element: the original bf16 tensor in float32
            assert_bit_equal(hc.get_tensor(k), want.to(torch.float32), k)


@pytest.mark.parametrize("block_bytes,world", [(777, 1), (1002, 2), (1020, 1)])
def test_export_with_checksum_blocks_that_are_not_whole_elements(tmp_path, block_bytes, world):
    """Checksum blocks may be any size (777 bytes). Reads are cut at whole blocks; a cut that also
    fell inside an element shifted every later piece of the tensor by a few bytes, silently."""
    state = {"f32": torch.arange(300_000, dtype=torch.float32).reshape(600, 500),
             "i64": torch.arange(70_001, dtype=torch.int64) * 7919,
             "bf16": special_tensor((1111, 77), torch.bfloat16, 4)}
    ck = str(tmp_path / "ck")
    ragckpt.write_global(state, ck, world, block_bytes=block_bytes)  # rank buffers span several 1 MiB reads
    out = tmp_path / "hf"
    export_hf(ck, str(out), memory_bytes=16 << 20)
    got = load_file(str(out / "model.safetensors"))
    for k, v in state.items():
        assert torch.equal(bits(got[k]), bits(v)), k
    cast = tmp_path / "hf16"
    export_hf(ck, str(cast), memory_bytes=16 << 20, dtype="bf16")
    assert torch.equal(load_file(str(cast / "model.safetensors"))["f32"], state["f32"].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_dtype_casts_model_weights_only_never_optimizer_state(tmp_path, dtype):
    """`--all-tensors --dtype bf16|fp16` casts the weights; Adam's float32 `step` (1001 became 1000.0
    in bf16, 70001 inf in fp16) and moments keep their dtype and bits, and the JSON counts only the
    weights as cast."""
    target = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    state = {"model.w": torch.randn(6, 4), "model.b": torch.randn(4, dtype=torch.float64),
             "optim.state.model.w.step": torch.tensor(70001.0),
             "optim.state.model.w.exp_avg_sq": torch.tensor([[7e4, 1e-9, 3.0, 0.5]] * 6),
             "optim.state.model.w.exp_avg": torch.randn(6, 4)}
    ck = str(tmp_path / "ck")
    ragckpt.write_global(state, ck, 2)
    code, out, err = cli_run("export-hf", ck, str(tmp_path / "hf"), "--all-tensors", "--dtype", dtype, "--json")
    assert code == 0, err
    assert json.loads(out)["cast"] == 2
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for name, t in state.items():
        want = t.to(target) if name.startswith("model.") else t
        assert got[name].dtype == want.dtype and torch.equal(bits(got[name]), bits(want)), name


def test_shards_without_their_index_are_an_interrupted_export_not_a_model(tmp_path):
    """export-hf writes the index last, so a killed export leaves shards without it: import-hf took
    every *.safetensors it found and imported half a model (or, after --overwrite, halves of two)
    with exit 0. One shard given as a file still imports that file."""
    state = {f"model.layers.{i}.w": special_tensor((64, 64), torch.float32, seed=i) for i in range(4)}
    ragckpt.write_global(state, str(tmp_path / "ck"), 2)
    res = export_hf(str(tmp_path / "ck"), str(tmp_path / "out"), max_shard_size=40000)
    assert len(res.files) > 1
    os.unlink(tmp_path / "out" / "model.safetensors.index.json")
    os.unlink(tmp_path / "out" / res.files[-1])  # killed during the renames
    line = cli_error("import-hf", str(tmp_path / "out"), str(tmp_path / "back"), "-w", "2")
    assert f"holds sharded files ({res.files[0]}, ...) but no model.safetensors.index.json: an interrupted " \
           "export" in line, line
    assert not (tmp_path / "back").exists()
    import_hf(str(tmp_path / "out" / res.files[0]), str(tmp_path / "one"), 1)
    assert sorted(ragckpt.open(str(tmp_path / "one")).names()) == sorted(load_file(tmp_path / "out" / res.files[0]))
