"""export-dcp -> import-dcp keeps the checkpoint's shape without flags: the export records its source's
world size and layout in DCP's `planner_data` (where torch's loaders never look), import-dcp takes them
as its defaults, `--world-size` / `--layout` still win, and exports from before the record still import
as they did. A DCP save whose tensors are all empty has its world size recovered from the files it
wrote, or, where nothing says it, is imported for 1 rank with a note instead of an error."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ragckpt
from ragckpt.convert.dcp import RECORD_KEY, export_dcp, import_dcp
from ragckpt.reshard.plan import inferred_granularity
from tests.convert.test_dcp import (
    assert_one_line_error,
    cli_run,
    dcp_load,
    dcp_save,
    write_grid_dcp,
    zeros_like_state,
)
from tests.helpers import assert_bit_equal, odd_state, special_tensor

STATE = odd_state()  # every dtype; 0-d, 0-element, 1-element and rows < W


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A row-layout ragckpt checkpoint for 3 ranks (`rag`) and its DCP export (`dcp`)."""
    d = tmp_path_factory.mktemp("w3")
    ragckpt.write_global(STATE, str(d / "rag"), 3, "row")
    export_dcp(str(d / "rag"), str(d / "dcp"))
    return d


def assert_holds_state(url: Path, world_size: int, kind: str) -> None:
    ck = ragckpt.open(str(url))
    assert (ck.world_size, ck.kind) == (world_size, kind)
    assert sorted(ck.names()) == sorted(STATE)
    for name, t in STATE.items():
        assert_bit_equal(ck.read(name), t, name)


def rewrite_metadata(d: Path, change: Callable[[Any], None]) -> None:
    """Edit a DCP directory's `.metadata` in place (as an older export, or damage, would have it)."""
    md = pickle.loads((d / ".metadata").read_bytes())
    change(md)
    (d / ".metadata").write_bytes(pickle.dumps(md))


def import_json(*args: str) -> dict:
    code, out, err = cli_run("import-dcp", *args, "--json")
    assert code == 0, err
    return json.loads(out)


# -- the record ------------------------------------------------------------------------------------

def test_cli_import_of_an_export_defaults_to_the_source_world_size(exported: Path, tmp_path: Path) -> None:
    """The export's files are all `__0_<n>.distcp` (one writer); the world size comes from the record."""
    assert sorted(p.name for p in (exported / "dcp").glob("*.distcp")) == ["__0_0.distcp"]
    s = import_json(str(exported / "dcp"), str(tmp_path / "back"))
    assert (s["world_size"], s["saved_world_size"], s["world_size_from"], s["notes"]) == (3, 3, "export record", [])
    assert s["layout"] == "row"  # the command line keeps the recorded layout kind too
    ck = ragckpt.open(str(tmp_path / "back"))
    assert (ck.world_size, ck.kind) == (3, "row")
    for name, t in STATE.items():
        assert_bit_equal(ck.read(name), t, name)


def test_python_import_of_an_export_keeps_world_size_and_row_layout(exported: Path, tmp_path: Path) -> None:
    s = import_dcp(str(exported / "dcp"), str(tmp_path / "back"))
    assert (s.world_size, s.layout, s.world_size_from) == (3, "row", "export record")
    assert_holds_state(tmp_path / "back", 3, "row")
    # the ragckpt user metadata says where the tensors came from: a 3-rank checkpoint
    assert ragckpt.open(str(tmp_path / "back")).user["dcp"]["world_size"] == 3


def test_ragged_granularity_round_trips(tmp_path: Path) -> None:
    """Whole-owned (Muon) and element-granular tensors of a ragged checkpoint are planned the same way
    again, optimizer state included; the tensors keep every bit."""
    state = {"w1": special_tensor((8, 6), torch.float32, 1), "w2": special_tensor((9, 4), torch.bfloat16, 2),
             "e": special_tensor((5, 3), torch.float32, 3),
             "optim.state.w1.exp_avg": special_tensor((8, 6), torch.float32, 4)}
    policy = {"w1": "whole", "e": "element", "optim.state.w1.exp_avg": "whole"}
    ragckpt.write_global(state, str(tmp_path / "rag"), 4, "ragged", policy)
    export_dcp(str(tmp_path / "rag"), str(tmp_path / "dcp"))
    s = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "back"))
    back, src = ragckpt.open(str(tmp_path / "back")), ragckpt.open(str(tmp_path / "rag"))
    assert (s.world_size, back.kind) == (4, "ragged")
    got = {n: p for b in back.layout.buffers
           for n, p in inferred_granularity(back.layout.layouts[b.layout], b.tensors).items()}
    assert got == {**policy, "w2": "row"}
    for name, t in state.items():
        assert back.meta(name).placement == src.meta(name).placement, name
        assert_bit_equal(back.read(name), t, name)


