"""Where the converters (export-hf, import-hf, export-dcp, import-dcp) may write: never over or inside
their input, never into "" (the working directory), never over unrelated files, and nothing left
behind by a failure or by bad input."""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import ragckpt
from ragckpt.convert import dcp as conv
from ragckpt.convert import hf_export
from ragckpt.convert.dcp import export_dcp, import_dcp
from ragckpt.convert.hf_export import export_hf
from ragckpt.convert.hf_import import import_hf
from ragckpt.errors import DestinationError, DestinationExistsError, RagckptError
from tests.helpers import cli_error

STATE = {f"w{i}": torch.arange(i * 256, (i + 1) * 256, dtype=torch.float32).reshape(16, 16) for i in range(3)}


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    """tmp_path with a checkpoint `ck`, a Hugging Face model `hf` and a DCP save `dcp`."""
    ragckpt.write_global(STATE, str(tmp_path / "ck"), 2)
    (tmp_path / "hf").mkdir()
    save_file(STATE, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    export_dcp(str(tmp_path / "ck"), str(tmp_path / "dcp"))
    return tmp_path


def tree(path: Path) -> dict[str, int]:
    """Every file under `path` with its size: a snapshot to prove nothing was touched."""
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}



def dcp_load_equal(path: Path) -> None:
    target = {"model": {k: torch.zeros_like(v) for k, v in STATE.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(path))
    for k, v in STATE.items():
        assert torch.equal(target["model"][k], v), k


# -- the destination is never the source ------------------------------------------------------------

@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("cmd,src,dst", [
    ("export-dcp", "work/ck", "work"),          # DST contains SRC: --overwrite used to delete the source
    ("export-dcp", "work/ck", "work/ck/dcp"),   # DST inside SRC
    ("export-hf", "work/ck", "work/ck"),        # used to write model.safetensors into the checkpoint
    ("export-hf", "work/ck", "work/ck/hf"),
    ("import-hf", "work/hf", "work/hf"),        # --overwrite used to delete model.safetensors
    ("import-hf", "work/hf/model.safetensors", "work/hf"),
    ("import-dcp", "work/dcp", "work/dcp"),
    ("import-dcp", "work/dcp", "work/dcp/rag"),
])
def test_destination_overlapping_the_source_is_refused(inputs: Path, cmd: str, src: str, dst: str,
                                                        overwrite: bool) -> None:
    (inputs / "work").mkdir()
    for name in ("ck", "hf", "dcp"):
        (inputs / name).rename(inputs / "work" / name)
    before = tree(inputs)
    args = [cmd, str(inputs / src), str(inputs / dst)]
    args += ["-w", "2"] if cmd.startswith("import") else []
    args += ["--overwrite"] if overwrite else []
    assert "overlaps the source" in cli_error(*args)
    assert tree(inputs) == before


@pytest.mark.parametrize("cmd,src", [("export-dcp", "ck"), ("export-hf", "ck"), ("import-hf", "hf"),
                                     ("import-dcp", "dcp")])
def test_empty_destination_string_is_refused(inputs: Path, monkeypatch: pytest.MonkeyPatch, cmd: str,
                                             src: str) -> None:
    """`ragckpt export-dcp ck "$OUT" --overwrite` with OUT unset used to replace the working directory."""
    cwd = inputs / "cwd"
    cwd.mkdir()
    (cwd / "notes.txt").write_text("mine")
    monkeypatch.chdir(cwd)
    extra = ["-w", "2"] if cmd.startswith("import") else []
    assert "empty string" in cli_error(cmd, str(inputs / src), "", "--overwrite", *extra)
    assert tree(cwd) == {"notes.txt": 4}


def test_export_hf_refuses_its_own_s3_checkpoint(s3) -> None:
    url, opts = s3
    ragckpt.write_global(STATE, f"{url}/ck", 2, storage_options=opts)
    fs = s3.fs()
    before = sorted(fs.find(f"{url}/ck"))
    for dst in (f"{url}/ck", f"{url}/ck/hf", f"{url}/ck/"):
        with pytest.raises(DestinationError, match="overlaps the source"):
            export_hf(f"{url}/ck", dst, storage_options=opts)
    fs.invalidate_cache()
    assert sorted(fs.find(f"{url}/ck")) == before


# -- export-hf replaces only the model it replaces ----------------------------------------------------

def test_export_hf_overwrite_replaces_only_the_previous_model(inputs: Path) -> None:
    out = inputs / "out"
    export_hf(str(inputs / "ck"), str(out), max_shard_size=1100)  # 3 shards + index
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra_w"] = "custom-part.safetensors"    # named by the index: the model's
    index["weight_map"]["evil_w"] = "../outside.safetensors"      # not a file of OUT_DIR: never deleted
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "custom-part.safetensors").write_bytes(b"old")
    (inputs / "outside.safetensors").write_bytes(b"keep")
    (out / "adapter_model.safetensors").write_bytes(b"lora")          # not the model's: kept
    (out / "tokenizer.json").write_text("{}")
    res = export_hf(str(inputs / "ck"), str(out), overwrite=True)
    assert res.files == ["model.safetensors"]
    assert sorted(os.listdir(out)) == ["adapter_model.safetensors", "model.safetensors", "tokenizer.json"]
    assert (out / "adapter_model.safetensors").read_bytes() == b"lora"
    assert (inputs / "outside.safetensors").read_bytes() == b"keep"
    assert set(load_file(out / "model.safetensors")) == set(STATE)


