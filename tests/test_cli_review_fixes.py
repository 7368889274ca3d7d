"""Findings of the CLI review (round 2): unreadable directories, plain zarr trees and damaged
checkpoints in `ls`, empty sources, directories where files belong, error wording that names the
object, storage options that must be mappings, the verify progress total, and output polish.

Permission tests need a user the file modes apply to: as root they run the command as `nobody`
(setpriv) in a scratch directory everyone can enter; as anyone else they chmod and run in process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

import ragckpt
from cli.main import cli
from ragckpt.checkpoint import manifest as mf

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534


def run(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(cli, list(args))
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r.exit_code, r.stdout, r.stderr


def one_line_error(args: list[str], *needles: str, code: int = 2) -> str:
    rc, out, err = run(*args)
    lines = err.strip().splitlines()
    assert rc == code and len(lines) == 1 and lines[0].startswith("error: "), (rc, out, err)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def usage_error(args: list[str]) -> str:
    """The message of the click usage error `args` raise (before the command body runs)."""
    with pytest.raises(click.UsageError) as ei:
        cli.main(args, prog_name="ragckpt", standalone_mode=False)
    return ei.value.format_message()


def save(url: str, world_size: int = 2, layout: str = "ragged") -> str:
    ragckpt.write_global({"w": torch.randn(10, 7), "lm_head.weight": torch.randn(3, 4)}, url, world_size, layout)
    return url


# -- running as a user that file modes apply to ----------------------------------------------------------

@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A scratch directory that `nobody` can enter (pytest's tmp_path is private to root)."""
    d = Path(tempfile.mkdtemp(prefix="ragckpt-review-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        for p in [d, *d.rglob("*")]:
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o755)
        shutil.rmtree(d, ignore_errors=True)


def as_unprivileged(*args: str) -> tuple[int, str, str]:
    """Run the CLI as a user that file modes apply to (nobody when we are root)."""
    if os.geteuid() != 0:
        return run(*args)
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot test permission errors")
    p = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
                        "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


@contextmanager
def mode(path: Path, m: int) -> Iterator[None]:
    old = path.stat().st_mode & 0o7777
    path.chmod(m)
    try:
        yield
    finally:
        path.chmod(old)


def assert_one_line(rc: int, err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, err)
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# -- 1, 3: unreadable directories ---------------------------------------------------------------------------

def test_ls_of_an_unreadable_directory_is_a_permission_error(shared_dir):
    d = shared_dir / "ud"
    save(str(d / "ck"))
    with mode(d, 0o000):
        rc, out, err = as_unprivileged("ls", str(d))
        assert_one_line(rc, err, str(d), "permission denied")
        rc, out, err = as_unprivileged("ls", str(d), "--json")
        assert_one_line(rc, err, str(d), "permission denied")
        assert "permission denied" in json.loads(out)["error"]  # never a silent []


def test_ls_of_a_directory_with_an_unreadable_subdirectory_fails(shared_dir):
    d = shared_dir / "runs"
    save(str(d / "ck"))
    (d / "private").mkdir()
    with mode(d / "private", 0o000):
        rc, out, err = as_unprivileged("ls", str(d))
    assert_one_line(rc, err, str(d / "private"), "permission denied")


def test_info_of_an_unreadable_directory_says_permission_denied(shared_dir):
    d = shared_dir / "ud"
    save(str(d))
    with mode(d, 0o000):
        rc, out, err = as_unprivileged("info", str(d))
        line = assert_one_line(rc, err, str(d), "permission denied")
        assert "no ragckpt checkpoint" not in line
        rc, out, err = as_unprivileged("verify", str(d))
        assert_one_line(rc, err, str(d), "permission denied")


# -- 2: ls lists ragckpt checkpoints only, damaged ones as damaged ----------------------------------------

def _plain_array_doc() -> bytes:
    import numpy as np

    return mf.array_doc((3,), np.dtype("float32"), (3,), {})


def test_ls_skips_plain_zarr_and_flags_damaged_checkpoints(tmp_path):
    d = tmp_path / "runs"
    good = save(str(d / "good"))
    inc = save(str(d / "incomplete"))
    os.remove(Path(inc) / mf.COMMIT_KEY)
    (d / "group").mkdir()
    (d / "group" / "zarr.json").write_bytes(mf.group_doc())
    (d / "array").mkdir()
    (d / "array" / "zarr.json").write_bytes(_plain_array_doc())
    nested = save(str(d / "group" / "inner"))  # a checkpoint inside a plain zarr group is still listed
    garbage = save(str(d / "garbage"))
    (Path(garbage) / "zarr.json").write_text("garbage{")
    foreign = save(str(d / "foreign"))
    (Path(foreign) / "zarr.json").write_bytes(mf.group_doc())
    torn = save(str(d / "torn"))
    os.remove(Path(torn) / mf.COMMIT_KEY)
    (Path(torn) / "zarr.json").write_text("{")

    rc, out, err = run("ls", str(d), "--json")
    assert rc == 0, err
    rows = {r["url"]: r for r in json.loads(out)}
    assert sorted(rows) == sorted([good, inc, nested, garbage, foreign, torn])
    assert rows[good] == {"url": good, "committed": True}
    assert rows[inc] == {"url": inc, "committed": False}
    assert rows[nested] == {"url": nested, "committed": True}
    for bad in (garbage, foreign, torn):
        assert rows[bad]["committed"] is False and "zarr.json" in rows[bad]["damaged"], rows[bad]
    assert "not valid JSON" in rows[garbage]["damaged"]
    assert "not a ragckpt manifest" in rows[foreign]["damaged"]

    rc, out, err = run("ls", str(d))
    assert rc == 0, err
    by_url = {line.split()[1]: line.split()[0] for line in out.splitlines()}
    assert by_url == {good: "committed", inc: "INCOMPLETE", nested: "committed", garbage: "DAMAGED",
                      foreign: "DAMAGED", torn: "DAMAGED"}


def test_ls_of_a_plain_zarr_group_lists_the_checkpoints_inside(tmp_path):
    g = tmp_path / "group"
    g.mkdir()
    (g / "zarr.json").write_bytes(mf.group_doc())
    inner = save(str(g / "ck"))
    rc, out, err = run("ls", str(g), "--json")
    assert rc == 0 and json.loads(out) == [{"url": inner, "committed": True}], (out, err)


def test_ls_long_describes_each_checkpoint_of_a_directory(tmp_path):
    ck = save(str(tmp_path / "ck"), world_size=3, layout="row")
    rc, out, err = run("ls", str(tmp_path), "-l")
    assert rc == 0, err
    assert out.split()[:2] == ["committed", ck] and "world 3, row, 2 tensors, created " in out
    rc, out, err = run("ls", str(tmp_path), "-l", "--json")
    (row,) = json.loads(out)
    assert row["world_size"] == 3 and row["layout"] == "row" and row["tensors"] == 2 and row["created"]


# -- 4: a plain zarr group is no checkpoint, whatever the command ---------------------------------------------

@pytest.mark.parametrize("cmd", [["verify"], ["export-hf", "{out}"], ["export-dcp", "{out}"],
                                 ["reshard", "{out}", "--to", "2"], ["info"]])
@pytest.mark.parametrize("doc", ["group", "array"])
def test_plain_zarr_is_not_a_ragckpt_checkpoint(tmp_path, cmd, doc):
    g = tmp_path / "plain"
    g.mkdir()
    (g / "zarr.json").write_bytes(mf.group_doc() if doc == "group" else _plain_array_doc())
    args = [c.replace("{out}", str(tmp_path / "out")) for c in cmd]
    line = one_line_error([args[0], str(g), *args[1:]], str(g), "not a ragckpt manifest")
    assert "not committed" not in line
    assert not (tmp_path / "out").exists()


def test_an_array_inside_a_checkpoint_is_not_a_checkpoint(tmp_path):
    ck = save(str(tmp_path / "ck"))
    for cmd in ("info", "verify"):
        one_line_error([cmd, f"{ck}/buffers/0"], "an array inside a ragckpt checkpoint")


# -- 5: directories where files belong ---------------------------------------------------------------------------

def _hf_model(d: Path) -> Path:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    save_file({"model.w": torch.randn(10, 7), "lm_head.weight": torch.randn(3, 4)}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "x"}))
    return d


