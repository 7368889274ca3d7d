"""`save_state_dict` / `load_state_dict`: FSDP2 (CPU/gloo) saves from 3 ranks straight into ragckpt and
restores into fresh FSDP2 models at 2 ranks, directly, after an offline reshard, and through
`export-dcp` + stock `dcp.load`. References are FSDP2's own `full_tensor()` of every parameter and
Adam state, compared byte for byte. Refusals and load mismatches run in this process on a 1-rank
gloo group."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ragckpt
from ragckpt.checkpoint.reader import Checkpoint
from ragckpt.convert.dcp import export_dcp
from ragckpt.integrations.fsdp2 import async_save_state_dict, load_state_dict, save_state_dict
from tests.helpers import assert_bit_equal, free_port, special_tensor
from tests.storage.test_s3_overwrite import names_beside

WORKER = Path(__file__).resolve().parents[1] / "state_dict_fsdp2_worker.py"


def run_worker(mode: str, work: Path, nprocs: int, *sources: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, str(WORKER), mode, str(work), str(free_port()), str(nprocs), *sources],
                       capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, f"{mode} worker failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    work = tmp_path_factory.mktemp("sd_fsdp2")
    run_worker("save", work, 3)
    return work, torch.load(work / "ref.pt", weights_only=False), torch.load(work / "errors.pt", weights_only=False)


def expected_tensors(ref: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by the documented names (those import-dcp gives a DCP save)."""
    return {**ref["model"], **{f"optim.{k}": v for k, v in ref["optim"].items()}}


@pytest.fixture(scope="module")
def loaded(saved: tuple[Path, dict, dict]) -> dict[str, dict]:
    work, _, _ = saved
    ckpt = str(work / "ckpt")
    ragckpt.reshard.reshard(ckpt, str(work / "row2"), 2)
    ragckpt.reshard.reshard(ckpt, str(work / "ragged2"), 2, layout="ragged")
    export_dcp(ckpt, str(work / "dcp"))
    run_worker("load", work, 2, f"direct=ragckpt:{ckpt}", f"async=ragckpt:{work / 'async'}", f"row2=ragckpt:{work / 'row2'}",
               f"ragged2=ragckpt:{work / 'ragged2'}", f"dcp=dcp:{work / 'dcp'}")
    return torch.load(work / "got.pt", weights_only=False)


def test_save_from_3_ranks_holds_every_full_tensor(saved: tuple[Path, dict, dict]) -> None:
    work, ref, _ = saved
    assert ref["local_rows"]["inp.weight"] == 8 and ref["local_rows"]["out.weight"] == 2  # 22, 5 rows on 3 ranks
    ck = ragckpt.open(str(work / "ckpt"))
    assert ck.world_size == 3 and ck.kind == "row"
    want = expected_tensors(ref)
    assert any(v.dtype == torch.bfloat16 for v in want.values()) and "optim.state.out.weight.step" in want
    assert sorted(ck.names()) == sorted(want)
    for name, t in want.items():
        assert_bit_equal(ck.read(name), t, name)
    assert ck.verify().ok
    groups = ck.user["optim.param_groups"]
    assert groups["inp.weight"]["lr"] == 1e-2 and groups["out.weight"]["betas"] == [0.8, 0.95]
    assert ck.user["dcp"]["model_prefix"] == "model." and "optim.param_groups.mid.bias.eps" in ck.user["dcp"]["bytes"]


@pytest.mark.parametrize("source", ["direct", "async", "row2", "ragged2", "dcp"])
def test_load_at_2_ranks_restores_model_and_optimizer(saved: tuple[Path, dict, dict], loaded: dict[str, dict],
                                                      source: str) -> None:
    """Straight from the 3-rank save (and from its background twin, saved while a training step changed
    the state), from offline reshards to 2 (row and ragged), and from an
    export-dcp through stock dcp.load: the fresh model (seed 123, lr 5e-4) ends up with the saved state."""
    _, ref, _ = saved
    got = loaded[source]
    assert got["local_rows"]["inp.weight"] == 11 and got["local_rows"]["mid.weight"] == 4  # 22, 7 rows on 2
    for section in ("model", "optim", "params"):
        assert sorted(got[section]) == sorted(ref[section])
        for k, v in ref[section].items():
            assert_bit_equal(got[section][k], v, f"{source}: {section}.{k}")
    assert got["hparams"] == ref["hparams"]  # lr 1e-2 restored over the fresh optimizer's 5e-4
    assert all(isinstance(g["betas"], tuple) for g in got["hparams"])


