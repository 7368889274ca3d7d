"""An `--overwrite` killed outright (SIGKILL) at every step of its set-aside protocol, then
finished or undone by `ragckpt recover DST` or by the next run into DST: DST always ends up holding
the old checkpoint (killed before the new one committed) or the new one (killed after), committed,
verified and bit-exact, with no `DST.replaced-*` copy and no lock file left, and no message on the
way advises a step that loses data. The steps are enumerated from the trace of an uninterrupted
run (`RAGCKPT_TEST_KILL_TRACE`) and each is killed in turn (`RAGCKPT_TEST_KILL_AT`), so no kill
point depends on timing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ragckpt
from ragckpt.storage.destination import ASIDE_INFIX, KILL_ENV, MARKER_KEY, TRACE_ENV, describe_set_aside
from ragckpt.storage.lock import LOCK_SUFFIX

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
ENV.pop(KILL_ENV, None)
ENV.pop(TRACE_ENV, None)
#: advice that would lose data if followed after an interrupted overwrite
BAD_ADVICE = ("move it back or delete it", "delete it", "rm -r")


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from cli.main import main; main()", *args], cwd=ROOT,
                          env=dict(ENV, **(env or {})), capture_output=True, text=True, timeout=120)


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 16, generator=g), "b": torch.randint(-9, 9, (5,), generator=g, dtype=torch.int32),
            "h": torch.randn(3, 4, generator=g).to(torch.bfloat16)}


OLD, NEW = state(1), state(2)


def holds(url: str, expect: dict[str, torch.Tensor]) -> None:
    """`url` is committed, verifies, and holds exactly `expect`, bit for bit."""
    ck = ragckpt.open(url)
    rep = ck.verify()
    assert rep.ok, rep.problems
    assert sorted(ck.names()) == sorted(expect)
    for k, v in expect.items():
        got = ck.read(k)
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert torch.equal(got.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def no_leftovers(dst: Path) -> None:
    assert not list(dst.parent.glob(dst.name + ASIDE_INFIX + "*"))
    assert not (dst.parent / (dst.name + LOCK_SUFFIX)).exists()


def no_bad_advice(*texts: str) -> None:
    for t in texts:
        for bad in BAD_ADVICE:
            assert bad not in t, t


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """SRC (the new contents, 3 ranks), a template of DST holding the old checkpoint (2 ranks), and
    the numbered steps of an uninterrupted `reshard SRC DST --to 2 --overwrite`."""
    base = tmp_path_factory.mktemp("ow")
    ragckpt.write_global(NEW, str(base / "src"), world_size=3)
    ragckpt.write_global(OLD, str(base / "template"), world_size=2)
    dst = base / "probe" / "dst"
    shutil.copytree(base / "template", dst)
    trace = base / "trace"
    r = cli("reshard", str(base / "src"), str(dst), "--to", "2", "--overwrite", "--no-progress",
            env={TRACE_ENV: str(trace)})
    assert r.returncode == 0, r.stderr
    steps = [line.split(" ", 1) for line in trace.read_text().splitlines()]
    return {"base": base, "steps": [(int(n), what) for n, what in steps]}


def fresh_dst(world: dict, name: str) -> Path:
    dst = world["base"] / name / "dst"
    shutil.copytree(world["base"] / "template", dst)
    return dst


def kill_overwrite(world: dict, dst: Path, at: int) -> subprocess.CompletedProcess:
    r = cli("reshard", str(world["base"] / "src"), str(dst), "--to", "2", "--overwrite", "--no-progress",
            env={KILL_ENV: str(at)})
    assert r.returncode == -signal.SIGKILL, (at, r.returncode, r.stderr)
    return r


def expected_after(world: dict, at: int) -> dict[str, torch.Tensor]:
    """Killed before the step after the commit: the old checkpoint; from there on: the new one."""
    committed_at = next(n for n, what in world["steps"] if what == "job: committed")
    return NEW if at >= committed_at else OLD


def test_trace_covers_every_phase(world: dict) -> None:
    names = [what for _, what in world["steps"]]
    for phase in ("set aside: rename DST", "set aside: make the new DST", "set aside: mark the copy",
                  "reshard: DST prepared", "job: committed", "discard: mark the copy", "discard: delete the copy"):
        assert phase in names, names
    assert names.count("discard: delete the copy") >= 3  # the commit marker, the rest, the copy's own marker


def kill_points(steps: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Every step, except that of a run of steps with one name (one unlink per file of a copy being
    deleted) only the first two and the last are taken: the commit marker, the next file, the
    copy's own marker."""
    out = []
    for n, what in steps:
        same = [m for m, w in steps if w == what]
        if n in same[:2] or n == same[-1]:
            out.append((n, what))
    return out