def test_world_size_and_layout_options_override_the_record(exported: Path, tmp_path: Path) -> None:
    s = import_json(str(exported / "dcp"), str(tmp_path / "cli"), "--world-size", "2", "--layout", "element")
    assert (s["world_size"], s["layout"], s["world_size_from"], s["saved_world_size"]) == (2, "element", "option", 3)
    assert_holds_state(tmp_path / "cli", 2, "element")
    g = import_json(str(exported / "dcp"), str(tmp_path / "g"), "--granularity", "element")  # means ragged
    assert (g["world_size"], g["layout"]) == (3, "ragged")
    assert_holds_state(tmp_path / "g", 3, "ragged")
    code, _, err = cli_run("import-dcp", str(exported / "dcp"), str(tmp_path / "bad"), "--layout", "row",
                           "--granularity", "element")
    assert code == 2 and "--granularity applies to --layout ragged only" in err and not (tmp_path / "bad").exists()
    py = import_dcp(str(exported / "dcp"), str(tmp_path / "pyg"), granularity="element")  # in Python too
    assert (py.world_size, py.layout) == (3, "ragged")
    assert_holds_state(tmp_path / "pyg", 3, "ragged")
    s5 = import_dcp(str(exported / "dcp"), str(tmp_path / "py"), world_size=5)  # the layout kind still recorded
    assert (s5.world_size, s5.layout) == (5, "row")
    assert_holds_state(tmp_path / "py", 5, "row")


def test_export_without_a_record_imports_as_before(exported: Path, tmp_path: Path) -> None:
    """An export by an older ragckpt has no record: one rank from its file names, ragged layout."""
    old = Path(shutil.copytree(exported / "dcp", tmp_path / "old"))
    rewrite_metadata(old, lambda md: md.planner_data.pop(RECORD_KEY))
    s = import_dcp(str(old), str(tmp_path / "back"))
    assert (s.world_size, s.saved_world_size, s.world_size_from, s.layout) == (1, 1, "file names", "ragged")
    assert_holds_state(tmp_path / "back", 1, "ragged")


@pytest.mark.parametrize("damage", [{"world_size": 0}, {"world_size": "3"}, {"world_size": True},
                                    {"layout": "custom"}, {"format": 99}])
def test_a_damaged_record_field_is_not_trusted(exported: Path, tmp_path: Path, damage: dict) -> None:
    """A field that does not validate falls back to the default (file names, ragged), never an error."""
    d = Path(shutil.copytree(exported / "dcp", tmp_path / "dcp"))
    rewrite_metadata(d, lambda md: md.planner_data[RECORD_KEY].update(damage))
    s = import_dcp(str(d), str(tmp_path / "back"))
    want_w = 1 if "world_size" in damage or "format" in damage else 3
    want_layout = "ragged" if "layout" in damage or "format" in damage else "row"
    assert (s.world_size, s.layout) == (want_w, want_layout)
    assert_holds_state(tmp_path / "back", want_w, want_layout)