def test_export_hf_next_to_other_safetensors_needs_no_overwrite(inputs: Path) -> None:
    """An adapter file is not model weights: it neither blocks the export nor gets replaced."""
    out = inputs / "out"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(b"lora")
    export_hf(str(inputs / "ck"), str(out))
    assert sorted(os.listdir(out)) == ["adapter_model.safetensors", "model.safetensors"]
    with pytest.raises(DestinationExistsError, match="model.safetensors"):
        export_hf(str(inputs / "ck"), str(out))


def break_checkpoint(ck: Path) -> None:
    """Delete one data object of the checkpoint, so reading its tensors fails mid-export."""
    victim = next(p for p in sorted((ck / "buffers").rglob("c.*")) if p.is_file())
    victim.unlink()


def test_failed_export_hf_removes_the_directories_it_created(inputs: Path) -> None:
    break_checkpoint(inputs / "ck")
    with pytest.raises(RagckptError):
        export_hf(str(inputs / "ck"), str(inputs / "new" / "out"))
    assert not (inputs / "new").exists()


def test_failed_export_hf_leaves_an_existing_directory_as_it_was(inputs: Path, monkeypatch) -> None:
    out = inputs / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")

    def full_disk(self, name: str, data: bytes, durable: bool) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", name)

    monkeypatch.setattr(hf_export._OutDir, "write_small", full_disk)  # the index, after every shard
    with pytest.raises(OSError, match="No space"):
        export_hf(str(inputs / "ck"), str(out), max_shard_size=1100)
    assert sorted(os.listdir(out)) == ["tokenizer.json"]  # the finished shards went, the rest stayed


# -- importers: nothing written into a directory that holds something else ----------------------------

@pytest.mark.parametrize("cmd,src", [("import-hf", "hf"), ("import-dcp", "dcp")])
def test_import_refuses_a_non_empty_destination_and_writes_nothing(inputs: Path, cmd: str, src: str) -> None:
    dst = inputs / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    line = cli_error(cmd, str(inputs / src), str(dst), "-w", "2")
    assert "not empty" in line and "--overwrite" in line and str(dst) in line
    assert tree(dst) == {"notes.txt": 4}


def test_import_dcp_checks_options_before_writing(inputs: Path) -> None:
    """Bad options used to fail after the destination's metadata and buffer directories were made."""
    with pytest.raises(RagckptError, match="workers"):
        import_dcp(str(inputs / "dcp"), str(inputs / "o"), workers=-1)
    with pytest.raises(RagckptError, match="world size"):
        import_dcp(str(inputs / "dcp"), str(inputs / "o"), world_size=0)
    assert not (inputs / "o").exists()


def test_import_hf_overwrite_replaces_a_checkpoint(inputs: Path) -> None:
    import_hf(str(inputs / "hf"), str(inputs / "rag"), 2)
    with pytest.raises(DestinationExistsError):
        import_hf(str(inputs / "hf"), str(inputs / "rag"), 3)
    import_hf(str(inputs / "hf"), str(inputs / "rag"), 3, overwrite=True)
    assert ragckpt.open(str(inputs / "rag")).world_size == 3


# -- export-dcp: empty directories, mount points, local paths ------------------------------------------

def test_export_dcp_writes_into_an_existing_empty_directory(inputs: Path) -> None:
    out = inputs / "mnt"
    out.mkdir()
    export_dcp(str(inputs / "ck"), str(out))  # no --overwrite needed: there is nothing to replace
    dcp_load_equal(out)
    assert not [p for p in inputs.iterdir() if p.name.startswith("mnt.")]  # no temporary sibling