def _dcp_dir(d: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.randn(10, 7), "lm_head.weight": torch.randn(3, 4)}, "optim": {"lr": 0.1}},
                 checkpoint_id=str(d))
    return d


def test_import_hf_names_a_directory_in_place_of_the_weights_file(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").mkdir()
    one_line_error(["import-hf", str(hf), str(tmp_path / "ck"), "-w", "2"],
                   str(hf / "model.safetensors"), "is a directory")
    assert not (tmp_path / "ck").exists()


def test_import_dcp_names_a_directory_in_place_of_a_data_file(tmp_path):
    d = _dcp_dir(tmp_path / "dcp")
    files = sorted(d.glob("*.distcp"))
    os.remove(files[0])
    files[0].mkdir()
    line = one_line_error(["import-dcp", str(d), str(tmp_path / "ck")], str(files[0]), "is a directory")
    assert "truncated" not in line


# -- 6: an empty source is refused, not taken as the current directory ----------------------------------------

@pytest.mark.parametrize("args, name", [
    (["info", ""], "URL"), (["verify", ""], "URL"), (["ls", ""], "URL"),
    (["export-hf", "", "o"], "SRC"), (["export-dcp", "", "o"], "SRC"),
    (["import-hf", "", "o", "-w", "2"], "HF_DIR"), (["import-dcp", "", "o"], "DCP_DIR"),
])
def test_empty_source_is_a_usage_error(args, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert usage_error(args).startswith(f"{name} is empty")
    assert os.listdir(tmp_path) == []


def test_empty_source_is_one_line_through_the_entry_point(tmp_path):
    save(str(tmp_path / "ck"))  # a checkpoint in the working directory must not be what "" means
    p = subprocess.run([sys.executable, "-m", "cli.main", "info", "", "--json"], cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: URL is empty"), p.stderr
    assert json.loads(p.stdout)["error"].startswith("URL is empty")


def test_empty_source_is_refused_by_the_library_too(tmp_path, monkeypatch):
    monkeypatch.chdir(save(str(tmp_path / "ck")))  # the working directory *is* a checkpoint
    with pytest.raises(ValueError, match="empty string"):
        ragckpt.open("")
    with pytest.raises(ValueError, match="empty string"):
        ragckpt.reshard.reshard("", str(tmp_path / "out"), 2)
    assert not (tmp_path / "out").exists()


# -- 7, 8, 9: error wording ------------------------------------------------------------------------------------------

def test_bad_granularity_names_the_tensor(tmp_path):
    hf = _hf_model(tmp_path / "hf")
    one_line_error(["import-hf", str(hf), str(tmp_path / "ck"), "-w", "2", "--granularity", "7"],
                   "granularity 7", "'lm_head.weight'", "(3, 4)")


@pytest.mark.parametrize("rank, world, needle", [("abc", "2", "RANK is 'abc', not an integer"),
                                                 ("0", "two", "WORLD_SIZE is 'two', not an integer"),
                                                 ("2", "2", "RANK is 2, but WORLD_SIZE is 2"),
                                                 ("0", "0", "WORLD_SIZE is 0")])
def test_bad_torchrun_environment_is_named(tmp_path, monkeypatch, rank, world, needle):
    src = save(str(tmp_path / "src"))
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    line = one_line_error(["reshard", src, str(tmp_path / "dst"), "--to", "2", "--distributed"], needle)
    assert "is not set" not in line


@pytest.mark.parametrize("addr, port, needle", [(None, "29500", "MASTER_ADDR is not set"),
                                                 ("127.0.0.1", None, "MASTER_PORT is not set"),
                                                 ("127.0.0.1", "x", "MASTER_PORT is 'x', not an integer")])
def test_missing_rendezvous_environment_is_named(tmp_path, monkeypatch, addr, port, needle):
    """RANK and WORLD_SIZE set by hand without torchrun's MASTER_ADDR/PORT: torch raised a bare ValueError."""
    src = save(str(tmp_path / "src"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    for var, value in (("MASTER_ADDR", addr), ("MASTER_PORT", port)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    one_line_error(["reshard", src, str(tmp_path / "dst"), "--to", "2", "--distributed"], needle, "torchrun")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("name", ["client_kwargs", "config_kwargs", "s3_additional_kwargs"])
def test_mapping_storage_options_given_as_a_string(name):
    line = one_line_error(["info", "s3://bkt/x", "-o", f"{name}=foo"], f"storage option '{name}' must be a mapping",
                          f"-o {name}.")
    assert "AttributeError" not in line


def test_storage_option_given_whole_and_dotted_is_a_usage_error():
    for args in (["-o", "client_kwargs=foo", "-o", "client_kwargs.endpoint_url=x"],
                 ["-o", "client_kwargs.endpoint_url=x", "-o", "client_kwargs=foo"]):
        assert "conflicts with" in usage_error(["info", "s3://bkt/x", *args])


# -- 10: the verify progress bar ends where it says -------------------------------------------------------------------

def test_verify_progress_total_counts_the_bytes_it_reads(tmp_path, monkeypatch):
    import cli.commands.inspect as inspect_cmd
    from cli.common import ProgressBar

    ck = save(str(tmp_path / "ck"), world_size=4, layout="row")  # row shards: edge padding in the chunks
    c = ragckpt.open(ck)
    assert c.verify_bytes() > c.layout.total_bytes()
    seen: dict[str, int] = {"total": -1, "done": 0}

    @contextmanager
    def fake_bar(total, description, enabled=True):
        seen["total"] = total
        yield ProgressBar(type("P", (), {"advance": lambda self, task, n: seen.__setitem__("done", seen["done"] + n)})(),
                          0)

    monkeypatch.setattr(inspect_cmd, "progress_bar", fake_bar)
    rc, out, err = run("verify", ck)
    assert rc == 0, err
    assert seen["total"] == seen["done"] == c.verify_bytes()


def test_verify_progress_reaches_the_total_when_objects_are_bad(tmp_path):
    ck = save(str(tmp_path / "ck"), world_size=4, layout="row")
    chunk = next(p for p in sorted((Path(ck) / "buffers").rglob("c.*")))
    chunk.write_bytes(b"\x00" * 3)  # truncated
    c = ragckpt.open(ck)
    done = []
    rep = c.verify(progress=done.append)
    assert not rep.ok and sum(done) == c.verify_bytes()


# -- 11, 12: advice and polish ---------------------------------------------------------------------------------------

def test_export_dcp_to_a_url_advises_exporting_locally_then_uploading(tmp_path):
    ck = save(str(tmp_path / "ck"))
    line = one_line_error(["export-dcp", ck, "s3://bkt/x"], "s3://bkt/x", "export to a local directory")
    assert "copy it to a local" not in line


def test_import_dcp_from_a_url_names_what_is_missing(tmp_path):
    # URLs are read through the stores now (tests/convert/test_dcp_s3.py): no advice to copy, the object named
    line = one_line_error(["import-dcp", "memory://bkt/x", str(tmp_path / "ck")], "memory://bkt/x/.metadata")
    assert "copy it to a local" not in line and not (tmp_path / "ck").exists()


def test_importers_print_the_normalized_destination(tmp_path, monkeypatch):
    hf = _hf_model(tmp_path / "hf")
    d = _dcp_dir(tmp_path / "dcp")
    monkeypatch.chdir(tmp_path)
    rc, out, err = run("import-hf", str(hf), "ck_hf", "-w", "2", "--json")
    assert rc == 0 and json.loads(out)["dst"] == str(tmp_path / "ck_hf"), (out, err)
    rc, out, err = run("import-hf", str(hf), "ck_hf2", "-w", "2")
    assert rc == 0 and f"into {tmp_path / 'ck_hf2'} for" in out, (out, err)
    rc, out, err = run("import-dcp", str(d), "ck_dcp", "--json")
    assert rc == 0 and json.loads(out)["destination"] == str(tmp_path / "ck_dcp"), (out, err)
    rc, out, err = run("import-dcp", str(d), "file://" + str(tmp_path / "ck_dcp2"))
    assert rc == 0 and f"into {tmp_path / 'ck_dcp2'} for" in out, (out, err)


def test_export_dcp_permission_error_names_the_destination(shared_dir):
    ck = save(str(shared_dir / "ck"))
    ro = shared_dir / "rodir"
    ro.mkdir()
    with mode(ro, 0o555):
        rc, out, err = as_unprivileged("export-dcp", ck, str(ro / "d"))
    line = assert_one_line(rc, err, f"{ro / 'd'}:", "permission denied")
    assert ".tmp-" not in line
    assert os.listdir(ro) == []


def test_import_dcp_model_prefix_matching_nothing_is_refused(tmp_path):
    d = _dcp_dir(tmp_path / "dcp")
    one_line_error(["import-dcp", str(d), str(tmp_path / "ck"), "--model-prefix", "zzz."],
                   "model prefix 'zzz.' matches none", str(d))
    assert not (tmp_path / "ck").exists()
    rc, out, err = run("import-dcp", str(d), str(tmp_path / "ck2"), "--model-prefix", "model.", "--json")
    assert rc == 0, err


def test_export_hf_says_it_kept_an_existing_config(tmp_path):
    hf = _hf_model(tmp_path / "hf")
    ck = str(tmp_path / "ck")
    assert run("import-hf", str(hf), ck, "-w", "2")[0] == 0
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "config.json").write_text('{"mine": 1}')
    rc, out, err = run("export-hf", ck, str(out_dir))
    assert rc == 0, err
    assert f"note: kept the config.json already in {out_dir}" in out
    assert json.loads((out_dir / "config.json").read_text()) == {"mine": 1}


def test_ls_of_an_empty_bucket_is_empty_like_an_empty_directory(s3, tmp_path):
    bucket = f"s3://{s3.bucket}"
    rc, out, err = run("ls", bucket, *s3.cli_args(), "--json")
    assert rc == 0 and json.loads(out) == [], (out, err)
    rc, out, err = run("ls", bucket, *s3.cli_args())
    assert rc == 0 and out == "", (out, err)
    (tmp_path / "empty").mkdir()
    assert run("ls", str(tmp_path / "empty"))[:2] == (0, "")
    # a prefix holding nothing may be a typo: still an error, as a missing local directory is
    one_line_error(["ls", f"{bucket}/nope", *s3.cli_args()], "no such directory or prefix")


def test_ls_on_s3_skips_plain_zarr_and_flags_damaged(s3):
    url, opts = s3
    ragckpt.write_global({"w": torch.randn(4, 3)}, f"{url}/good", 2, storage_options=opts)
    ragckpt.write_global({"w": torch.randn(4, 3)}, f"{url}/garbage", 2, storage_options=opts)
    fs = s3.fs()
    root = url.split("://", 1)[1]
    fs.pipe(f"{root}/garbage/zarr.json", b"garbage{")
    fs.pipe(f"{root}/plain/zarr.json", mf.group_doc())
    rc, out, err = run("ls", url, *s3.cli_args(), "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert [r["url"] for r in rows] == [f"{url}/garbage", f"{url}/good"]
    assert rows[0]["committed"] is False and "not valid JSON" in rows[0]["damaged"]
    assert rows[1] == {"url": f"{url}/good", "committed": True}


def test_ls_of_a_checkpoint_with_a_damaged_root_document_is_an_error(tmp_path):
    # not a plain zarr group to list the contents of: ragckpt's own objects are beside it
    ck = save(str(tmp_path / "ck"))
    os.remove(Path(ck) / mf.COMMIT_KEY)
    (Path(ck) / "zarr.json").write_text("null")
    one_line_error(["ls", ck], f"{ck}/zarr.json")


def test_the_torchrun_module_is_the_command(monkeypatch, capsys):
    """`python -m cli.distributed` takes `ragckpt reshard --distributed`'s options: its
    --help has the examples, a usage error is one line (argparse printed a usage block), and a window
    too small for one process does not tell it to use fewer workers it does not have."""
    import cli.distributed as D

    with pytest.raises(SystemExit) as done:
        D.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "Examples:" in out and "torchrun" in out and "--window" in out, out
    with pytest.raises(SystemExit) as done:
        D.main(["s", "d"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "Missing option '--to'" in err, err
    from ragckpt.reshard.offline import sizing

    with pytest.raises(ragckpt.errors.LayoutError, match=r"use at least 5 MiB \(--window\)$"):
        sizing(1 << 20, 1, None, 1 << 20)
    with pytest.raises(ragckpt.errors.LayoutError, match=r"\(--window\) or fewer workers \(--workers\)$"):
        sizing(4 << 20, 3, None, 1 << 20)


def test_workers_with_distributed_is_refused_not_ignored(tmp_path):
    src = save(str(tmp_path / "src"))
    msg = usage_error(["reshard", src, str(tmp_path / "dst"), "--to", "2", "--distributed", "--workers", "2"])
    assert "--workers does not apply with --distributed" in msg and "--nproc-per-node" in msg
    assert not (tmp_path / "dst").exists()


def test_the_torchrun_module_prints_the_same_notes_as_the_command(monkeypatch, capsys):
    """`python -m cli.distributed` is documented as equivalent to `ragckpt reshard
    --distributed`: its summary carries the same notes (extras left behind, a leftover set-aside)."""
    import cli.distributed
    import ragckpt.reshard.distributed as D
    from ragckpt.reshard.offline import ReshardStats

    stats = ReshardStats("s", "d", 4, 2, "ragged", "ragged", 3, 10, 10, 10, 1, 1, 1.0, 1e-8, 0, 0, 2, 1, 1, 1,
                         extras_dropped=4, extra={"leftover_set_asides": ["/x/d.replaced-0123456789ab"]})
    monkeypatch.setattr(D, "run", lambda *a, **k: stats)
    with pytest.raises(SystemExit) as done:
        cli.distributed.main(["s", "d", "--to", "2"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2:] == stats.notes() and len(stats.notes()) == 2
    # the command's own summary: throughput scaled to the job (1e-8 GB/s is 10 B/s), not "0.00 GB/s"
    assert "(0.0 kB/s) with 2 process(es)" in out and "GB/s" not in out, out
    assert "extras (RNG state, ...) of 4 source rank(s) were not carried over" in out
    assert "/x/d.replaced-0123456789ab holds what an earlier --overwrite" in out