def test_load_refuses_ranks_asking_for_different_entries(loaded: dict[str, dict]) -> None:
    """Rank 0 loads model and optimizer, rank 1 the model alone: every rank raises the same line and
    no rank reads anything (a job would otherwise train on with one rank's optimizer state fresh)."""
    seen = loaded["mixed"]
    assert len(seen) == 2 and seen[0][:2] == seen[1][:2], seen
    kind, text, _ = seen[0]
    assert kind == "LayoutError" and "\n" not in text, seen
    assert "rank 1's state dict lacks entry 'optim." in text and "nothing was read" in text, text
    assert all(untouched for _, _, untouched in seen), seen


def test_background_saves_stay_in_step_across_ranks(saved: tuple[Path, dict, dict]) -> None:
    """A staging copy that fails on one rank fails that save on every rank (the writers do not drift
    apart and commit a checkpoint missing a rank); a group in another rank order keeps each rank's
    record with its rank; the background group has the job's timeout, not gloo's 30 minutes."""
    work, ref, errs = saved
    for case in ("staging_async", "staging_sync"):
        seen = errs[case]
        assert all(s == seen[0] for s in seen), f"{case}: ranks disagree: {seen}"
        assert seen[0][0] == "RagckptError" and "rank 1 failed to write its shard: MemoryError: injected" in seen[0][1]
        assert seen[0][1].endswith("the destination was left uncommitted; save again once the cause is fixed"), seen
        with pytest.raises(ragckpt.NotCommittedError):
            ragckpt.open(str(work / f"err_{case}"))
    assert errs["after_staging"] == [(None, "")] * 3
    after, same = ragckpt.open(str(work / "after_staging")), ragckpt.open(str(work / "divergent"))  # one state
    assert after.verify().ok and sorted(after.names()) == sorted(expected_tensors(ref))
    for name in after.names():
        assert_bit_equal(after.read(name), same.read(name), name)
    seen = errs["own_group"]
    assert all(s == seen[0] for s in seen) and seen[0][0] == "RagckptError", seen
    assert "ranks have created different numbers of process groups" in seen[0][1] and "background_group=" in seen[0][1]
    assert not (work / "err_own_group").exists()
    assert errs["unsorted"] == [(None, "")] * 3
    unsorted = ragckpt.open(str(work / "unsorted"))
    assert unsorted.verify().ok and torch.equal(unsorted.read("w"), torch.arange(30.0).reshape(10, 3))
    assert torch.equal(unsorted.read("v"), torch.arange(7))
    assert errs["timeout"] == [[60.0, 60.0]] * 3
    meta = errs["async_meta"]  # rank 2's own check failed: every rank's future says so, rank 2's too
    assert all(m == meta[0] for m in meta) and meta[0][:2] == ("future", "RagckptError"), meta
    assert "rank 2 failed to check its state dict: ValueError: entry 'model.junk' is on the meta" in meta[0][2]
    differs = errs["async_differs"]
    assert all(d == differs[0] for d in differs) and differs[0][0] == "LayoutError", differs
    assert "rank 1's state dict has entry 'model.junk', which rank 0's lacks" in differs[0][1]
    assert not (work / "err_async_meta").exists() and not (work / "err_async_differs").exists()
    assert errs["async_divergent"] == [(None, "")] * 3
    assert torch.equal(ragckpt.open(str(work / "async_divergent")).read("ema"), torch.arange(8.0))
    strict = errs["strict_warning"]
    assert strict[0][0] == "RuntimeWarning" and "is held whole by every rank" in strict[0][1] and strict[1:] == [(None, "")] * 2
    assert torch.equal(ragckpt.open(str(work / "async_divergent_strict")).read("ema"), torch.full((8,), -7.0))
    assert errs["after_strict"] == [(None, "")] * 3 and ragckpt.open(str(work / "after_strict")).verify().ok


