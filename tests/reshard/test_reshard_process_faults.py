"""Process faults around a reshard: a `--workers K` parent killed outright must take its workers
along (orphans would keep writing DST while the re-run rewrites it), and a step failing on one
torchrun process must make every process raise the same ReshardError promptly instead of leaving
the others blocked in a collective until the group's timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ragckpt
from ragckpt.reshard.share import DELAY_ENV

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def make_state(rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 matrices plus an fp32 one (two buffers)."""
    g = torch.Generator().manual_seed(seed)
    state = {f"layers.{i}.w": torch.randint(-2**15, 2**15, (rows, 1024), dtype=torch.int16, generator=g)
             .view(torch.bfloat16) for i in range(4)}
    state["optim.exp_avg"] = torch.randn(rows, 1024, generator=g)
    return state


def check_state(url: str, state: dict[str, torch.Tensor]) -> None:
    ck = ragckpt.open(url)
    assert sorted(ck.names()) == sorted(state)
    for k, v in state.items():
        got = ck.read(k)
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert torch.equal(got.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: it runs no code and writes nothing)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return any(line.startswith("State:") and "Z" in line.split()[1] for line in status.splitlines())


def _workers_of(pid: int) -> list[int]:
    try:
        kids = [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    out = []
    for c in kids:
        try:
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes():
                out.append(c)
        except OSError:
            pass
    return out


def _snapshot(root: str) -> dict[str, tuple[int, int]]:
    out = {}
    for p in Path(root).rglob("*"):
        try:
            st = p.stat()
        except OSError:
            continue
        if p.is_file():
            out[str(p.relative_to(root))] = (st.st_mtime_ns, st.st_size)
    return out


# -- --workers: the parent killed with SIGKILL ----------------------------------------------------------

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkilled_parent_takes_its_workers_along_and_rerun_succeeds(fast_dir):
    state = make_state(512)
    src, dst = f"{fast_dir}/src", f"{fast_dir}/dst"
    ragckpt.write_global(state, src, 8, "row")
    cmd = [PY, "-m", "cli.main", "reshard", src, dst, "--to", "16", "--layout", "ragged", "--workers", "2",
           "--threads", "1"]
    # slowed down so that the workers are still busy for seconds after the parent is killed
    p = subprocess.Popen(cmd, cwd=ROOT, env=dict(ENV, **{DELAY_ENV: "0.4"}), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            workers = _workers_of(p.pid)
            # a data chunk, not the zarr.json documents the parent writes first: the workers are past
            # their start-up (importing torch takes seconds on a busy machine) and armed to die with it
            written = Path(dst, "buffers").is_dir() and any(f.is_file() for f in Path(dst, "buffers").rglob("c.*"))
            if len(workers) == 2 and written:
                break
            time.sleep(0.05)
        assert len(workers) == 2 and p.poll() is None, "the workers never started writing, or the run ended"
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        t_kill = time.monotonic()
        while time.monotonic() < t_kill + 5 and not all(_gone(w) for w in workers):
            time.sleep(0.05)
        assert all(_gone(w) for w in workers), "worker processes outlived their SIGKILLed parent"
        # and nothing writes DST any more
        before = _snapshot(dst)
        time.sleep(1.0)
        assert _snapshot(dst) == before
        assert not Path(dst, "COMMITTED").exists()
    finally:
        for pid in [p.pid, *workers]:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        if p.poll() is None:
            p.wait()
    # the same command again replaces the leftover and commits
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    check_state(dst, state)


_ORPHAN = textwrap.dedent("""
    import os, subprocess, sys, time
    if sys.argv[1] == "parent":
        c = subprocess.Popen([sys.executable, __file__, "child", str(os.getpid())])
        print(c.pid, flush=True)
        time.sleep(120)
    else:
        from ragckpt.reshard.workers import _die_with_parent
        _die_with_parent(int(sys.argv[2]), use_prctl=False)  # the fallback for platforms without prctl
        print("armed", flush=True)
        time.sleep(120)
""")


def test_parent_watch_fallback_ends_an_orphan(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN)
    p = subprocess.Popen([PY, str(script), "parent"], env=ENV, stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    try:
        assert p.stdout.readline().strip() == "armed"  # inherited stdout: the child is running, armed
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not _gone(child):
            time.sleep(0.05)
        assert _gone(child), "the orphan kept running"
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
            p.wait()


# -- torchrun: a step failing on one process ------------------------------------------------------------

_DIST = textwrap.dedent("""
    import datetime, json, os, sys, time
    rank, mode, src, dst, work = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    import torch.distributed as dist
    # a caller-owned group, as inside a training job; a hang would last this long
    dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    import ragckpt
    import ragckpt.reshard.distributed as D
    from ragckpt.errors import DestinationExistsError

    def boom(exc):
        def f(*a, **k):
            raise exc
        return f

    if mode == "finish" and rank == 0:
        D.finish = boom(DestinationExistsError("injected: commit refused"))
    elif mode == "prepare" and rank == 0:
        D.prepare = boom(ValueError("injected: not a RagckptError"))
    elif mode == "open_dst" and rank == 1:
        real_open = D.open_checkpoint
        def fake_open(url, *a, **k):
            if k.get("allow_uncommitted"):
                raise OSError("injected: destination unreachable")
            return real_open(url, *a, **k)
        D.open_checkpoint = fake_open
    elif mode == "stats" and rank == 0:
        D.job_stats = boom(KeyError("injected"))
    to = 3
    if mode == "other_src" and rank == 1:
        src += "2"
    elif mode == "other_to" and rank == 1:
        to = 2
    t0 = time.monotonic()
    try:
        D.run(src, dst, to)
        res = {"type": None, "msg": ""}
    except Exception as e:
        res = {"type": type(e).__name__, "msg": str(e)}
    res["seconds"] = time.monotonic() - t0
    with open(f"{work}/result{rank}.tmp", "w") as f:
        json.dump(res, f)
    os.replace(f"{work}/result{rank}.tmp", f"{work}/result{rank}.json")
    # the caller carries on with its group alive (no destroy), until the test lets it go
    deadline = time.monotonic() + 90
    while not os.path.exists(f"{work}/release") and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)
""")

_CASES = {
    # mode: (failing process, step named in the error, DST committed afterwards)
    "finish": (0, "commit the destination", False),
    "prepare": (0, "prepare the destination", None),
    "open_dst": (1, "read the destination layout", False),
    "stats": (0, "collect the job's statistics", True),
}


def _run_two(tmp_path, mode: str, src: str, dst: str) -> dict[int, dict]:
    """Run `_DIST` as processes 0 and 1 of a reshard in `mode`; each one's outcome, or fail naming
    the one that hung or died (waiting well under the group's 60 s timeout)."""
    script = tmp_path / "proc.py"
    script.write_text(_DIST)
    procs = [subprocess.Popen([PY, str(script), str(r), mode, src, dst, str(tmp_path)], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    results: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and len(results) < 2:
            for r in range(2):
                f = tmp_path / f"result{r}.json"
                if r not in results and f.exists():
                    results[r] = json.loads(f.read_text())
            if any(p.poll() is not None for p in procs) and len(results) < 2:
                break  # a process died without reporting
            time.sleep(0.05)
    finally:
        (tmp_path / "release").touch()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    logs = "\n".join(p.stdout.read()[-2000:] for p in procs)
    assert sorted(results) == [0, 1], f"a process hung or died; got {results}\n{logs}"
    return results


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(_CASES))
def test_distributed_step_failure_reaches_every_process(mode, fast_dir, tmp_path):
    failing, step, committed = _CASES[mode]
    state = make_state(64)
    src, dst = f"{fast_dir}/src", f"{fast_dir}/dst"
    ragckpt.write_global(state, src, 4, "ragged")
    results = _run_two(tmp_path, mode, src, dst)
    msgs = {results[r]["msg"] for r in range(2)}
    assert len(msgs) == 1, results  # every process raises the same error
    msg = msgs.pop()
    for r in range(2):
        assert results[r]["type"] == "ReshardError", results
        assert results[r]["seconds"] < 20, results
    assert f"process {failing} failed to {step}" in msg and "injected" in msg, msg
    assert "\n" not in msg
    if committed:
        assert "the destination was committed" in msg
        check_state(dst, state)
    elif committed is False:
        assert "uncommitted" in msg
        with pytest.raises(ragckpt.NotCommittedError):
            ragckpt.open(dst)
    if mode == "prepare":
        assert "ValueError: injected" in msg


@pytest.mark.parametrize("mode, needle", [("other_src", "process 1 was given SRC '"),
                                          ("other_to", "process 1 was given --to 2, process 0 3")])
def test_processes_given_different_arguments_are_refused_before_anything_is_written(mode, needle, fast_dir,
                                                                                   tmp_path):
    """Only process 0's arguments plan the job: a process given another SRC (same names and shapes,
    other data) wrote its share of that into DST, which committed mixed data that verify passed."""
    src, dst = f"{fast_dir}/src", f"{fast_dir}/dst"
    ragckpt.write_global(make_state(64, seed=1), src, 4, "ragged")
    ragckpt.write_global(make_state(64, seed=2), src + "2", 4, "ragged")
    results = _run_two(tmp_path, mode, src, dst)
    assert results[0]["msg"] == results[1]["msg"] and results[0]["type"] == "ReshardError", results
    assert needle in results[0]["msg"] and "nothing was written" in results[0]["msg"], results
    assert not os.path.exists(dst)


def test_a_ctrl_c_while_workers_start_is_held_for_the_parent_and_kept_from_the_children():
    """Workers are started with SIGINT blocked, so a terminal's Ctrl-C (sent to the whole group)
    reaches only the parent; the parent does not lose one that arrives meanwhile, and gets it only
    once the worker is started and recorded."""
    import signal
    import subprocess
    import sys
    import time

    from ragckpt.reshard.workers import _blank_main

    reached_end = False
    with pytest.raises(KeyboardInterrupt):
        with _blank_main():
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # an interrupt raised inside the block would skip the next line
            reached_end = True
    try:
        blocked = int(next(ln.split()[1] for ln in open(f"/proc/{child.pid}/status") if ln.startswith("SigBlk:")), 16)
        assert blocked & (1 << (signal.SIGINT - 1)), "the child was started with SIGINT deliverable"
    finally:
        child.kill()
        child.wait()
    assert reached_end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
