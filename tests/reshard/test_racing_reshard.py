"""Two identical `ragckpt reshard SRC DST --to N` into one DST at once: exactly one wins (DST
committed, verified, bit-exact with SRC), the other stops with one line saying another job is
writing DST. A run killed outright leaves a lock (file or lease) that the next run takes over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ragckpt
from ragckpt.reshard.share import DELAY_ENV
from ragckpt.storage.lock import LOCK_SUFFIX

ROOT = Path(__file__).resolve().parents[2]
#: each destination chunk takes this long, so a run lasts a few seconds and the two overlap
SLOW = {DELAY_ENV: "0.3"}


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"l{i}.w": torch.randn(64, 256, generator=g) for i in range(3)} | {
        "emb": torch.randint(-2**15, 2**15, (96, 128), dtype=torch.int16, generator=g).view(torch.bfloat16)}


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    # the environment as it is now: the s3 fixture sets the test server's credentials
    base = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", "from cli.main import main; main()", *args], cwd=ROOT,
                            env=dict(base, **(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen) -> tuple[int, str]:
    _, err = p.communicate(timeout=120)
    return p.returncode, err


def holds_source(dst: str, src: str, storage_options: dict | None = None) -> None:
    """DST is committed, verifies, and every tensor is SRC's, bit for bit (read through each)."""
    a, b = ragckpt.open(src), ragckpt.open(dst, storage_options=storage_options)
    assert b.verify().ok
    assert sorted(a.names()) == sorted(b.names())
    for n in a.names():
        x, y = a.read(n), b.read(n)
        assert x.dtype == y.dtype and x.shape == y.shape, n
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), n


def one_winner(results: list[tuple[int, str]], dst: str) -> None:
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    err = next(e for code, e in results if code == 2)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: another job is writing "), err
    assert dst.rstrip("/") in lines[0] and "pid " in lines[0]
    assert "Directory not empty" not in err and "Traceback" not in err


@pytest.fixture
def src(tmp_path: Path) -> str:
    url = str(tmp_path / "src")
    ragckpt.write_global(state(), url, world_size=3)
    return url


@pytest.mark.parametrize("workers", [None, "2"])
def test_two_identical_reshards_started_at_once(src: str, tmp_path: Path, workers: str | None) -> None:
    dst = str(tmp_path / "dst")
    extra = ["--workers", workers] if workers else []
    procs = [start("reshard", src, dst, "--to", "4", "--threads", "1", "--no-progress", *extra, env=SLOW) for _ in range(2)]
    one_winner([finish(p) for p in procs], dst)
    holds_source(dst, src)
    assert not os.path.exists(dst + LOCK_SUFFIX)


def test_a_second_reshard_started_mid_run_does_not_take_the_first_ones_output(src: str, tmp_path: Path) -> None:
    """The second starts once the first has written DST's metadata (what it used to take for the
    remainder of an interrupted run of the same command, and delete)."""
    dst = tmp_path / "dst"
    first = start("reshard", src, str(dst), "--to", "4", "--threads", "1", "--no-progress", env=SLOW)
    deadline = time.time() + 60
    while not (dst / "zarr.json").exists() and time.time() < deadline:
        time.sleep(0.02)
    assert first.poll() is None, "the first run ended before the second could start"
    second = start("reshard", src, str(dst), "--to", "4", "--threads", "1", "--no-progress")
    one_winner([finish(first), finish(second)], str(dst))
    holds_source(str(dst), src)


def test_a_killed_runs_lock_is_taken_over(src: str, tmp_path: Path) -> None:
    """SIGKILL mid-run leaves the lock file and an uncommitted DST: the same command then takes
    both over and commits (the kernel dropped the dead job's flock)."""
    dst = tmp_path / "dst"
    p = start("reshard", src, str(dst), "--to", "4", "--threads", "1", "--no-progress", env=SLOW)
    deadline = time.time() + 60
    while not (dst / "zarr.json").exists() and time.time() < deadline:
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    assert os.path.exists(str(dst) + LOCK_SUFFIX) and not (dst / "COMMITTED").exists()
    code, err = finish(start("reshard", src, str(dst), "--to", "4", "--threads", "1", "--no-progress"))
    assert code == 0, err
    holds_source(str(dst), src)
    assert not os.path.exists(str(dst) + LOCK_SUFFIX)


def test_two_identical_reshards_into_s3_at_once(src: str, s3) -> None:
    dst = f"{s3.url}/dst"
    procs = [start("reshard", src, dst, "--to", "4", "--threads", "1", "--no-progress", *s3.cli_args(), env=SLOW)
             for _ in range(2)]
    one_winner([finish(p) for p in procs], dst)
    holds_source(dst, src, s3.storage_options)
    fs = s3.fs()
    fs.invalidate_cache()
    assert not fs.exists(f"{dst.split('://', 1)[1]}{LOCK_SUFFIX}/lease.json")


@pytest.mark.slow
def test_a_killed_runs_s3_lease_is_taken_over(src: str, s3) -> None:
    """A lease whose holder ran on this machine and is gone is taken over at once; one from
    another machine, which cannot be told from a live job, keeps DST busy until it expires."""
    dst = f"{s3.url}/dst"
    args = ("reshard", src, dst, "--to", "4", "--threads", "1", "--no-progress", *s3.cli_args())
    p = start(*args, env=SLOW)
    fs = s3.fs()
    lease = f"{dst.split('://', 1)[1]}{LOCK_SUFFIX}/lease.json"
    deadline = time.time() + 60
    while time.time() < deadline:
        fs.invalidate_cache()
        if fs.exists(lease):
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    fs.invalidate_cache()
    assert fs.exists(lease)
    code, err = finish(start(*args))
    assert code == 0, err
    holds_source(dst, src, s3.storage_options)

    elsewhere = {"pid": 1, "host": "another-node", "boot_id": "x", "started": "2026-12-07T00:00:00+00:00"}
    fs.pipe(lease, json.dumps({**elsewhere, "expires": time.time() + 600}).encode())
    code, err = finish(start(*args, "--overwrite"))
    assert code == 2 and "another job is writing" in err and "another-node" in err, err
    fs.pipe(lease, json.dumps({**elsewhere, "expires": time.time() - 1}).encode())
    code, err = finish(start(*args, "--overwrite"))
    assert code == 0, err
    holds_source(dst, src, s3.storage_options)
    fs.invalidate_cache()
    assert not fs.exists(lease)