@pytest.mark.slow
def test_every_kill_point_then_recover(world: dict) -> None:
    """Kill at each step; `ls` is truthful and advises `recover`; `recover --json` finishes or undoes."""
    for at, what in kill_points(world["steps"]):
        dst = fresh_dst(world, f"k{at}")
        kill_overwrite(world, dst, at)
        asides = list(dst.parent.glob(dst.name + ASIDE_INFIX + "*"))
        listing = cli("ls", str(dst.parent))
        no_bad_advice(listing.stdout, listing.stderr)
        if asides:
            assert f"ragckpt recover {dst}" in listing.stdout, (what, listing.stdout)
        for a in asides:
            note = describe_set_aside(str(a))
            assert note is not None and f"ragckpt recover {dst}" in note, (what, note)
            assert "running" not in note  # the killed job holds no lock
            no_bad_advice(note)
        r = cli("recover", str(dst), "--json")
        assert r.returncode == 0, (what, r.stderr)
        doc = json.loads(r.stdout)
        assert len(doc["recovered"]) == len(asides), (what, doc)
        expect = expected_after(world, at)
        for item in doc["recovered"]:
            assert item["action"] == ("restored" if expect is OLD else "deleted"), (what, item)
            no_bad_advice(item["reason"])
        holds(str(dst), expect)
        no_leftovers(dst)
        shutil.rmtree(dst.parent)


@pytest.mark.slow
def test_recovery_itself_killed_at_every_step(world: dict) -> None:
    """A kill before the commit leaves the old checkpoint set aside; `recover` killed at each of its
    own steps, then run again, still brings it back whole."""
    at = next(n for n, what in world["steps"] if what == "reshard: DST prepared")  # DST's metadata written
    probe = fresh_dst(world, "rprobe")
    kill_overwrite(world, probe, at)
    trace = world["base"] / "rtrace"
    assert cli("recover", str(probe), env={TRACE_ENV: str(trace)}).returncode == 0
    rsteps = [int(line.split(" ", 1)[0]) for line in trace.read_text().splitlines()]
    assert len(rsteps) >= 3
    for m in rsteps:
        dst = fresh_dst(world, f"r{m}")
        kill_overwrite(world, dst, at)
        assert cli("recover", str(dst), env={KILL_ENV: str(m)}).returncode == -signal.SIGKILL
        r = cli("recover", str(dst))
        assert r.returncode == 0, r.stderr
        no_bad_advice(r.stdout)
        holds(str(dst), OLD)
        no_leftovers(dst)
        shutil.rmtree(dst.parent)


def test_next_run_recovers_first(world: dict) -> None:
    """No `recover`: the next reshard into DST finishes the killed overwrite itself. Without
    --overwrite it then finds the old checkpoint back and refuses; with it, it replaces it."""
    steps = dict((what, n) for n, what in reversed(world["steps"]))
    dst = fresh_dst(world, "next")
    kill_overwrite(world, dst, steps["reshard: DST prepared"])
    r = cli("reshard", str(world["base"] / "src"), str(dst), "--to", "2", "--no-progress")
    assert r.returncode == 2 and "already holds a committed checkpoint" in r.stderr, r.stderr
    holds(str(dst), OLD)
    no_leftovers(dst)
    kill_overwrite(world, dst, steps["discard: mark the copy"] + 2)  # the copy's commit marker just went
    r = cli("reshard", str(world["base"] / "src"), str(dst), "--to", "2", "--overwrite", "--no-progress")
    assert r.returncode == 0, r.stderr
    no_bad_advice(r.stdout, r.stderr)
    holds(str(dst), NEW)
    no_leftovers(dst)