def test_export_dcp_treats_a_fresh_mount_point_as_empty(inputs: Path, monkeypatch) -> None:
    out = inputs / "mnt"
    (out / "lost+found").mkdir(parents=True)
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.path.abspath(p) == str(out) or real(p))
    export_dcp(str(inputs / "ck"), str(out))
    dcp_load_equal(out)
    assert (out / "lost+found").is_dir()


def test_failed_export_dcp_into_an_empty_directory_leaves_it_empty(inputs: Path, monkeypatch) -> None:
    out = inputs / "mnt"
    out.mkdir()
    real, calls = torch.save, []

    def flaky(obj, f) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(obj, f)

    monkeypatch.setattr(conv.torch, "save", flaky)
    with pytest.raises(OSError, match="No space left on device"):  # the injected failure, not another
        export_dcp(str(inputs / "ck"), str(out), workers=1)
    assert out.is_dir() and os.listdir(out) == []


def refuse_renaming(monkeypatch, path: Path, code: int) -> None:
    """Make renaming `path` (`os.rename(path, ...)`, or exchanging it with another path) fail as it
    does for a mount point (EBUSY)."""
    real, real_exchange = os.rename, conv._exchange

    def rename(src, dst, *a, **k):
        if os.path.abspath(src) == str(path):
            raise OSError(code, os.strerror(code), str(src))
        return real(src, dst, *a, **k)

    def exchange(a, b):
        if str(path) in (os.path.abspath(a), os.path.abspath(b)):
            raise OSError(code, os.strerror(code), str(b))
        return real_exchange(a, b)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(conv.swap, "_exchange", exchange)


def test_export_dcp_overwrite_exchanges_the_trees_atomically(inputs: Path, monkeypatch) -> None:
    """The old and the new tree are swapped with one renameat2(RENAME_EXCHANGE): there is no moment
    without OUT (two renames left none between them, and a kill there left only hidden siblings).
    Where the exchange is unavailable, the two renames still work."""
    a, b = inputs / "a", inputs / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "y").write_text("b")
    assert conv._exchange(str(a), str(b))
    assert [p.name for p in a.iterdir()] == ["y"] and [p.name for p in b.iterdir()] == ["x"]
    out = inputs / "out"
    export_dcp(str(inputs / "ck"), str(out))
    (out / "stale.distcp").write_bytes(b"old")
    renames = []
    real = os.rename
    monkeypatch.setattr(os, "rename", lambda s, d, *x, **k: (renames.append((s, d)), real(s, d, *x, **k))[1])
    export_dcp(str(inputs / "ck"), str(out), overwrite=True)
    assert not [r for r in renames if str(out) in (os.path.abspath(r[0]), os.path.abspath(r[1]))]
    assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp"]
    dcp_load_equal(out)
    monkeypatch.setattr(conv.swap, "_exchange", lambda x, y: False)
    (out / "stale.distcp").write_bytes(b"old")
    export_dcp(str(inputs / "ck"), str(out), overwrite=True)
    assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp"]
    assert not [p for p in inputs.iterdir() if p.name.startswith("out.")]


def test_export_dcp_removes_the_leftovers_of_a_killed_export(inputs: Path) -> None:
    """A kill leaves `OUT.tmp-<hex>` (the tree being written) or `OUT.old-<hex>` (the tree being
    replaced) beside OUT; the next export into OUT removes exactly those."""
    for name in ("out.tmp-0123456789ab", "out.old-ba9876543210"):
        (inputs / name).mkdir()
        (inputs / name / "__0_0.distcp").write_bytes(b"x" * 100)
    mine = ["out.tmp-mine", "out.old-0123456789ab.keep", "other.tmp-0123456789ab"]
    for name in mine:
        (inputs / name).mkdir()
    (inputs / "out.tmp-aaaaaaaaaaaa").write_text("a file, not an export tree")
    export_dcp(str(inputs / "ck"), str(inputs / "out"))
    dcp_load_equal(inputs / "out")
    left = sorted(p.name for p in inputs.iterdir() if p.name.startswith(("out.", "other.")))
    assert left == sorted([*mine, "out.tmp-aaaaaaaaaaaa"])


@pytest.mark.parametrize("code", [errno.EBUSY, errno.EXDEV, errno.EPERM])
def test_export_dcp_overwrite_of_a_directory_that_cannot_be_renamed(inputs: Path, monkeypatch, code: int) -> None:
    out = inputs / "mnt"
    (out / "old_sub").mkdir(parents=True)
    (out / "stale.distcp").write_bytes(b"old")
    refuse_renaming(monkeypatch, out, code)
    export_dcp(str(inputs / "ck"), str(out), overwrite=True)
    assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp"]  # old contents replaced in place
    dcp_load_equal(out)
    assert not [p for p in inputs.iterdir() if p.name.startswith("mnt.")]