def test_a_failure_on_one_rank_raises_the_same_error_on_every_rank(saved: tuple[Path, dict, dict]) -> None:
    work, _, errs = saved
    assert all(torch.equal(ema, torch.arange(8.0)) for ema in errs.pop("divergent_ema"))  # rank 0's copy
    warned = errs.pop("divergent")
    assert warned[1:] == [[], []] and len(warned[0]) == 1, warned
    assert "entry 'model.ema' is held whole by every rank but rank 1's copy differs from rank 0's; saved rank 0's " \
           "copy" in warned[0][0], warned
    # the divergent save, overwritten by all 3 ranks with overwrite=True (ema then equal everywhere)
    assert torch.equal(ragckpt.open(str(work / "divergent")).read("ema"), torch.arange(8.0) - 1)
    assert not [p.name for p in work.iterdir() if ".replaced-" in p.name]
    for case, text in (("overwrite_fails", "rank 0 failed to commit: injected commit failure"),
                       ("overwrite_fails_async", "rank 1 failed to write its shard: OSError: injected: disk full")):
        seen = errs.pop(case)
        assert all(s == seen[0] for s in seen), f"{case}: ranks disagree: {seen}"  # rank 0's note included
        assert text in seen[0][1], seen
        assert seen[0][1].endswith("divergent was left as it was; save again once the cause is fixed"), seen
        rolled_back = errs.pop(case.replace("overwrite_fails", "after_rollback"))
        assert all(torch.equal(ema, torch.arange(8.0) - 1) for ema in rolled_back)  # on every rank, at once
    for case, (kind, rank, text) in {
        "meta": ("RagckptError", 2, "failed to check its state dict: ValueError: entry 'model.junk' is on the meta"),
        "differs": ("LayoutError", 1, "rank 1's state dict has entry 'model.junk', which rank 0's lacks"),
        "shape": ("LayoutError", 2, "rank 2's state dict has entry 'model.junk' as a (3,) float32 tensor where "
                                    "rank 0's has a (2,) float32 tensor"),
        "committed": ("DestinationExistsError", 0, "failed to write its shard"),
        "overwrite_differs": ("OptionError", 1, "rank 1 passed overwrite=True, rank 0 overwrite=False; every rank "
                                                "must pass the same (nothing was written)"),
        "async_overwrite_differs": ("OptionError", 2, "rank 2 passed overwrite=True, rank 0 overwrite=False"),
        "commit": ("FormatError", 0, "failed to commit: injected commit failure"),
    }.items():
        seen = errs[case]
        assert len(seen) == 3 and all(s == seen[0] for s in seen), f"{case}: ranks disagree: {seen}"
        assert seen[0][0] == kind, f"{case}: {seen[0]}"
        assert f"rank {rank}" in seen[0][1] and text in seen[0][1] and "\n" not in seen[0][1], f"{case}: {seen[0]}"
    assert "(and 2 more rank(s))" in errs["committed"][0][1]
    # a failed write or commit says the checkpoint is unusable and what to do; a refusal that wrote
    # nothing (a check, or a committed checkpoint left as it was) does not
    assert errs["commit"][0][1].endswith("; the destination was left uncommitted; save again once the cause is fixed")
    for case in ("meta", "differs", "shape", "committed", "overwrite_differs"):
        assert "uncommitted" not in errs[case][0][1], errs[case]
    assert not any((work / f"err_{c}").exists() for c in ("meta", "differs", "shape"))  # nothing written
    with pytest.raises(ragckpt.NotCommittedError):
        ragckpt.open(str(work / "err_commit"))


# -- one process: refusals and load mismatches ------------------------------------------------------

def small_state(fill: float | None = None) -> dict:
    mesh = init_device_mesh("cpu", (1,))
    w = torch.arange(15, dtype=torch.float32).reshape(5, 3) if fill is None else torch.full((5, 3), fill)
    return {"model": {"w": distribute_tensor(w, mesh, [Shard(0)]),
                      "r": distribute_tensor(torch.arange(4.0) if fill is None else torch.full((4,), fill), mesh,
                                             [Replicate()]),
                      "b": torch.arange(3, dtype=torch.int64) if fill is None else torch.zeros(3, dtype=torch.int64)},
            "optim": {"state.w.step": torch.tensor(7.0 if fill is None else fill),
                      "param_groups.w.lr": 0.5 if fill is None else fill,
                      "param_groups.w.betas": (0.9, 0.99) if fill is None else (fill, fill)}}