def test_import_recovers_first(world: dict, tmp_path: Path) -> None:
    """write_global (the importers' writer) into a DST left mid-overwrite finishes it first too."""
    steps = dict((what, n) for n, what in reversed(world["steps"]))
    dst = fresh_dst(world, "imp")
    kill_overwrite(world, dst, steps["set aside: mark the copy"])  # renamed, not yet marked
    assert not (dst / "zarr.json").exists()
    with pytest.raises(ragckpt.RagckptError, match="already holds a committed checkpoint"):
        ragckpt.write_global(NEW, str(dst), world_size=2)
    holds(str(dst), OLD)
    no_leftovers(dst)


def test_unmarked_copy_beside_committed_dst_is_discarded(world: dict) -> None:
    """The remainder an older ragckpt left while deleting its set-aside copy (a commit marker, no
    zarr.json, no marker of ours): listed with the advice to recover, and recover deletes it."""
    dst = fresh_dst(world, "old-style")
    aside = Path(str(dst) + ASIDE_INFIX + "0123456789ab")
    shutil.copytree(dst, aside)
    (aside / "zarr.json").unlink()
    assert not (aside / MARKER_KEY).exists()
    note = describe_set_aside(str(aside))
    assert note is not None and "deletes it" in note and f"ragckpt recover {dst}" in note, note
    r = cli("recover", str(dst), "--json")
    assert r.returncode == 0, r.stderr
    assert [i["action"] for i in json.loads(r.stdout)["recovered"]] == ["deleted"]
    holds(str(dst), OLD)
    no_leftovers(dst)


def test_two_copies_to_move_back_are_both_kept(world: dict) -> None:
    """Two whole set-aside copies beside an uncommitted DST: nothing says which is newer, so both
    stay, and the reason says so without advising to delete either."""
    dst = fresh_dst(world, "two")
    for tag in ("aaaaaaaaaaaa", "bbbbbbbbbbbb"):
        shutil.copytree(dst, Path(str(dst) + ASIDE_INFIX + tag))
    shutil.rmtree(dst)
    dst.mkdir()
    r = cli("recover", str(dst), "--json")
    assert r.returncode == 0, r.stderr
    items = json.loads(r.stdout)["recovered"]
    assert [i["action"] for i in items] == ["kept", "kept"]
    no_bad_advice(*(i["reason"] for i in items))
    for tag in ("aaaaaaaaaaaa", "bbbbbbbbbbbb"):
        holds(str(dst) + ASIDE_INFIX + tag, OLD)


def test_recover_help_and_errors(tmp_path: Path) -> None:
    ragckpt.write_global(OLD, str(tmp_path / "ck"), world_size=1)
    r = cli("recover", str(tmp_path / "ck"))
    assert r.returncode == 0 and "no interrupted --overwrite" in r.stdout, r
    r = cli("recover", "--help")
    assert r.returncode == 0 and "ragckpt recover /ckpt/step_1000" in r.stdout
    r = cli("recover", "", "--json")
    assert r.returncode == 2 and "error" in json.loads(r.stdout)


def s3_env() -> dict:
    """The environment as it is now: the s3 fixture sets the test server's credentials."""
    return {k: v for k, v in os.environ.items() if k.startswith("AWS_")}


