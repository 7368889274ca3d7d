"""Bad input at the command line: one line on stderr, a non-zero exit, JSON when --json asked for it,
and nothing lost. Usage errors and broken pipes are run through the real entry point (a subprocess),
since click's test runner bypasses `cli.main.main`."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ragckpt
from ragckpt.errors import DestinationError, DestinationExistsError
from tests.cli_helpers import run

ROOT = Path(__file__).resolve().parents[2]


def one_line_error(args: list[str], *needles: str) -> str:
    code, out, err = run(*args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, out, err)
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def entry_point(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cli.main", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture()
def ck(tmp_path: Path) -> str:
    url = str(tmp_path / "ck")
    ragckpt.write_global({"w": torch.randn(10, 7), "b": torch.arange(5, dtype=torch.int32)}, url, 4, "row")
    return url


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# -- usage errors, JSON errors, pipes ----------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["reshard", "a", "b"], "Missing option '--to'"),
    (["reshard", "a", "b", "--to", "0"], "'--to'"),
    (["reshard", "a", "b", "--to", "1000000000"], "1<=x<=1048576"),
    (["nope"], "No such command 'nope'"),
    (["info", "x", "-o", "=v"], "empty key"),
])
def test_usage_errors_are_one_line(args, needle):
    p = entry_point(*args)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith("error: ") and needle in lines[0] and "--help" in lines[0], lines[0]


def test_help_and_version_still_exit_zero():
    assert entry_point("--version").returncode == 0
    p = entry_point("reshard", "--help")
    assert p.returncode == 0 and "Examples:" in p.stdout


def test_json_errors_are_json_on_stdout(tmp_path):
    code, out, err = run("info", str(tmp_path / "missing"), "--json")
    assert code == 2 and err.startswith("error: no ragckpt checkpoint")
    assert json.loads(out) == {"error": err.strip()[len("error: "):]}


def test_broken_pipe_is_quiet(tmp_path):
    url = str(tmp_path / "many")
    ragckpt.write_global({f"layer.{i}.some_long_parameter_name.weight": torch.zeros(2) for i in range(3000)}, url, 2)
    cmd = f"{sys.executable} -m cli.main ls {url} | head -1"
    p = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.stdout.count("\n") == 1 and p.stderr == "", p.stderr
    assert p.returncode == 141
    # --json: one large document, once written at a stroke; the reader's going away cut it short and
    # the command still exited 0, as if a script had received it whole
    for _ in range(3):
        p = subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -m cli.main ls {url} --json | head -c 10"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert (p.returncode, p.stdout, p.stderr) == (141, "[\n  {\n    ", ""), (p.returncode, p.stderr)
    whole = subprocess.run([sys.executable, "-m", "cli.main", "ls", url, "--json"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert whole.returncode == 0 and len(json.loads(whole.stdout)) == 3000 and len(whole.stdout) > 256 << 10


@pytest.mark.parametrize("args", ["--help", "reshard --help", "diff -h", ""])
def test_help_into_a_closed_pipe_exits_141_quietly(args):
    """click ends a write to a closed pipe with exit status 1; the README promises 141, as for ls."""
    cmd = f"{sys.executable} -m cli.main {args} | (exec 0<&-)"
    p = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 141 and p.stderr == "", (p.returncode, p.stderr)


def test_a_usage_error_with_json_into_a_closed_pipe_exits_141_quietly():
    """The JSON document of a usage error met a closed pipe with a raw BrokenPipeError traceback."""
    cmd = f"{sys.executable} -m cli.main info --bogus --json | (exec 0<&-)"
    p = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 141 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    assert p.stderr.strip().splitlines() == ["error: No such option '--bogus'. (see 'ragckpt info --help')"]


# -- ls -------------------------------------------------------------------------------------------------

def test_ls_of_a_missing_path_or_a_file_is_an_error(tmp_path):
    one_line_error(["ls", str(tmp_path / "nope")], "no such directory or prefix")
    (tmp_path / "f").write_bytes(b"x")
    one_line_error(["ls", str(tmp_path / "f")], "is a file")
    (tmp_path / "empty").mkdir()
    code, out, err = run("ls", str(tmp_path / "empty"), "--json")
    assert code == 0 and json.loads(out) == []


def test_ls_of_a_missing_bucket_says_so(s3):
    url, _ = s3
    bad = url.split("/")[2] + "-absent"
    one_line_error(["ls", f"s3://{bad}/run", *s3.cli_args()], f"bucket '{bad}' does not exist")
    one_line_error(["info", f"s3://{bad}/run/ck", *s3.cli_args()], f"bucket '{bad}' does not exist")


# -- destinations -------------------------------------------------------------------------------------------

def test_a_checkpoint_never_lands_in_an_occupied_directory(tmp_path):
    state = {"w": torch.arange(12.0)}
    d = tmp_path / "occupied"
    d.mkdir()
    (d / "notes.txt").write_text("keep me")
    with pytest.raises(DestinationExistsError, match="exists and is not empty"):
        ragckpt.write_global(state, str(d), 2)
    assert _tree(d) == {"notes.txt": b"keep me"}
    with pytest.raises(DestinationError, match="empty string"):
        ragckpt.write_global(state, "", 2)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(DestinationError, match="not a directory"):
        ragckpt.write_global(state, str(tmp_path / "file"), 2, overwrite=True)
    # overwrite replaces the contents, and keeps the directory itself (owner, mode, mount)
    d.chmod(0o750)
    ragckpt.write_global(state, str(d), 2, overwrite=True)
    assert not (d / "notes.txt").exists() and stat.S_IMODE(d.stat().st_mode) == 0o750
    assert torch.equal(ragckpt.open(str(d)).read("w"), state["w"])


def test_reshard_into_an_existing_empty_directory_keeps_it(ck, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    dst.chmod(0o705)
    ino = dst.stat().st_ino
    code, _, err = run("reshard", ck, str(dst), "--to", "3")
    assert code == 0, err
    assert dst.stat().st_ino == ino and stat.S_IMODE(dst.stat().st_mode) == 0o705
    assert ragckpt.open(str(dst)).world_size == 3


def test_reshard_refuses_an_empty_destination_string(ck, tmp_path, monkeypatch):
    work = tmp_path / "cwd"
    work.mkdir()
    (work / "notes.txt").write_text("keep me")
    monkeypatch.chdir(work)
    one_line_error(["reshard", ck, "", "--to", "2", "--overwrite"], "empty string")
    assert _tree(work) == {"notes.txt": b"keep me"}


def test_reshard_refuses_absurd_alignment_and_stray_granularity(ck, tmp_path):
    dst = tmp_path / "dst"
    one_line_error(["reshard", ck, str(dst), "--to", "3", "--align", "1000000000000", "--layout", "ragged"],
                   "--align 1000000000000 would pad", "smaller alignment")
    one_line_error(["reshard", ck, str(dst), "--to", "3", "--align", "64"], "--align applies to flat layouts")
    one_line_error(["reshard", ck, str(dst), "--to", "3", "--layout", "row", "--granularity", "whole"],
                   "--granularity applies to the ragged planner only")
    assert not dst.exists()
    code, _, err = run("reshard", ck, str(dst), "--to", "3", "--align", "64", "--layout", "element")
    assert code == 0, err  # a sane alignment works
    assert ragckpt.open(str(dst)).layout.layout_of(0).shard_size % 64 == 0


# -- damaged metadata of an uncommitted checkpoint (no checksums protect it yet) ------------------------

@pytest.mark.parametrize("doc", ["null", "[1, 2]", '{"attributes": []}', "__world_size_abc__", "__no_layouts__"])
def test_malformed_manifest_is_one_line(ck, doc):
    root = Path(ck)
    os.remove(root / "COMMITTED")
    if doc.startswith("__"):
        d = json.loads((root / "zarr.json").read_text())
        m = d["attributes"]["ragckpt"]
        if doc == "__world_size_abc__":
            m["world_size"] = "abc"
        else:
            m["layouts"] = "x"
        doc = json.dumps(d)
    (root / "zarr.json").write_text(doc)
    for cmd in ("info", "ls"):
        one_line_error([cmd, ck], "zarr.json")


def test_garbled_units_table_is_named(ck):
    root = Path(ck)
    os.remove(root / "COMMITTED")
    (root / "meta" / "units" / "0" / "c" / "0" / "0").write_bytes(b"not zstd at all")
    # uncommitted, a garbled table and one cut short by an interrupted save look the same: the save
    # is to be re-run, nothing restored
    one_line_error(["info", ck], "meta/units/0/c/0/0 does not hold a [1, 4] int64 table", "is not committed",
                   "re-run the save")


def test_a_directory_in_place_of_an_object_is_named(ck, tmp_path):
    obj = Path(ck) / "buffers" / "0" / "c.1.0"
    obj.unlink()
    obj.mkdir()
    one_line_error(["reshard", ck, str(tmp_path / "out"), "--to", "2"], "buffers/0/c.1.0")
    p = entry_point("verify", ck, "--workers", "0")
    assert p.returncode == 2 and "'--workers'" in p.stderr


@pytest.mark.parametrize("command", ["info", "verify", "diff", "reshard"])
def test_a_model_directory_is_named_with_the_way_to_import_it(tmp_path, command):
    """`ragckpt info ./my_model` on a Hugging Face or .bin directory said only "no zarr.json found"."""
    from safetensors.torch import save_file
    hf, pt = tmp_path / "hf", tmp_path / "pt"
    hf.mkdir()
    pt.mkdir()
    save_file({"w": torch.ones(3)}, str(hf / "model.safetensors"))
    torch.save({"w": torch.ones(3)}, str(pt / "pytorch_model.bin"))
    extra = {"reshard": [str(tmp_path / "out"), "--to", "2"], "diff": [str(tmp_path / "out")]}.get(command, [])
    one_line_error([command, str(hf), *extra], "Hugging Face safetensors model directory", "ragckpt import-hf")
    one_line_error([command, str(pt), *extra], "PyTorch .bin weights", "safe_serialization=True")
    assert not (tmp_path / "out").exists()
    one_line_error([command, str(hf / "model.safetensors"), *extra], "is a safetensors file", "import-hf")
    one_line_error([command, str(pt / "pytorch_model.bin"), *extra], "torch.save file", "import-hf")
    one_line_error(["import-hf", str(pt), str(tmp_path / "out"), "-w", "2"], "PyTorch .bin weights",
                   "safe_serialization=True")
    assert not (tmp_path / "out").exists()
    # any other .bin (Trainer's training_args.bin) is no model: the directory just has no safetensors
    args = tmp_path / "args"
    args.mkdir()
    torch.save({"lr": 1.0}, str(args / "training_args.bin"))
    one_line_error(["import-hf", str(args), str(tmp_path / "out"), "-w", "2"], "no safetensors files")


def test_import_granularity_only_with_a_ragged_layout(tmp_path):
    p = entry_point("import-hf", str(tmp_path / "hf"), str(tmp_path / "ck"), "-w", "2", "--layout", "row",
                    "--granularity", "whole")
    assert p.returncode == 2 and "--granularity applies to --layout ragged only" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "ck").exists()


def test_a_too_small_memory_budget_is_a_plain_one_line_error(ck, tmp_path):
    line = one_line_error(["export-hf", ck, str(tmp_path / "hf"), "--memory", "1KiB"], "memory budget")
    assert "ValueError" not in line
    # import-dcp refuses it before reading the source or touching the destination
    dcp_dir = tmp_path / "dcp"
    dcp_dir.mkdir()
    one_line_error(["import-dcp", str(dcp_dir), str(tmp_path / "rag"), "--memory", "3MiB"],
                   "memory budget (--memory / memory_bytes) of 3145728 bytes is too small; give at least 4 MiB")
    assert not (tmp_path / "rag").exists()


def test_an_unreachable_server_is_not_reported_as_a_missing_checkpoint():
    import socket

    with socket.socket() as s:  # a port on 127.0.0.1 that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    one_line_error(["info", f"http://127.0.0.1:{port}/ck"], f"cannot reach http://127.0.0.1:{port}/ck")
    one_line_error(["info", "memory://absent/ck"], "no ragckpt checkpoint at memory://absent/ck")


def test_an_unexpected_exception_is_one_line_unless_debugging(ck, monkeypatch):
    import ragckpt.checkpoint.reader as reader

    def boom(self, *a, **k):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(reader.Checkpoint, "verify", boom)
    code, out, err = run("verify", ck)
    assert code == 3 and err.strip().splitlines() == [
        "error: internal error (RuntimeError: simulated bug); please report it, with the traceback that "
        "RAGCKPT_DEBUG=1 prints"]
    monkeypatch.setenv("RAGCKPT_DEBUG", "1")  # the traceback too, and still status 3 (1 means "found problems")
    code, out, err = run("verify", ck)
    assert code == 3 and "Traceback (most recent call last)" in err and 'raise RuntimeError("simulated bug")' in err
    assert err.strip().splitlines()[-1].startswith("error: internal error (RuntimeError: simulated bug)"), err


def test_usage_errors_with_json_print_json():
    p = entry_point("reshard", "a", "b", "--to", "0", "--json")
    assert p.returncode == 2 and json.loads(p.stdout)["error"].startswith("Invalid value for '--to'")


def test_storage_option_values_are_typed():
    from cli.common import parse_storage_options

    assert parse_storage_options(("config_kwargs.connect_timeout=0.5", "a=12", "b=x.5", "c=1.2.3", "e=true")) == {
        "config_kwargs": {"connect_timeout": 0.5}, "a": 12, "b": "x.5", "c": "1.2.3", "e": True}


# -- -o with local paths ----------------------------------------------------------------------------------

def test_storage_options_for_local_paths_get_a_note(ck, tmp_path):
    """An endpoint given for a path that lacks its s3:// scheme was dropped without a word."""
    code, out, err = run("info", ck, "-o", "client_kwargs.endpoint_url=http://127.0.0.1:1", "-o", "anon=true",
                         "--json")
    assert code == 0 and json.loads(out)["world_size"] == 4, (code, out, err)
    assert err.strip() == ("note: -o anon, client_kwargs applies to s3:// and other remote URLs only; every path "
                           "here is local, so it has no effect"), err
    # ragckpt's own settings do apply to local paths; a remote URL among the arguments uses the rest
    assert run("info", ck, "-o", "ragckpt.concurrency=4")[2] == ""
    code, out, err = run("diff", ck, "memory://nothing", "-o", "anon=true")
    assert code == 2 and "note: -o" not in err and "no ragckpt checkpoint at memory://nothing" in err, err
    assert run("info", ck)[2] == ""


def test_a_path_with_a_newline_still_gives_one_error_line(tmp_path):
    """`ragckpt info $'x\\ny'` printed its error over two lines; control characters are escaped on
    the terminal and kept as they are in the --json document (JSON escapes them itself)."""
    odd = str(tmp_path / "x\ny")
    code, out, err = run("info", odd)
    assert code == 2 and err.count("\n") == 1 and "x\\ny (no zarr.json found)" in err, err
    code, out, err = run("info", odd, "--json")
    assert code == 2 and err.count("\n") == 1 and f"no ragckpt checkpoint at {odd} " in json.loads(out)["error"]
    ragckpt.write_global({"w": torch.ones(2)}, odd, 1)
    code, out, _ = run("ls", str(tmp_path))
    assert code == 0 and out.count("\n") == 1 and "x\\ny" in out, out