def test_export_dcp_overwrite_in_place_removes_the_old_metadata_first(inputs: Path, monkeypatch) -> None:
    """A crash while the old files of a directory that cannot be renamed are deleted must not leave
    the old `.metadata` beside missing data files: DCP would take that for a checkpoint."""
    out = inputs / "mnt"
    export_dcp(str(inputs / "ck"), str(out))
    for i in range(6):  # more entries than .metadata and one data file, in whatever order listdir gives
        (out / f"extra{i}.distcp").write_bytes(b"old")
    refuse_renaming(monkeypatch, out, errno.EBUSY)
    real, removed = os.unlink, []

    def unlink(path, *a, **k):
        real(path, *a, **k)
        removed.append(os.path.basename(path))
        if len(removed) == 2:
            raise OSError(errno.EIO, "simulated crash", str(path))

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(DestinationError, match="incomplete"):
        export_dcp(str(inputs / "ck"), str(out), overwrite=True)
    assert removed[0] == ".metadata" and not (out / ".metadata").exists()


def test_export_dcp_rename_failure_is_one_line(inputs: Path, monkeypatch) -> None:
    out = inputs / "out"
    out.mkdir()
    (out / "stale.distcp").write_bytes(b"old")
    refuse_renaming(monkeypatch, out, errno.EIO)
    line = cli_error("export-dcp", str(inputs / "ck"), str(out), "--overwrite")
    assert line.startswith(f"error: cannot replace {out}") and "OSError" not in line
    assert tree(out) == {"stale.distcp": 3}
    assert not [p for p in inputs.iterdir() if p.name.startswith("out.")]


def test_dcp_output_must_be_a_local_path(inputs: Path, monkeypatch) -> None:
    monkeypatch.chdir(inputs)
    line = cli_error("export-dcp", "ck", "s3://b/dcp")
    assert "must be a local path" in line and "s3://b/dcp" in line
    # the DCP input may be a URL (tests/convert/test_dcp_s3.py); one holding nothing is named, not made a directory
    line = cli_error("import-dcp", "memory://no-such-dcp/dcp", "x")
    assert "no .metadata" in line and "memory://no-such-dcp/dcp/.metadata is missing" in line
    assert not (inputs / "s3:").exists() and not (inputs / "memory:").exists() and not (inputs / "x").exists()
    # file:// is a local path
    export_dcp(str(inputs / "ck"), f"file://{inputs / 'viafile'}")
    dcp_load_equal(inputs / "viafile")
    import_dcp(f"file://{inputs / 'viafile'}", str(inputs / "back"))
    assert set(ragckpt.open(str(inputs / "back")).names()) == set(STATE)


@pytest.mark.parametrize("cmd,src", [("import-hf", "hf"), ("import-dcp", "dcp")])
@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
def test_an_import_stopped_half_way_says_how_to_redo_it(inputs: Path, monkeypatch, cmd: str, src: str, stop) -> None:
    """An import stopped after writing DST's metadata leaves DST uncommitted; the message used to say
    "re-run the command", which is then refused (DST holds an uncommitted checkpoint). It says to
    re-run with --overwrite, and that works."""
    from ragckpt.checkpoint import writer
    from tests.helpers import cli_run

    real, calls = writer.write_rank_buffer, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise stop(errno.EIO, "simulated") if stop is OSError else stop()
        return real(*a, **k)

    monkeypatch.setattr(writer, "write_rank_buffer", failing)
    dst = str(inputs / "out")
    code, out, err = cli_run(cmd, str(inputs / src), dst, "--world-size", "2")
    assert code == (130 if stop is KeyboardInterrupt else 2), (out, err)
    assert err.strip().endswith("the destination was left uncommitted; re-run with --overwrite to replace it"), err
    assert not ragckpt.open(dst, allow_uncommitted=True).committed
    monkeypatch.setattr(writer, "write_rank_buffer", real)
    assert "pass --overwrite" in cli_error(cmd, str(inputs / src), dst, "--world-size", "2")
    code, _, err = cli_run(cmd, str(inputs / src), dst, "--world-size", "2", "--overwrite")
    assert code == 0, err
    for k, v in STATE.items():
        assert torch.equal(ragckpt.open(dst).read(k), v)