@pytest.mark.parametrize("state", [
    {"layer.weight": special_tensor((3, 2), torch.float32, 1), "extra.ema.weight": special_tensor((3, 2), torch.bfloat16, 2)},
    {"extra.rng": special_tensor((4,), torch.uint8, 3)},  # no model tensor at all
], ids=["extra-named-like-a-parameter", "only-extras"])
@pytest.mark.parametrize("prefix", [None, "net."])  # with "" an extra's key is a bare name like a parameter's
def test_an_export_imports_back_under_its_own_names(tmp_path: Path, state: dict, prefix: str | None) -> None:
    """The export records the model prefix it put before each name, and import maps the keys back
    with it. Guessed from the keys, `ema.weight` (from `extra.ema.weight`) looked like a bare model's
    parameter: the prefix became '' and `layer.weight` came back as `model.layer.weight`, `ema.weight`
    as a model weight; an export of extras alone came back without `extra.`."""
    ragckpt.write_global(state, str(tmp_path / "rag"), 2)
    e = export_dcp(str(tmp_path / "rag"), str(tmp_path / "dcp"), model_prefix=prefix)
    md = pickle.loads((tmp_path / "dcp" / ".metadata").read_bytes())
    assert md.planner_data[RECORD_KEY]["model_prefix"] == e.model_prefix == ("model." if prefix is None else prefix)
    s = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "back"))
    assert s.model_prefix == e.model_prefix
    back = ragckpt.open(str(tmp_path / "back"))
    assert sorted(back.names()) == sorted(state)
    for name, t in state.items():
        assert_bit_equal(back.read(name), t, name)
    # an explicit --model-prefix still wins over the record
    s = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "back2"), model_prefix="")
    assert s.model_prefix == "" and "layer.weight" not in ragckpt.open(str(tmp_path / "back2")).names()


@pytest.mark.parametrize("damage", [7, None, "optim.", "extra.x."])
def test_a_damaged_recorded_prefix_falls_back_to_the_guess(exported: Path, tmp_path: Path, damage: Any) -> None:
    """A recorded prefix that is not a string, or would put parameters in a reserved namespace, is not
    trusted: the keys decide, as for an export from before the field."""
    d = Path(shutil.copytree(exported / "dcp", tmp_path / "dcp"))
    rewrite_metadata(d, lambda md: md.planner_data[RECORD_KEY].update(model_prefix=damage))
    s = import_dcp(str(d), str(tmp_path / "back"))
    assert s.model_prefix == "model."
    assert_holds_state(tmp_path / "back", 3, "row")


def test_stock_dcp_load_reads_an_export_with_a_record(exported: Path, tmp_path: Path) -> None:
    """torch's loaders ignore the record: a plain nested state dict loads bit for bit, and the
    load-everything path (`dcp_to_torch_save`) rebuilds exactly the saved keys, no record among them."""
    md = pickle.loads((exported / "dcp" / ".metadata").read_bytes())
    assert md.planner_data[RECORD_KEY]["world_size"] == 3 and RECORD_KEY not in md.state_dict_metadata
    target = {"model": zeros_like_state(STATE)}
    dcp_load(target, exported / "dcp")
    for k, v in STATE.items():
        assert_bit_equal(target["model"][k], v, k)
    dcp_to_torch_save(str(exported / "dcp"), str(tmp_path / "all.pt"))
    everything = torch.load(tmp_path / "all.pt", weights_only=True)
    assert list(everything) == ["model"] and sorted(everything["model"]) == sorted(STATE)
    for k, v in STATE.items():
        assert_bit_equal(everything["model"][k], v, k)


def test_a_tensor_named_like_the_record_goes_without_it(tmp_path: Path) -> None:
    """`extra.<RECORD_KEY>` exports to DCP key RECORD_KEY: the tensor keeps its key and path, the
    record is left out, and import falls back to the file names."""
    named = f"extra.{RECORD_KEY}"
    state = {named: special_tensor((4, 2), torch.float32, 1), "w": special_tensor((6,), torch.int32, 2)}
    ragckpt.write_global(state, str(tmp_path / "rag"), 2, "row")
    export_dcp(str(tmp_path / "rag"), str(tmp_path / "dcp"))
    assert pickle.loads((tmp_path / "dcp" / ".metadata").read_bytes()).planner_data[RECORD_KEY] == (RECORD_KEY,)
    target = {RECORD_KEY: torch.zeros(4, 2), "model": {"w": torch.zeros(6, dtype=torch.int32)}}
    dcp_load(target, tmp_path / "dcp")
    assert_bit_equal(target[RECORD_KEY], state[named], RECORD_KEY)
    assert_bit_equal(target["model"]["w"], state["w"], "w")
    s = import_dcp(str(tmp_path / "dcp"), str(tmp_path / "back"))
    assert (s.world_size, s.world_size_from) == (1, "file names")
    back = ragckpt.open(str(tmp_path / "back"))
    for name, t in state.items():
        assert_bit_equal(back.read(name), t, name)


# -- saves whose tensors are all empty -------------------------------------------------------------