@pytest.mark.parametrize("form", ["mapping", "torch-list", "neither"])
def test_an_engine_checkpoints_param_groups_in_either_form(group: None, tmp_path: Path, form: str) -> None:
    """An engine saves `optim.param_groups` as ENGINE.md's {param: {hp: value}} mapping or as torch's
    own list of groups with `params`; a list raised a raw AttributeError from load_state_dict."""
    hyper = {"mapping": {"w": {"lr": 0.1, "betas": [0.9, 0.95]}},
             "torch-list": [{"lr": 0.1, "betas": [0.9, 0.95], "params": ["w"]}],
             "neither": [{"lr": 0.1}]}[form]
    url = str(tmp_path / "eng")
    lay = ragckpt.CheckpointLayout.build({"w": ((4,), "float32")}, 1)
    ragckpt.save_shard(url, 0, {"float32": torch.arange(4.0)}, lay, user={"optim.param_groups": hyper})
    ragckpt.commit(url)
    sd = {"model": {"w": torch.zeros(4)}, "optim": {"param_groups.w.lr": 0.5, "param_groups.w.betas": (0.0, 0.0)}}
    if form == "neither":
        with pytest.raises(ragckpt.FormatError, match="'optim.param_groups' is neither the .* mapping nor a list of "
                                                      "groups with 'params' lists"):
            load_state_dict(url, sd)
        return
    load_state_dict(url, sd)
    assert torch.equal(sd["model"]["w"], torch.arange(4.0))
    assert sd["optim"] == {"param_groups.w.lr": 0.1, "param_groups.w.betas": (0.9, 0.95)}


def test_tied_entries_load_the_last_ones_values_as_dcp_does(group: None, tmp_path: Path) -> None:
    """A tied model (embedding and LM head one tensor under two keys) loading a checkpoint whose two
    tensors differ: both entries were filled at once by two threads, each verifying its blocks in
    place while the other overwrote them, so the load failed as "checksum mismatch ... the object is
    corrupt" (of a checkpoint verify calls OK) or left a patchwork of both. Now the last entry wins,
    every time, as with dcp.load; views into one flat buffer that do not overlap still load apart."""
    url = str(tmp_path / "ck")
    a, b = special_tensor((1024, 512), torch.float32, 1), special_tensor((1024, 512), torch.float32, 2)
    flat = torch.arange(10.0)
    save_state_dict(url, {"a": a, "b": b, "lo": flat[:4].clone(), "hi": flat[4:].clone()})
    for _ in range(5):
        t, buf = torch.zeros(1024, 512), torch.zeros(10)
        load_state_dict(url, {"a": t, "b": t, "lo": buf[:4], "hi": buf[4:]})
        assert_bit_equal(t, b, "tied")
        assert torch.equal(buf, flat)
    t = torch.zeros(1024, 512)
    load_state_dict(url, {"b": t, "a": t})
    assert_bit_equal(t, a, "tied, the other order")


def test_a_lazily_conjugated_entry_is_saved_with_its_values(group: None, tmp_path: Path) -> None:
    """save_state_dict copies entries with copy_, which resolves a conjugate view: the raw-byte
    writers' refusal of such views must not reach it."""
    c = torch.tensor([1 + 2j, -3 - 4j], dtype=torch.complex64)
    save_state_dict(str(tmp_path / "ck"), {"model": {**small_state()["model"], "c": c.conj()}})
    assert torch.equal(ragckpt.open(str(tmp_path / "ck")).read("c"), c.conj().resolve_conj())


def test_save_refuses_placements_other_than_fsdp2s(group: None, tmp_path: Path) -> None:
    mesh = init_device_mesh("cpu", (1,))
    col = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)])
    with pytest.raises(ragckpt.LayoutError, match=r"entry 'model.col' is a DTensor placed Shard\(dim=1\).*"
                                                  r"dcp.save.*ragckpt import-dcp"):
        save_state_dict(str(tmp_path / "a"), {"model": {**small_state()["model"], "col": col}})
    hsdp = distribute_tensor(torch.zeros(4, 6), init_device_mesh("cpu", (1, 1)), [Shard(0), Replicate()])
    with pytest.raises(ragckpt.LayoutError, match=r"entry 'h' is a DTensor on a 2-D device mesh.*import-dcp"):
        save_state_dict(str(tmp_path / "b"), {"h": hsdp})
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_a_module_named_extra_round_trips_under_its_own_key(group: None, tmp_path: Path) -> None:
    """`model.extra.weight` collides with the auxiliary `extra.` prefix: it is stored as
    `extra.model.extra.weight` and comes back to the same key, bit for bit."""
    url = str(tmp_path / "ck")
    mesh = init_device_mesh("cpu", (1,))
    w = torch.tensor([1.5, -0.0, float("nan"), float("inf")]).reshape(2, 2)
    save_state_dict(url, {"model": {"extra.weight": distribute_tensor(w, mesh, [Shard(0)])}})
    assert ragckpt.open(url).names() == ["extra.model.extra.weight"]
    dst = {"model": {"extra.weight": distribute_tensor(torch.zeros(2, 2), mesh, [Shard(0)])}}
    load_state_dict(url, dst)
    assert_bit_equal(dst["model"]["extra.weight"].to_local(), w, "extra.weight")


