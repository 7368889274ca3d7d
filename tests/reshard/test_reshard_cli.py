"""`ragckpt reshard` end to end: CLI behaviour, worker processes, bounded memory, a killed worker,
torchrun, and object storage. Heavier than the exactness tests because these start real processes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import ragckpt
from ragckpt.reshard.share import DELAY_ENV
from tests.helpers import cli_error, cli_run

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
RAGCKPT = [PY, "-m", "cli.main"]


def make_state(total_elems: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 matrices plus fp32 moments of the first one and a scalar step (two buffers)."""
    g = torch.Generator().manual_seed(seed)
    rows = max(1, total_elems // (8 * 1024))
    state = {f"layers.{i}.w": torch.randint(-2**15, 2**15, (rows, 1024), dtype=torch.int16, generator=g)
             .view(torch.bfloat16) for i in range(8)}
    state["optim.state.layers.0.w.exp_avg"] = torch.randn(rows, 1024, generator=g)
    state["optim.state.layers.0.w.step"] = torch.tensor(3.0)
    return state


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def check_state(url: str, state: dict[str, torch.Tensor]) -> None:
    ck = ragckpt.open(url)
    assert sorted(ck.names()) == sorted(state)
    for k, v in state.items():
        assert same_bits(ck.read(k), v), k



def tree_digest(root: str) -> dict[str, tuple[int, str]]:
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


# -- CLI ------------------------------------------------------------------------------------------------

def test_cli_reshard_json_and_errors(fast_dir):
    state = make_state(50_000)
    src, dst = f"{fast_dir}/src", f"{fast_dir}/dst"
    ragckpt.write_global(state, src, 12, "row")
    code, out, err = cli_run("reshard", src, dst, "--from", "12", "--to", "5", "--layout", "ragged", "--json")
    assert code == 0, err
    s = json.loads(out)
    for key in ("bytes_written", "bytes_read", "seconds", "gb_per_s", "peak_rss_bytes"):
        assert key in s
    assert s["from_world_size"] == 12 and s["to_world_size"] == 5 and s["to_layout"] == "ragged"
    assert s["bytes_written"] == ragckpt.open(dst).layout.total_bytes()
    check_state(dst, state)
    # human output
    code, out, err = cli_run("reshard", src, f"{fast_dir}/d2", "--to", "3")
    assert code == 0 and "12 ranks, row" in out and "3 ranks, row" in out
    assert re.search(r"\((\d+\.\d+ [GM]B/s|\d+\.\d kB/s)\) with", out) and "0.00 GB/s" not in out, out
    # one-line errors, no tracebacks
    cases = [
        (("reshard", src, f"{fast_dir}/x", "--from", "8", "--to", "4"), "--from 8 does not match the source, which "
                                                                       "was saved by 12 ranks"),
        (("reshard", src, dst, "--to", "4"), "already holds a committed checkpoint"),
        (("reshard", f"{fast_dir}/none", f"{fast_dir}/y", "--to", "4"), "no ragckpt checkpoint"),
        (("reshard", src, f"{src}/sub", "--to", "4"), "overlaps the source"),
        (("reshard", src, f"{fast_dir}/z", "--to", "4", "--window", "2MiB"), "too small"),
    ]
    for args, msg in cases:
        code, out, err = cli_run(*args)
        assert code != 0, args
        assert msg in err, (args, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    code, _, err = cli_run("reshard", src, f"{fast_dir}/z", "--to", "4", "--window", "lots")
    assert code != 0 and "not a size" in err
    code, _, err = cli_run("reshard", src, f"{fast_dir}/z", "--to", "4", "--granularity", "diagonal")
    assert code != 0 and "granularity" in err
    # --overwrite replaces
    code, out, err = cli_run("reshard", src, dst, "--to", "7", "--overwrite", "--layout", "element", "--json")
    assert code == 0, err
    assert ragckpt.open(dst).world_size == 7
    check_state(dst, state)
    code, out, _ = cli_run("reshard", "--help")
    assert code == 0 and "Example" in out and "--window" in out


def test_workers_write_disjoint_shares(fast_dir):
    state = make_state(200_000)
    src, dst = f"{fast_dir}/src", f"{fast_dir}/dst"
    ragckpt.write_global(state, src, 9, "ragged")
    p = subprocess.run([*RAGCKPT, "reshard", src, dst, "--to", "10", "--layout", "row", "--workers", "3", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["processes"] == 3 and s["peak_rss_workers_bytes"] > 0
    check_state(dst, state)
    assert ragckpt.open(dst).verify().ok
    # more workers than destination ranks: two run (the summary said 8), and the window is sized for
    # two, not refused as "too small for 8 process(es)"
    p = subprocess.run([*RAGCKPT, "reshard", src, f"{fast_dir}/dst2", "--to", "2", "--workers", "8", "--window",
                        "16MiB", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["processes"] == 2
    check_state(f"{fast_dir}/dst2", state)


def test_auto_workers_follow_object_count_cpus_and_window(monkeypatch):
    """`workers=None` (the CLI's default): one process per 4096 destination objects, capped by the
    usable CPUs and by what the window has room for, never below one."""
    from ragckpt.reshard import offline

    monkeypatch.setattr(offline, "usable_cpus", lambda: 8)
    MiB = 1 << 20
    assert offline.auto_workers(4096, 2, 512 * MiB, MiB) == 4  # 12,288 objects
    assert offline.auto_workers(1365, 2, 512 * MiB, MiB) == 1  # 4,095 objects
    assert offline.auto_workers(1366, 2, 512 * MiB, MiB) == 2
    assert offline.auto_workers(8192, 1, 512 * MiB, MiB) == 5
    assert offline.auto_workers(8192, 1, 10 * MiB, MiB) == 2  # 5 MiB per process at least (sizing)
    assert offline.auto_workers(8192, 1, 10 * MiB, 4 * MiB) == 1  # 4 MiB blocks: 20 MiB per process
    assert offline.auto_workers(8192, 1, 1 * MiB, MiB) == 1  # sizing names the window, not the workers
    monkeypatch.setattr(offline, "usable_cpus", lambda: 2)
    assert offline.auto_workers(1 << 20, 2, 512 * MiB, MiB) == 2


def test_a_reshard_left_to_choose_spawns_workers_only_for_many_objects(fast_dir, monkeypatch):
    from ragckpt.reshard import offline

    state = make_state(50_000)
    src = f"{fast_dir}/src"
    ragckpt.write_global(state, src, 6, "ragged")
    monkeypatch.setattr(offline, "usable_cpus", lambda: 2)
    stats = offline.reshard(src, f"{fast_dir}/a", 5, workers=None)  # 15 objects
    assert stats.processes == 1 and stats.peak_rss_workers_bytes == 0
    monkeypatch.setattr(offline, "OBJECTS_PER_WORKER", 8)
    stats = offline.reshard(src, f"{fast_dir}/b", 5, workers=None)
    assert stats.processes == 2 and stats.peak_rss_workers_bytes > 0
    check_state(f"{fast_dir}/b", state)
    assert offline.reshard(src, f"{fast_dir}/c", 5).processes == 1  # a library call spawns none unasked
    code, out, _ = cli_run("reshard", "--help")
    assert code == 0 and "one per 4096 destination objects" in " ".join(out.split())


def test_split_ranks_is_disjoint_and_balanced():
    from ragckpt.planner.state import CheckpointLayout
    from ragckpt.reshard.offline import split_ranks

    lay = CheckpointLayout.build({"a": ((1000, 64), "float32"), "b": ((7,), "bfloat16")}, 37, "row")
    for parts in (1, 2, 5, 37, 50):
        shares = split_ranks(lay, parts)
        flat = [r for s in shares for r in s]
        assert flat == list(range(37))
        sizes = [sum(int(lay.rank_sizes(0)[r]) for r in s) for s in shares if s]
        if parts <= 5:
            assert max(sizes) - min(sizes) <= 2 * 28 * 64  # within two ranks' worth
    # equal ranks split evenly: the first cut used to land one rank early, leaving process 0 idle
    for W, parts in ((2, 2), (4, 2), (8, 4), (6, 3), (4096, 8)):
        lay = CheckpointLayout.build({"a": ((W * 16, 8), "float32")}, W, "row")
        assert [len(s) for s in split_ranks(lay, parts)] == [W // parts] * parts, (W, parts)


# -- memory ------------------------------------------------------------------------------------------

_BASELINE = """
import importlib, json, sys
import cli.main, ragckpt
importlib.import_module(sys.argv[4])  # what the measured process imports besides (torchrun: torch.distributed)
from ragckpt.reshard.offline import peak_rss_self
ck = ragckpt.open(sys.argv[1], storage_options=json.loads(sys.argv[3]))
lay = ragckpt.reshard.target_layout(ck.layout, int(sys.argv[2]), "row")
print(peak_rss_self())
"""


@pytest.mark.parametrize("mode", ["in-process", "workers", pytest.param("torchrun", marks=pytest.mark.slow),
                                  pytest.param("s3", marks=pytest.mark.slow)])
def test_peak_rss_stays_under_window(fast_dir, mode, request):
    """A 256 MiB checkpoint (4x the window) resharded with a 64 MiB window: peak RSS stays under the
    interpreter's own baseline (same imports, same metadata opened and planned) plus the window; with
    `--workers 2` each worker under the baseline plus its half; under torchrun (where the window is
    per process) every rank, as reported by process 0, under the baseline plus the window. `s3`
    reshards from S3 to S3 (moto's server, in this test's process), ranged GETs and multipart PUTs."""
    window = 64 << 20
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randint(-2**31, 2**31 - 1, (4096, 2048), dtype=torch.int32, generator=g)
             .view(torch.float32) for i in range(8)}  # 8 x 32 MiB
    src, dst, opts, flags = f"{fast_dir}/src", f"{fast_dir}/dst", None, []
    if mode == "s3":
        s3 = request.getfixturevalue("s3")
        src, dst, opts, flags = f"{s3.url}/src", f"{s3.url}/dst", s3.storage_options, s3.cli_args()
    ragckpt.write_global(state, src, 16, "ragged", storage_options=opts)
    total = ragckpt.open(src, storage_options=opts).layout.total_bytes()
    assert total >= 4 * window
    imported = "torch.distributed" if mode == "torchrun" else "cli.main"
    base = subprocess.run([PY, "-c", _BASELINE, src, "6", json.dumps(opts), imported], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert base.returncode == 0, base.stderr
    baseline = int(base.stdout.strip())
    args = [src, dst, "--to", "6", "--layout", "row", "--window", "64MiB", "--json", *flags]
    if mode == "torchrun":
        cmd = [str(Path(PY).with_name("torchrun")), "--standalone", "--nproc-per-node", "2", "-m",
               "cli.distributed", *args]
    else:
        cmd = [*RAGCKPT, "reshard", *args, *(["--workers", "2"] if mode == "workers" else [])]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout[p.stdout.index("{"):])
    peak, workers = s["peak_rss_bytes"], s["peak_rss_workers_bytes"]
    share = window // 2 if mode == "workers" else window
    assert peak < baseline + share, f"peak {peak >> 20} MiB, baseline {baseline >> 20} MiB + {share >> 20} MiB"
    if mode in ("in-process", "s3"):
        assert workers == 0
    else:  # the workers' (or every rank's) own peaks were reported, not left out
        assert baseline * 0.9 < workers < baseline + share, \
            f"largest worker {workers >> 20} MiB, baseline {baseline >> 20} MiB + {share >> 20} MiB"
    del state
    ck = ragckpt.open(dst, storage_options=opts)
    assert ck.world_size == 6
    g = torch.Generator().manual_seed(1)
    for i in range(8):
        want = torch.randint(-2**31, 2**31 - 1, (4096, 2048), dtype=torch.int32, generator=g).view(torch.float32)
        assert same_bits(ck.read(f"w{i}"), want)


# -- faults ------------------------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _workers_of(pid: int) -> list[int]:
    out = []
    for c in _children(pid):
        try:
            cmd = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"spawn_main" in cmd:
            out.append(c)
    return out


def test_killed_worker_leaves_destination_uncommitted_and_rerun_succeeds(fast_dir):
    state = make_state(300_000)
    src, dst = f"{fast_dir}/src", f"{fast_dir}/dst"
    ragckpt.write_global(state, src, 24, "row")
    before = tree_digest(src)
    env = dict(os.environ, **{DELAY_ENV: "0.25"})
    cmd = [*RAGCKPT, "reshard", src, dst, "--to", "16", "--layout", "ragged", "--workers", "2", "--threads", "1"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        victims: list[int] = []
        while time.time() < deadline:
            done = list(Path(dst, "ranks").glob("*.json")) if Path(dst, "ranks").is_dir() else []
            victims = _workers_of(p.pid)
            if done and len(victims) == 2:
                break
            time.sleep(0.05)
        assert victims and p.poll() is None, "the reshard finished before a worker could be killed"
        os.kill(victims[0], signal.SIGKILL)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0
    assert "SIGKILL" in err and "uncommitted" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for c in victims[1:]:
        assert not Path(f"/proc/{c}").exists() or b"zombie" in Path(f"/proc/{c}/status").read_bytes().lower()
    assert not Path(dst, "COMMITTED").exists()
    code, out, _ = cli_run("info", dst)
    assert code == 0 and "NOT COMMITTED" in out
    with pytest.raises(ragckpt.NotCommittedError):
        ragckpt.open(dst)
    assert tree_digest(src) == before  # the source was only read
    # the same command again (no --overwrite) replaces the leftover and commits
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    check_state(dst, state)
    assert ragckpt.open(dst).verify().ok


# -- torchrun ------------------------------------------------------------------------------------------------

_BALLAST_THEN_RESHARD = """
import os, runpy
if os.environ["RANK"] == "1":  # this process's peak is then well above process 0's
    ballast = bytearray(160 << 20)
    ballast[::4096] = bytes(len(range(0, 160 << 20, 4096)))  # every page touched
runpy.run_module("cli.distributed", run_name="__main__")
"""


@pytest.mark.slow
def test_torchrun_distributed_reshard(fast_dir, tmp_path):
    """Two gloo processes, each writing its share of destination ranks; process 0 commits and reports
    the largest process's peak RSS (here process 1's, which holds 160 MiB more)."""
    state = make_state(100_000)
    src, dst = f"{fast_dir}/src", f"{fast_dir}/dst"
    ragckpt.write_global(state, src, 6, "ragged")
    script = tmp_path / "ballast_then_reshard.py"
    script.write_text(_BALLAST_THEN_RESHARD)
    launch = [str(Path(PY).with_name("torchrun")), "--standalone", "--nproc-per-node", "2", str(script)]
    cmd = [*launch, src, dst, "--to", "11", "--layout", "element", "--json"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout[p.stdout.index("{"):])
    assert s["processes"] == 2 and s["to_world_size"] == 11 and s["extra"]["distributed"]
    assert 0 < s["plan_seconds"] < s["seconds"], s  # was always 0.0 under torchrun
    assert s["peak_rss_workers_bytes"] >= s["peak_rss_bytes"] + (128 << 20), s
    check_state(dst, state)
    manifests = {int(f.stem) for f in Path(dst, "ranks").glob("*.json")}
    assert manifests == set(range(11))
    # a second run without --overwrite is refused on every process, with the reason
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode != 0 and "already holds a committed checkpoint" in p.stderr
    # ... and one JSON document on stdout, process 0's, as on success (there was one per process)
    assert "already holds a committed checkpoint" in json.loads(p.stdout[p.stdout.index("{"):])["error"], p.stdout
    # --overwrite from a source found damaged while process 1 reads it: DST is put back as it was
    before = tree_digest(dst)
    bad = f"{fast_dir}/bad"
    ragckpt.write_global(make_state(100_000, seed=3), bad, 6, "ragged")
    flip_byte(f"{bad}/buffers/0/c.5.0")
    cmd = [*launch, bad, dst, "--to", "4", "--overwrite"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode != 0 and "checksum mismatch" in p.stderr and "was left as it was" in p.stderr, p.stderr[-3000:]
    assert tree_digest(dst) == before and not list(Path(fast_dir).glob("dst.replaced-*"))


# -- object storage -------------------------------------------------------------------------------------------

def test_s3_source_and_destination(s3, fast_dir):
    url, opts = s3
    state = make_state(60_000)
    ragckpt.write_global(state, f"{url}/src", 5, "row", storage_options=opts)
    stats = ragckpt.reshard.reshard(f"{url}/src", f"{fast_dir}/local", 3, layout="ragged", storage_options=opts)
    assert stats.read_calls >= 1
    check_state(f"{fast_dir}/local", state)
    code, out, err = cli_run("reshard", f"{fast_dir}/local", f"{url}/dst", "--to", "4", "--layout", "element",
                             "--json", *s3.cli_args())
    assert code == 0, err
    ck = ragckpt.open(f"{url}/dst", storage_options=opts)
    assert ck.world_size == 4
    for k, v in state.items():
        assert same_bits(ck.read(k), v), k
    assert np.isfinite(json.loads(out)["seconds"])


def _save_with_extras(url: str, state: dict[str, torch.Tensor], W: int) -> None:
    """An engine-style save: every rank its flat buffer plus RNG state and a data position."""
    lay = ragckpt.CheckpointLayout.build({k: (tuple(v.shape), "float32") for k, v in state.items()}, W, "row")
    flat = lay.layout_of(0)
    for r in range(W):
        buf = torch.zeros(int(flat.rank_sizes()[r]))
        seg = flat.rank_segments(r)
        for i in range(len(seg)):
            t = state[lay.buffers[0].tensors[int(seg.slot[i])]].reshape(-1)
            o, fs, n = int(seg.offset[i]), int(seg.flat_start[i]), int(seg.length[i])
            buf[o : o + n] = t[fs : fs + n]
        ragckpt.save_shard(url, r, {"float32": buf}, lay, extra={"rng": torch.tensor([r, 42, -r])},
                           extra_meta={"data_pos": str(100 * r)})
    ragckpt.commit(url)


@pytest.mark.parametrize("workers", [1, 2])
def test_extras_are_copied_at_the_same_world_size_and_reported_dropped_otherwise(fast_dir, workers):
    """A layout change at the same world size keeps each rank's extras (RNG state, data position)
    bit for bit; a world-size change cannot map them to new ranks, and says so instead of dropping
    them silently."""
    state = {"w": torch.randn(37, 5), "b": torch.randn(11)}
    src = f"{fast_dir}/src"
    _save_with_extras(src, state, 3)
    code, out, err = cli_run("reshard", src, f"{fast_dir}/same", "--to", "3", "--layout", "ragged",
                             "--workers", str(workers), "--json")
    assert code == 0, err
    assert json.loads(out)["extras_copied"] == 3 and json.loads(out)["extras_dropped"] == 0
    same = ragckpt.open(f"{fast_dir}/same")
    assert same.verify().ok
    check_state(f"{fast_dir}/same", state)
    for r in range(3):
        tensors, meta = same.extra(r)
        assert tensors["rng"].tolist() == [r, 42, -r] and meta == {"data_pos": str(100 * r)}
    code, out, err = cli_run("reshard", src, f"{fast_dir}/two", "--to", "2", "--workers", str(workers))
    assert code == 0, err
    assert "per-rank extras (RNG state, ...) of 3 source rank(s) were not carried over" in out
    two = ragckpt.open(f"{fast_dir}/two")
    assert two.extra(0) == ({}, {}) and two.verify().ok


def flip_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated object", "missing object"])
def test_a_damaged_source_into_a_new_destination(fast_dir, damage):
    """Without --overwrite: an object missing or cut short is found before anything is written, so
    DST is not created at all; a flipped byte is found while reading, and the error then says DST
    was left uncommitted and that the same command replaces it, which it does once SRC is repaired."""
    state = make_state(50_000)
    src, dst = f"{fast_dir}/src", f"{fast_dir}/dst"
    ragckpt.write_global(state, src, 4, "ragged")
    obj = f"{src}/buffers/0/c.3.0"
    kept = open(obj, "rb").read()
    if damage == "flipped byte":
        flip_byte(obj)
    elif damage == "truncated object":
        os.truncate(obj, len(kept) - 1)
    else:
        os.unlink(obj)
    line = cli_error("reshard", src, dst, "--to", "3")
    assert "buffers/0/c.3.0" in line
    if damage == "flipped byte":
        assert line.endswith("the destination was left uncommitted; re-running the same command replaces it"), line
        assert not ragckpt.open(dst, allow_uncommitted=True).committed
    else:
        assert "nothing was written" in line and not os.path.exists(dst)
    with open(obj, "wb") as f:
        f.write(kept)
    code, _, err = cli_run("reshard", src, dst, "--to", "3")
    assert code == 0, err
    check_state(dst, state)


@pytest.mark.parametrize("damage", ["flipped byte", "missing object"])
def test_overwrite_from_a_damaged_source_keeps_the_old_destination(fast_dir, damage):
    """`reshard BAD DST --overwrite` where BAD turns out damaged half way: the error names the bad
    object and says DST was left as it was; DST is still the committed checkpoint it was, byte for
    byte, and nothing is left beside it. A good overwrite replaces DST and keeps its mode."""
    state = make_state(50_000)
    good, bad, dst = f"{fast_dir}/good", f"{fast_dir}/bad", f"{fast_dir}/dst"
    ragckpt.write_global(state, good, 4, "ragged")
    ragckpt.write_global(make_state(50_000, seed=1), bad, 4, "ragged")
    code, _, err = cli_run("reshard", good, dst, "--to", "2")
    assert code == 0, err
    os.chmod(dst, 0o750)
    before = tree_digest(dst)
    if damage == "flipped byte":
        flip_byte(f"{bad}/buffers/0/c.3.0")
    else:
        os.unlink(f"{bad}/buffers/0/c.3.0")
    code, out, err = cli_run("reshard", bad, dst, "--to", "3", "--overwrite")
    # a missing object is found before DST is touched, a flipped byte only while reading
    said = "nothing was written or overwritten" if damage == "missing object" else "was left as it was"
    assert code == 2 and "buffers/0/c.3.0" in err and said in err, (out, err)
    assert tree_digest(dst) == before
    assert [p for p in os.listdir(fast_dir) if p.startswith("dst.")] == []
    check_state(dst, state)

    code, _, err = cli_run("reshard", good, dst, "--to", "3", "--overwrite")
    assert code == 0, err
    assert ragckpt.open(dst).world_size == 3 and (os.stat(dst).st_mode & 0o777) == 0o750
    assert [p for p in os.listdir(fast_dir) if p.startswith("dst.")] == []


def test_window_far_beyond_the_data_needs_no_huge_buffers_and_reruns_name_the_old_target(fast_dir):
    state = make_state(1_000)
    src, dst = f"{fast_dir}/src", f"{fast_dir}/dst"
    ragckpt.write_global(state, src, 4, "ragged")
    code, _, err = cli_run("reshard", src, dst, "--to", "2", "--window", "99999TiB")
    assert code == 0, err
    check_state(dst, state)
    os.unlink(f"{dst}/COMMITTED")  # as if interrupted before its commit
    code, _, err = cli_run("reshard", src, dst, "--to", "3")
    assert code == 2 and "holds an interrupted reshard of this source to another target (2 ranks, ragged, not 3 " \
                         "ranks, ragged)" in err, err


def test_ctrl_c_to_the_process_group_gives_one_line_and_no_worker_tracebacks(fast_dir):
    """The terminal sends SIGINT to the whole process group: the workers (spawned with SIGINT
    ignored) leave the reaction to the parent, which stops them and prints one line."""
    state = make_state(300_000)
    src, dst = f"{fast_dir}/src", f"{fast_dir}/dst"
    ragckpt.write_global(state, src, 24, "row")
    env = dict(os.environ, **{DELAY_ENV: "0.25"})
    cmd = [*RAGCKPT, "reshard", src, dst, "--to", "16", "--workers", "2", "--threads", "1"]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and len(_workers_of(p.pid)) < 2:
            time.sleep(0.02)
        workers = _workers_of(p.pid)
        assert len(workers) == 2 and p.poll() is None, "the workers never started"
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "interrupted" in err, err
    assert not Path(dst, "COMMITTED").exists()
    time.sleep(0.5)
    assert all(not Path(f"/proc/{w}").exists() or b"zombie" in Path(f"/proc/{w}/status").read_bytes().lower()
               for w in workers)


def test_overwrite_through_a_symlink_keeps_the_target_and_its_owner(fast_dir):
    """`latest -> step_N` as DST: the link's target is set aside and put back when SRC is damaged;
    a good overwrite keeps the target's owner (root here can hand it to nobody)."""
    state = make_state(20_000)
    good, bad, real, link = (f"{fast_dir}/{n}" for n in ("good", "bad", "step_1", "latest"))
    ragckpt.write_global(state, good, 3, "ragged")
    ragckpt.write_global(make_state(20_000, seed=2), bad, 3, "ragged")
    flip_byte(f"{bad}/buffers/0/c.2.0")
    assert cli_run("reshard", good, real, "--to", "2")[0] == 0
    os.symlink(real, link)
    if os.geteuid() == 0:
        os.chown(real, 65534, 65534)
    before = tree_digest(real)
    code, _, err = cli_run("reshard", bad, link, "--to", "4", "--overwrite")
    assert code == 2 and "was left as it was" in err, err
    assert tree_digest(real) == before and os.path.islink(link)
    assert cli_run("reshard", good, link, "--to", "4", "--overwrite")[0] == 0
    assert os.path.islink(link) and ragckpt.open(real).world_size == 4
    if os.geteuid() == 0:
        assert (os.stat(real).st_uid, os.stat(real).st_gid) == (65534, 65534)
    assert not [p for p in os.listdir(fast_dir) if ".replaced-" in p]


def test_overwrite_without_room_for_both_replaces_in_place_and_says_so(fast_dir, monkeypatch):
    """Too little free space to keep the old DST beside the new one: the overwrite works in place,
    as before; a damaged source then costs the old DST, and the error says so."""
    import shutil as _shutil

    from ragckpt.reshard.offline import reshard
    from ragckpt.storage import destination

    state = make_state(20_000)
    good, bad, dst = f"{fast_dir}/good", f"{fast_dir}/bad", f"{fast_dir}/dst"
    ragckpt.write_global(state, good, 3, "ragged")
    ragckpt.write_global(state, bad, 3, "ragged")
    flip_byte(f"{bad}/buffers/0/c.1.0")
    reshard(good, dst, 2)
    monkeypatch.setattr(destination.shutil, "disk_usage", lambda p: _shutil._ntuple_diskusage(1 << 40, 1 << 40, 0))
    with pytest.raises(ragckpt.IntegrityError, match=r"previous contents of \S+/dst were deleted by --overwrite"):
        reshard(bad, dst, 4, overwrite=True)
    reshard(good, dst, 4, overwrite=True)  # and with a good source it simply works
    check_state(dst, state)


def test_sigterm_during_an_overwrite_puts_the_old_destination_back(fast_dir):
    state = make_state(300_000)
    src, dst = f"{fast_dir}/src", f"{fast_dir}/dst"
    ragckpt.write_global(state, src, 24, "row")
    assert cli_run("reshard", src, dst, "--to", "8")[0] == 0
    before = tree_digest(dst)
    env = dict(os.environ, **{DELAY_ENV: "0.25"})
    p = subprocess.Popen([*RAGCKPT, "reshard", src, dst, "--to", "16", "--threads", "1", "--overwrite"], cwd=ROOT,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (list(Path(fast_dir).glob("dst.replaced-*"))
                                              and Path(dst, "zarr.json").exists()):
            time.sleep(0.02)  # the old DST is aside and the new one under way
        assert p.poll() is None and list(Path(fast_dir).glob("dst.replaced-*")), "no overwrite in progress"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 143 and "terminated" in err and "was left as it was" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert tree_digest(dst) == before and not list(Path(fast_dir).glob("dst.replaced-*"))


def test_a_set_aside_left_by_a_killed_overwrite_is_moved_back_by_the_next_run(fast_dir):
    """A SIGKILLed overwrite left the old checkpoint set aside and DST without one: the next run
    into DST moves it back first (tests/storage/test_overwrite_recovery.py kills every step), so a plain
    reshard then finds DST's checkpoint again and refuses, and an --overwrite replaces it."""
    state = make_state(5_000)
    src, dst = f"{fast_dir}/src", f"{fast_dir}/dst"
    ragckpt.write_global(state, src, 3, "ragged")
    ragckpt.write_global(state, f"{dst}.replaced-0123456789ab", 3, "ragged")  # as a SIGKILLed run leaves it
    code, out, err = cli_run("reshard", src, dst, "--to", "2")
    assert code == 2 and "already holds a committed checkpoint" in err, err
    assert not os.path.exists(f"{dst}.replaced-0123456789ab")
    assert ragckpt.open(dst).world_size == 3 and ragckpt.open(dst).verify().ok
    code, out, _ = cli_run("reshard", src, dst, "--to", "4", "--overwrite", "--json")
    assert code == 0 and "leftover_set_asides" not in json.loads(out)["extra"]
    assert ragckpt.open(dst).world_size == 4 and not [p for p in os.listdir(fast_dir) if ".replaced-" in p]