@pytest.mark.slow
def test_every_kill_point_of_an_s3_overwrite(world: dict, s3) -> None:
    """The same on an S3 prefix, whose set-aside is a server-side copy: each step killed, then
    `recover` leaves the old or the new checkpoint at DST, and nothing beside it."""
    opts, args = s3.storage_options, s3.cli_args()
    src = str(world["base"] / "src")
    trace = world["base"] / "s3trace"
    probe = f"{s3.url}/probe"
    ragckpt.write_global(OLD, probe, world_size=2, storage_options=opts)
    env = s3_env()
    r = cli("reshard", src, probe, "--to", "2", "--overwrite", "--no-progress", *args, env={**env, TRACE_ENV: str(trace)})
    assert r.returncode == 0, r.stderr
    steps = [(int(n), what) for n, what in (line.split(" ", 1) for line in trace.read_text().splitlines())]
    assert "set aside: empty DST" in [w for _, w in steps]
    committed_at = next(n for n, what in steps if what == "job: committed")
    fs = s3.fs()
    for at, what in kill_points(steps):
        dst = f"{s3.url}/k{at}"
        ragckpt.write_global(OLD, dst, world_size=2, storage_options=opts)
        r = cli("reshard", src, dst, "--to", "2", "--overwrite", "--no-progress", *args, env={**env, KILL_ENV: str(at)})
        assert r.returncode == -signal.SIGKILL, (what, r.stderr)
        r = cli("recover", dst, "--json", *args, env=env)
        assert r.returncode == 0, (what, r.stderr)
        for item in json.loads(r.stdout)["recovered"]:
            no_bad_advice(item["reason"])
        expect = NEW if at >= committed_at else OLD
        ck = ragckpt.open(dst, storage_options=opts)
        assert ck.verify().ok
        for k, v in expect.items():
            assert torch.equal(ck.read(k).reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), (what, k)
        fs.invalidate_cache()
        beside = [p.rsplit("/", 1)[-1] for p in fs.ls(s3.url.split("://", 1)[1], detail=False)]
        assert not [b for b in beside if b.startswith(f"k{at}.")], (what, beside)


def test_s3_copy_cut_short_beside_an_untouched_dst_is_deleted(s3) -> None:
    """Killed in the middle of the server-side copy: the unmarked, uncommitted copy is garbage
    (DST was not touched yet), and recover deletes it rather than copy it over DST."""
    opts = s3.storage_options
    dst = f"{s3.url}/dst"
    ragckpt.write_global(OLD, dst, world_size=2, storage_options=opts)
    ragckpt.write_global(NEW, dst + ASIDE_INFIX + "0123456789ab", world_size=2, storage_options=opts)
    fs = s3.fs()
    base = dst.split("://", 1)[1] + ASIDE_INFIX + "0123456789ab"
    fs.rm(f"{base}/COMMITTED")
    fs.rm(f"{base}/zarr.json")
    assert "deletes it" in (describe_set_aside(dst + ASIDE_INFIX + "0123456789ab", opts) or "")
    from ragckpt.storage.destination import recover

    assert [i["action"] for i in recover(dst, opts)] == ["deleted"]
    holds_s3 = ragckpt.open(dst, storage_options=opts)
    assert holds_s3.verify().ok and torch.equal(holds_s3.read("w"), OLD["w"])
    fs.invalidate_cache()
    assert not fs.exists(base)


def test_a_running_overwrites_copy_is_left_to_it(world: dict) -> None:
    """While an overwrite runs, its set-aside copy is its own: `recover` refuses (one line, exit 2),
    `ls` says a running job holds it, and the job then finishes as if nobody had asked."""
    from ragckpt.reshard.share import DELAY_ENV

    dst = fresh_dst(world, "live")
    p = subprocess.Popen([sys.executable, "-c", "from cli.main import main; main()", "reshard",
                          str(world["base"] / "src"), str(dst), "--to", "2", "--overwrite", "--threads", "1",
                          "--no-progress"], cwd=ROOT, env=dict(ENV, **{DELAY_ENV: "0.5"}),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not list(dst.parent.glob(dst.name + ASIDE_INFIX + "*")) and time.time() < deadline:
            time.sleep(0.02)
        assert p.poll() is None
        r = cli("recover", str(dst))
        assert r.returncode == 2 and r.stderr.startswith(f"error: another job is writing {dst} (pid {p.pid} "), r
        (aside,) = dst.parent.glob(dst.name + ASIDE_INFIX + "*")
        assert "running --overwrite" in (describe_set_aside(str(aside)) or "")
    finally:
        out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    holds(str(dst), NEW)
    no_leftovers(dst)