def test_roundtrip_in_one_process_puts_values_back_in_place(group: None, tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    src = small_state()
    save_state_dict(url, src, user={"step": 7})
    assert sorted(ragckpt.open(url).names()) == ["b", "optim.state.w.step", "r", "w"]
    dst = small_state(fill=0.0)
    w_local = dst["model"]["w"].to_local()
    load_state_dict(url, dst)
    assert dst["model"]["w"].to_local().data_ptr() == w_local.data_ptr()  # filled in place
    assert torch.equal(w_local, src["model"]["w"].to_local())
    assert torch.equal(dst["model"]["r"].to_local(), torch.arange(4.0))
    assert torch.equal(dst["model"]["b"], torch.arange(3)) and dst["optim"]["state.w.step"].item() == 7.0
    assert dst["optim"]["param_groups.w.lr"] == 0.5 and dst["optim"]["param_groups.w.betas"] == (0.9, 0.99)


def test_roundtrip_through_s3(group: None, s3) -> None:
    """The object-store path of save and load (the local S3 server): the same values come back, and
    the checkpoint is committed and verifies."""
    url = f"{s3.url}/fsdp2"
    src = small_state()
    save_state_dict(url, src, storage_options=s3.storage_options)
    assert ragckpt.open(url, storage_options=s3.storage_options).verify().ok
    dst = small_state(fill=0.0)
    load_state_dict(url, dst, storage_options=s3.storage_options)
    assert torch.equal(dst["model"]["w"].to_local(), src["model"]["w"].to_local())
    assert torch.equal(dst["model"]["r"].to_local(), torch.arange(4.0)) and torch.equal(dst["model"]["b"], torch.arange(3))
    assert dst["optim"]["state.w.step"].item() == 7.0 and dst["optim"]["param_groups.w.betas"] == (0.9, 0.99)
    # saved again in the background over the same prefix: the old one is copied aside server-side,
    # the new one committed, the copy deleted
    async_save_state_dict(url, small_state(fill=5.0), user={"step": 5}, storage_options=s3.storage_options,
                          overwrite=True).result(timeout=120)
    ck = ragckpt.open(url, storage_options=s3.storage_options)
    assert ck.user["step"] == 5 and torch.equal(ck.read("w"), torch.full((5, 3), 5.0)) and ck.verify().ok
    assert names_beside(s3) == ["fsdp2"]  # nothing set aside is left beside it


@pytest.mark.parametrize("change, message", [
    (lambda s: s["model"].update(extra=torch.zeros(2)),
     r"entry 'model.extra' of the state dict \(tensor 'extra'\) is not in checkpoint"),
    # a module named `extra`: its entries are stored under the auxiliary prefix, and the error gives both names
    (lambda s: s["model"].update({"extra.weight": torch.zeros(2)}),
     r"entry 'model.extra.weight' of the state dict \(tensor 'extra.model.extra.weight'\) is not in checkpoint"),
    # several missing: counted as entries (the rank count the error adds reads differently)
    (lambda s: s["model"].update(extra=torch.zeros(2), more=torch.zeros(2), most=torch.zeros(2)),
     r"entry 'model.extra' of the state dict \(tensor 'extra'\) is not in checkpoint \S+ \(and 2 more entries\)"),
    (lambda s: s["model"].update(b=torch.zeros(4, dtype=torch.int64)),
     r"entry 'model.b' of the state dict is \(4,\) int64 but tensor 'b' is \(3,\) int64 in checkpoint "),
    (lambda s: s["optim"].update({"state.w.step": torch.tensor(0.0, dtype=torch.float64)}),
     r"entry 'optim.state.w.step' of the state dict is \(\) float64 but tensor 'optim.state.w.step' is \(\) "
     r"float32 in checkpoint "),
    (lambda s: s["optim"].update({"param_groups.w.eps": 0.0}),
     r"non-tensor entry 'optim.param_groups.w.eps' of the state dict is not in checkpoint"),
], ids=["extra", "module_named_extra", "several", "shape", "dtype", "hyperparameter"])
def test_load_mismatch_names_the_entry_and_reads_nothing(group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        change: object, message: str) -> None:
    url = str(tmp_path / "ck")
    save_state_dict(url, small_state())
    dst = small_state(fill=-1.0)
    change(dst)

    def no_reads(*_a: object, **_k: object) -> None:
        raise AssertionError("a load that fails its checks must read nothing")

    monkeypatch.setattr(Checkpoint, "read_blocks_into", no_reads)
    monkeypatch.setattr(Checkpoint, "read_rank_ranges", no_reads)
    with pytest.raises(ragckpt.RagckptError, match=message) as e:
        load_state_dict(url, dst)
    assert "rank 0 failed to check its state dict against the checkpoint" in str(e.value)
    assert torch.all(dst["model"]["w"].to_local() == -1.0) and dst["optim"]["param_groups.w.lr"] == -1.0


def test_hyperparameters_that_look_alike_come_back_as_they_were(group: None, tmp_path: Path) -> None:
    """Equal-looking values are encoded once (an optimizer repeats its dozen values per parameter),
    but never merged across what torch.save tells apart: -0.0 and 0.0, True and 1, 1 and 1.0."""
    src = small_state()
    looks = {"a": 0.0, "b": -0.0, "c": True, "d": 1, "e": 1.0, "f": (0.9, -0.0), "g": [0.9, 0.0], "h": 0.0}
    src["optim"].update({f"param_groups.w.{k}": v for k, v in looks.items()})
    save_state_dict(str(tmp_path / "ck"), src)
    dst = small_state(fill=0.0)
    dst["optim"].update({f"param_groups.w.{k}": None for k in looks})
    load_state_dict(str(tmp_path / "ck"), dst)
    got = {k: dst["optim"][f"param_groups.w.{k}"] for k in looks}
    assert {k: (type(v), repr(v)) for k, v in got.items()} == {k: (type(v), repr(v)) for k, v in looks.items()}


def test_overwrite_replaces_a_committed_checkpoint_and_puts_it_back_on_failure(group: None, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import ragckpt.integrations.fsdp2 as sd

    url = str(tmp_path / "latest")
    save_state_dict(url, small_state(), user={"step": 1})
    with pytest.raises(ragckpt.DestinationExistsError, match=r"already committed; save into a new directory \(or pass overwrite=True to replace it\)"):
        save_state_dict(url, small_state(fill=2.0))
    with pytest.raises(TypeError, match="overwrite must be True or False, got 'yes'"):
        save_state_dict(url, small_state(fill=2.0), overwrite="yes")
    save_state_dict(url, small_state(fill=2.0), user={"step": 2}, overwrite=True)
    async_save_state_dict(url, small_state(fill=3.0), user={"step": 3}, overwrite=True).result(timeout=60)
    ck = ragckpt.open(url)
    assert ck.user["step"] == 3 and torch.equal(ck.read("w"), torch.full((5, 3), 3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]  # nothing set aside is left

    def broken(*_a: object, **_k: object) -> None:
        raise ragckpt.FormatError("injected commit failure")

    monkeypatch.setattr(sd, "commit", broken)
    with pytest.raises(ragckpt.FormatError, match=r"rank 0 failed to commit: injected commit failure.*was left as it was"):
        save_state_dict(url, small_state(fill=4.0), user={"step": 4}, overwrite=True)
    ck = ragckpt.open(url)  # the step-3 checkpoint, back in place
    assert ck.user["step"] == 3 and torch.equal(ck.read("w"), torch.full((5, 3), 3.0)) and ck.verify().ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_overwrite_where_nothing_can_be_set_aside_replaces_in_place(group: None) -> None:
    """An object store other than S3 (here fsspec's memory://) cannot hold a set-aside copy: the old
    checkpoint is deleted in place, as the one-process writers do."""
    url = f"memory://overwrite-{os.getpid()}/latest"
    save_state_dict(url, small_state(), user={"step": 1})
    save_state_dict(url, small_state(fill=2.0), user={"step": 2}, overwrite=True)
    ck = ragckpt.open(url)
    assert ck.user["step"] == 2 and torch.equal(ck.read("w"), torch.full((5, 3), 2.0)) and ck.verify().ok


def test_load_of_part_of_the_checkpoint_fills_that_part(group: None, tmp_path: Path) -> None:
    """The model alone from a model + optimizer save (evaluation, fine-tuning), as dcp.load allows."""
    url = str(tmp_path / "ck")
    save_state_dict(url, small_state())
    dst = {"model": small_state(fill=-1.0)["model"]}
    load_state_dict(url, dst)
    assert torch.equal(dst["model"]["w"].to_local(), small_state()["model"]["w"].to_local())
    assert torch.equal(dst["model"]["b"], torch.arange(3))


class AppState:
    """The DCP tutorial's wrapper: a Stateful that save and load unwrap with state_dict/load_state_dict."""

    def __init__(self, fill: float | None = None) -> None:
        self.state = small_state(fill)
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, sd: dict) -> None:
        self.loaded = sd


def test_stateful_objects_are_unwrapped_as_dcp_does(group: None, tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    save_state_dict(url, {"app": AppState()})
    assert sorted(ragckpt.open(url).names()) == ["app.model.b", "app.model.r", "app.model.w", "app.optim.state.w.step"]
    app = AppState(fill=-1.0)
    load_state_dict(url, {"app": app})
    assert app.loaded is app.state  # handed back, filled in place
    assert torch.equal(app.state["model"]["w"].to_local(), small_state()["model"]["w"].to_local())
    assert app.state["optim"]["param_groups.w.lr"] == 0.5 and app.state["optim"]["param_groups.w.betas"] == (0.9, 0.99)


def test_a_stateful_of_values_alone_loads_as_with_dcp_load(group: None, tmp_path: Path) -> None:
    """Loading just the LR scheduler of a model + optimizer + scheduler save was refused ("the state
    dict holds no tensors", with advice about get_state_dict's options), where dcp.load hands the
    scheduler its state. A save still needs tensors, and an empty load is refused in a load's words."""
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    for _ in range(5):
        opt.step()
        sched.step()
    url = str(tmp_path / "ck")
    save_state_dict(url, {**small_state(), "sched": sched})
    fresh = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), step_size=3)
    assert fresh.last_epoch == 0
    load_state_dict(url, {"sched": fresh})
    assert fresh.state_dict() == sched.state_dict() and fresh.last_epoch == 5
    with pytest.raises(ragckpt.LayoutError, match="the state dict holds no tensors"):
        save_state_dict(str(tmp_path / "values"), {"sched": sched})
    with pytest.raises(ragckpt.LayoutError, match="the state dict is empty: nothing to load"):
        load_state_dict(url, {"model": {}})


def test_an_optimizer_passed_before_its_first_step_gets_a_warning_not_silence(group: None, tmp_path: Path) -> None:
    """An optimizer object (a Stateful) that never stepped has no state for the load to fill: as with
    dcp.load nothing of its saved state arrives, but here rank 0 says so."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    url = str(tmp_path / "ck")
    save_state_dict(url, {"model": model, "optim": opt})
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    with pytest.warns(RuntimeWarning, match=r"optimizer 'optim' has no state yet \(never stepped\), so none of the "
                                            r"checkpoint's 'optim.state.\*' tensors were loaded"):
        load_state_dict(url, {"model": fresh, "optim": fresh_opt})
    assert torch.equal(fresh.weight, model.weight) and not fresh_opt.state
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an optimizer with state: no warning
        load_state_dict(url, {"model": fresh, "optim": opt})


def test_a_value_the_weights_only_loader_refuses_is_named_in_one_short_line(group: None, tmp_path: Path) -> None:
    import numpy as np

    state = small_state()
    state["optim"]["param_groups.w.lr"] = np.float64(0.5)
    with pytest.raises(ragckpt.RagckptError) as e:
        save_state_dict(str(tmp_path / "ck"), state)
    msg = str(e.value)
    assert "non-tensor entry 'optim.param_groups.w.lr' (a numpy.float64) cannot be stored" in msg
    assert "plain Python values" in msg and len(msg) < 400 and "\x1b" not in msg and "weights_only=False" not in msg


def test_load_from_a_dcp_directory_says_to_import_it(group: None, tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    save_state_dict(url, small_state())
    export_dcp(url, str(tmp_path / "dcp"))
    with pytest.raises(ragckpt.RagckptError, match=r"is a torch.distributed.checkpoint \(DCP\) directory, not a "
                                                   r"ragckpt checkpoint; convert it with `ragckpt import-dcp`"):
        load_state_dict(str(tmp_path / "dcp"), small_state(fill=0.0))


def test_bare_model_state_dict_exports_to_dcp_under_its_own_keys(group: None, tmp_path: Path) -> None:
    """No `model.` prefix for a bare `model.state_dict()`, and DCP's path for each key is recorded, so
    `export-dcp` gives back the very dict that was saved (dcp_to_torch_save unflattens by those paths)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    mesh = init_device_mesh("cpu", (1,))
    src = {"layer.w": distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)]),
           "layer.b": torch.tensor([1, 2], dtype=torch.int32)}
    save_state_dict(str(tmp_path / "ck"), src)
    assert sorted(ragckpt.open(str(tmp_path / "ck")).names()) == ["layer.b", "layer.w"]
    export_dcp(str(tmp_path / "ck"), str(tmp_path / "dcp"))
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "sd.pt"))
    got = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert sorted(got) == ["layer.b", "layer.w"]
    assert_bit_equal(got["layer.w"], torch.arange(6.0).reshape(3, 2), "layer.w")
    assert_bit_equal(got["layer.b"], src["layer.b"], "layer.b")