EMPTY = {"a": torch.empty(0, 4), "b": torch.empty(2, 0, 3, dtype=torch.bfloat16),
         "c": torch.empty(0, dtype=torch.int64)}


def test_all_empty_save_recovers_its_world_size_from_its_files(tmp_path: Path) -> None:
    """Empty chunks hold no element, but the save still wrote (and named) their files."""
    dcp_save({"model": EMPTY}, tmp_path / "one")
    s = import_json(str(tmp_path / "one"), str(tmp_path / "back1"))
    assert (s["world_size"], s["world_size_from"], s["notes"]) == (1, "file names", [])
    write_grid_dcp({f"model.{k}": v for k, v in EMPTY.items()}, tmp_path / "three", seed=0)  # __0_0 .. __2_0
    s = import_json(str(tmp_path / "three"), str(tmp_path / "back3"))
    assert (s["world_size"], s["world_size_from"]) == (3, "file names")
    back = ragckpt.open(str(tmp_path / "back3"))
    assert back.world_size == 3
    for name, t in EMPTY.items():
        assert_bit_equal(back.read(name), t, name)


def rename_files(d: Path) -> None:
    """Give a DCP directory's data files names that are not DCP's `__<rank>_<n>.distcp`."""
    def change(md: Any) -> None:
        for idx, info in list(md.storage_data.items()):
            md.storage_data[idx] = dataclasses.replace(info, relative_path=f"data_{info.relative_path}")
    for f in d.glob("*.distcp"):
        f.rename(d / f"data_{f.name}")
    rewrite_metadata(d, change)


def test_all_empty_save_of_unknown_world_size_imports_for_one_rank_with_a_note(tmp_path: Path) -> None:
    dcp_save({"model": EMPTY}, tmp_path / "dcp")
    rename_files(tmp_path / "dcp")
    s = import_json(str(tmp_path / "dcp"), str(tmp_path / "back"))
    assert (s["world_size"], s["saved_world_size"], s["world_size_from"]) == (1, None, "default")
    assert len(s["notes"]) == 1 and "\n" not in s["notes"][0] and "--world-size" in s["notes"][0]
    back = ragckpt.open(str(tmp_path / "back"))
    assert back.world_size == 1 and sorted(back.names()) == sorted(EMPTY)
    assert import_dcp(str(tmp_path / "dcp"), str(tmp_path / "w4"), world_size=4).notes == []
    code, out, err = cli_run("import-dcp", str(tmp_path / "dcp"), str(tmp_path / "human"))
    assert code == 0 and f"note: {s['notes'][0]}" in out.splitlines(), (out, err)


def test_unknown_world_size_with_elements_is_still_an_error(tmp_path: Path) -> None:
    """With elements to place, the world size decides the layout: it is asked for, not guessed."""
    dcp_save({"model": {**EMPTY, "w": special_tensor((3, 2), torch.float32, 1)}}, tmp_path / "dcp")
    rename_files(tmp_path / "dcp")
    assert_one_line_error(["import-dcp", str(tmp_path / "dcp"), str(tmp_path / "back")],
                          "world size cannot be recovered", "pass --world-size")
    assert not (tmp_path / "back").exists()


def test_ranks_without_entries_count_but_leftover_files_do_not(tmp_path: Path) -> None:
    """DCP's de-duplication gives replicated entries to the lower ranks; a rank left with none writes
    an empty `__<rank>_0.distcp` that `.metadata` does not reference (4 processes saving three small
    replicated tensors: files __0..__3, .metadata naming __0..__2). A file with data that .metadata
    does not reference is a leftover of an earlier, larger save into the directory: not counted."""
    state = {"model": {"a": special_tensor((5, 3), torch.float32, 1)}}
    dcp_save(state, tmp_path / "dcp")  # __0_0.distcp
    (tmp_path / "dcp" / "__3_0.distcp").write_bytes(b"")  # what ranks 1-3 with no entries write
    (tmp_path / "dcp" / "__1_0.distcp").write_bytes(b"")
    (tmp_path / "dcp" / "__7_0.distcp").write_bytes(b"old data")
    s = import_json(str(tmp_path / "dcp"), str(tmp_path / "back"))
    assert (s["saved_world_size"], s["world_size"], s["world_size_from"]) == (4, 4, "file names")
    assert_bit_equal(ragckpt.open(str(tmp_path / "back")).read("a"), state["model"]["a"])