def test_load_of_an_engine_checkpoint_takes_hyperparameters_from_the_readable_view(group: None, tmp_path: Path) -> None:
    """A checkpoint saved by a training engine (docs/ENGINE.md: `save_shard`, hyperparameters only as
    user["optim.param_groups"], a ragged layout) loads too; `betas` comes back a tuple, as Adam keeps it."""
    url = str(tmp_path / "engine")
    want = small_state()
    dense = {"w": want["model"]["w"].full_tensor(), "r": want["model"]["r"].full_tensor(), "b": want["model"]["b"],
             "optim.state.w.step": want["optim"]["state.w.step"]}
    ragckpt.write_global(dense, url, world_size=2, layout="ragged",
                         user={"optim.param_groups": {"w": {"lr": 0.5, "betas": [0.9, 0.99]}}})
    dst = small_state(fill=0.0)
    load_state_dict(url, dst)
    for k in ("w", "r", "b"):
        got = dst["model"][k]
        assert_bit_equal(got.full_tensor() if k != "b" else got, dense[k], k)
    assert dst["optim"]["state.w.step"].item() == 7.0
    assert dst["optim"]["param_groups.w.lr"] == 0.5 and dst["optim"]["param_groups.w.betas"] == (0.9, 0.99)


@pytest.mark.slow
def test_the_fsdp2_guide_example_runs_as_written(tmp_path):
    """docs/FSDP2.md's example under torchrun: saved by 3 ranks, loaded by 2 (its own assert checks
    the restored learning rate); the checkpoint then holds the 3-rank save's rows, whole."""
    import re

    guide = Path(__file__).resolve().parents[2] / "docs" / "FSDP2.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), flags=re.S)
    script = tmp_path / "fsdp2_ckpt.py"
    script.write_text(next(b for b in blocks if "torchrun" not in b and "sys.argv" in b))
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    url = str(tmp_path / "ck")
    for mode, n in (("save", 3), ("load", 2)):
        p = subprocess.run([torchrun, "--standalone", "--nproc-per-node", str(n), str(script), mode, url],
                           capture_output=True, text=True, timeout=240, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stdout.count(f"{mode} done") == n, p.stdout
    ck = ragckpt.open(url)
    assert ck.world_size == 3 and ck.verify().ok and ck.user["step"] == 1
    assert ck.meta("0.weight").shape == (22, 16) and "optim.state.0.weight.exp_avg" in ck.names()


def test_a_save_that_wrote_nothing_does_not_call_its_destination_uncommitted(group: None, tmp_path: Path) -> None:
    """A destination that is a regular file fails at the first write: nothing was written, so the error
    must not say a checkpoint was left uncommitted."""
    target = tmp_path / "afile"
    target.write_bytes(b"not a checkpoint")
    with pytest.raises(ragckpt.RagckptError, match="failed to write its shard") as e:
        save_state_dict(str(target), small_state())
    assert "uncommitted" not in str(e.value) and target.read_bytes() == b"not a checkpoint"


def test_the_entry_points_are_importable_from_their_convert_path_too():
    import ragckpt.convert.state_dict as convert_path
    import ragckpt.integrations.fsdp2 as fsdp2

    for name in convert_path.__all__:
        assert getattr(convert_path, name) is getattr(fsdp2, name)
