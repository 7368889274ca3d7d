"""Resharding throughput: `ragckpt reshard` against a plain copy and against PyTorch DCP.

Everything runs on the same Llama-shaped bf16/fp32 state of --gib GiB, on the same disk, in one run
(this VM's first-touch and file-creation costs make numbers from separate runs incomparable).

1. Offline, 8192 -> 4096 ranks: `cp -r SRC COPY` of the source checkpoint (the same objects and
   bytes the resharder reads), alone and followed by `sync` (the resharder fsyncs every object it
   writes, cp does not), against `ragckpt reshard SRC DST --from 8192 --to 4096` in a fresh CLI
   process (its own time, without interpreter start-up, which is shown too). Output is checked.
2. Against PyTorch DCP. DCP needs one real process per rank, so this part runs at world sizes a
   2-core machine can host: the state saved by --dcp-from gloo processes as DTensor `Shard(0)`
   (`dcp.save`), and by ragckpt with the same placement (row shards, `write_global`). Then:
   * offline: DCP has no offline resharder; its way is `dcp.load` into --dcp-to processes with the
     new `Shard(0)` sharding plus `dcp.save` (fsyncs its files by default), against
     `ragckpt reshard` of the same state between the same worlds;
   * load time: `dcp.load` against `ragckpt.load`, --dcp-to processes each filling their own
     preallocated shards, timed from a barrier to the slowest process, metadata reading included;
     cold, and again warm from the page cache, which a plain read fills first (what each costs in
     CPU when the storage keeps up, as fast NVMe does);
   * for scale, `ragckpt.load` 8192 -> 4096 (ragged), --dcp-to processes each loading their share of
     the target ranks (no DCP counterpart: it would need 8192 processes).
Every contender starts cold: its source files are evicted from the page cache first (a restarted job
reads a checkpoint another job wrote), so all of them read from the device.
Plain copies of the 4-rank source files (4 threads, O_DIRECT writes, no checksums; buffered reads,
and O_DIRECT reads) are timed beside them, to show how close both come to simply moving the bytes and
so about the largest offline ratio over DCP the disk allows, and plain reads of them (--dcp-to
threads, nothing kept), buffered and with O_DIRECT, to show what the disk gives any cold load of
them, and so about the largest load-time ratio over `dcp.load` it allows.
The DCP comparison runs --repeat rounds in which the contenders take turns (the first one moving each
round); each keeps its best time and prints every round's. Before each contender the disk gets a sync
and SETTLE_S seconds, so none reads while the previous one's writes or deletions are still being
flushed or discarded.
Targets (issue #3): reshard >= 0.6x cp throughput and >= 2x DCP.

Usage: python -m tools.bench.bench_reshard [--gib 1.0] [--workdir DIR] [--skip-dcp] [--repeat 3] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench import procs
from tools.bench.cache import drop_page_cache, fsync_tree
from tools.bench.floors import direct_copy_tree, read_tree
from tools.bench.states import make_tensor, shard0_dtensor_state, state_spec

ROOT = Path(__file__).resolve().parents[2]
SETTLE_S = 5.0  # seconds the disk gets before each contender
def make_state(gib: float) -> dict:
    return {name: make_tensor(i, shape, dt) for i, (name, shape, dt) in enumerate(state_spec(gib))}


def run_ranks(role: str, world: int, args: list[str]) -> list[dict]:
    return procs.run_ranks("tools.bench.bench_reshard", role, world, args)


# -- roles run inside rank processes -------------------------------------------------------------------------

def _role(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    spec = state_spec(args.gib)
    result: dict = {"rank": rank}
    if args.role in ("dcp-save", "dcp-load"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor import zeros as dt_zeros

        mesh = init_device_mesh("cpu", (world,))
        if args.role == "dcp-save":
            dcp.save(shard0_dtensor_state(args.gib, mesh, rank, world), checkpoint_id=args.path)
        else:
            # a restarted engine's state exists (initialised) before it loads into it: zeros, not empty
            sd = {name: dt_zeros(shape, dtype=getattr(torch, dt), device_mesh=mesh, placements=[Shard(0)])
                  for name, shape, dt in spec}
            dist.barrier()
            t = time.perf_counter()
            dcp.load(sd, checkpoint_id=args.path)
            result["seconds"] = time.perf_counter() - t
            dist.barrier()
            result["bytes"] = sum(v.to_local().numel() * v.to_local().element_size() for v in sd.values())
            if args.out:  # DCP's way to reshard offline: load in the new sharding, save again (fsynced)
                t = time.perf_counter()
                dcp.save(sd, checkpoint_id=args.out)
                result["save_seconds"] = time.perf_counter() - t
                dist.barrier()
            for i in (0, len(spec) // 2, len(spec) - 1):  # correctness spot check (untimed)
                name, shape, dt = spec[i]
                want = torch.chunk(make_tensor(i, shape, dt), world, dim=0)
                got = sd[name].to_local()
                assert rank >= len(want) or torch.equal(got.view(torch.uint8), want[rank].contiguous().view(torch.uint8))
    else:  # ragckpt-load: this process loads target ranks rank, rank + world, ... of the target layout
        import ragckpt
        from ragckpt.format.dtypes import torch_dtype
        from ragckpt.reshard.plan import target_layout

        ck = ragckpt.open(args.path)
        target = target_layout(ck.layout, args.to, args.layout)
        mine = list(range(rank, args.to, world))
        # the engine's own flat buffers exist before a restart loads into them (DCP's targets too)
        bufs = {r: {b.name: torch.zeros(int(target.rank_sizes(i)[r]), dtype=torch_dtype(b.dtype))
                    for i, b in enumerate(target.buffers)} for r in mine}
        del ck, target
        dist.barrier()
        t = time.perf_counter()
        ck = ragckpt.open(args.path)
        target = target_layout(ck.layout, args.to, args.layout)
        for r in mine:
            ragckpt.load(ck, target, r, into=bufs[r])
        result["seconds"] = time.perf_counter() - t
        result["bytes"] = sum(v.numel() * v.element_size() for b in bufs.values() for v in b.values())
    dist.barrier()  # nobody tears gloo down while a peer still talks to it (aborted with "terminate called")
    dist.destroy_process_group()
    print(json.dumps(result))
    return 0


# -- driver ----------------------------------------------------------------------------------------------

def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    ap.add_argument("--from", dest="src_world", type=int, default=8192)
    ap.add_argument("--to", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=None, help="ragckpt reshard --workers (default: the CLI's own)")
    ap.add_argument("--window", default="512MiB")
    ap.add_argument("--dcp-from", type=int, default=4, help="ranks that save the DCP comparison state")
    ap.add_argument("--dcp-to", type=int, default=2, help="ranks that load it (also for ragckpt.load)")
    ap.add_argument("--workdir", default=None, help="where to write (default: a temp dir under $TMPDIR)")
    ap.add_argument("--skip-dcp", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the DCP comparison (best time of each kept)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--layout", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        return _role(args)

    import ragckpt

    work = Path(tempfile.mkdtemp(prefix="bench-reshard-", dir=args.workdir))
    src, dst, copy = work / "src", work / "dst", work / "copy"
    report: dict = {"gib": args.gib, "workdir": str(work)}
    t_start = time.perf_counter()

    def phase(what: str) -> None:
        print(f"  [{time.perf_counter() - t_start:6.1f}s] {what}", flush=True)

    try:
        t = time.perf_counter()
        state = make_state(args.gib)
        data_bytes = sum(v.numel() * v.element_size() for v in state.values())
        ragckpt.write_global(state, str(src), args.src_world, "ragged")
        src_bytes = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        nfiles = sum(1 for f in src.rglob("*") if f.is_file())
        print(f"state: {len(state)} tensors, {data_bytes / 2**30:.2f} GiB; source: {args.src_world} ranks, {nfiles} "
              f"objects, {src_bytes / 2**30:.2f} GiB on disk (setup {time.perf_counter() - t:.1f}s)", flush=True)
        subprocess.run(["sync"], check=True)

        # 1. plain copy
        drop_page_cache(str(src))
        t = time.perf_counter()
        subprocess.run(["cp", "-r", str(src), str(copy)], check=True)
        t_cp = time.perf_counter() - t
        t = time.perf_counter()
        subprocess.run(["sync"], check=True)
        t_sync = time.perf_counter() - t
        # the copy is removed only after the reshard: ext4 creates files slowly for ~30 s after many
        # deletions (its inode allocator re-reads each recently freed inode to skip it), which
        # made the reshard pay for cp's clean-up (5.0 instead of 3.5 s at 8192 -> 4096)
        phase("cp -r done")
        report["cp"] = {"seconds": t_cp, "gb_per_s": _gbps(src_bytes, t_cp)}
        report["cp_sync"] = {"seconds": t_cp + t_sync, "gb_per_s": _gbps(src_bytes, t_cp + t_sync)}

        # 2. offline reshard, fresh CLI process
        drop_page_cache(str(src))
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "cli.main", "reshard", str(src), str(dst), "--from",
                            str(args.src_world), "--to", str(args.to),
                            *(["--workers", str(args.workers)] if args.workers else []),
                            "--window", args.window, "--json"], cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if p.returncode:
            print(f"reshard failed: {p.stderr.strip()}")
            return 1
        s = json.loads(p.stdout)
        phase("ragckpt reshard done")
        # the same bytes cp moved: compare on source bytes (the destination differs only by padding)
        report["reshard"] = {"seconds": s["seconds"], "wall_seconds": wall, "gb_per_s": _gbps(src_bytes, s["seconds"]),
                             "bytes_read": s["bytes_read"], "bytes_written": s["bytes_written"],
                             "peak_rss_bytes": max(s["peak_rss_bytes"], s["peak_rss_workers_bytes"]),
                             "processes": s["processes"], "threads": s["threads"]}
        ck = ragckpt.open(str(dst))
        names = list(state)
        for n in (names[0], names[len(names) // 2], names[-1]):
            a, b = ck.read(n), state[n]
            assert a.dtype == b.dtype and a.view(-1).view(__import__("torch").uint8).equal(
                b.reshape(-1).view(__import__("torch").uint8)), f"reshard output differs in {n}"
        del ck
        shutil.rmtree(copy)

        # 3. against PyTorch DCP at world sizes real processes can run here
        if not args.skip_dcp:
            P, Q = args.dcp_from, args.dcp_to
            dcp_dir, dcp_out, row_dir, row_out = work / "dcp", work / "dcp_out", work / f"row{P}", work / f"row{Q}"
            common = ["--gib", str(args.gib)]
            run_ranks("dcp-save", P, [*common, "--path", str(dcp_dir)])
            ragckpt.write_global(state, str(row_dir), P, "row")
            subprocess.run(["sync"], check=True)
            del state
            phase(f"setup: DCP and ragckpt saves by {P} ranks")
            best: dict[str, float] = {}
            rounds: dict[str, list[float]] = {}  # every round's time: the disk's swings show between them

            def keep(key: str, seconds: float) -> None:
                best[key] = min(best.get(key, seconds), seconds)
                rounds.setdefault(key, []).append(seconds)

            trash: list[str] = []

            def rest() -> None:
                """Let the disk finish what the previous contender left: its writes (DCP's save, a
                copy) and deletions slowed the reads that came next. When ragckpt.load always ran
                right after DCP's save it read at 1.26 GB/s; taking turns with dcp.load after a
                rest, 1.89-2.01 GB/s against dcp.load's 1.13-1.31."""
                subprocess.run(["sync"], check=True)
                time.sleep(SETTLE_S)

            def dcp_round(i: int) -> None:
                drop_page_cache(str(dcp_dir))
                dl = run_ranks("dcp-load", Q, [*common, "--path", str(dcp_dir), "--out", f"{dcp_out}{i}"])
                trash.append(f"{dcp_out}{i}")
                load_s = max(r["seconds"] for r in dl)
                keep("dcp_load", load_s)
                keep("dcp_load_save", load_s + max(r["save_seconds"] for r in dl))
                # again from the page cache (filled by a plain read: cold loads that read with O_DIRECT
                # leave nothing there): the CPU cost of each, disk aside
                read_tree(str(dcp_dir), threads=Q)
                dw = run_ranks("dcp-load", Q, [*common, "--path", str(dcp_dir)])
                keep("dcp_load_warm", max(r["seconds"] for r in dw))

            def load_round(i: int) -> None:
                drop_page_cache(str(row_dir))
                rl = run_ranks("ragckpt-load", Q, [*common, "--path", str(row_dir), "--to", str(Q), "--layout", "row"])
                keep("ragckpt_load", max(r["seconds"] for r in rl))
                read_tree(str(row_dir), threads=Q)
                rw = run_ranks("ragckpt-load", Q, [*common, "--path", str(row_dir), "--to", str(Q), "--layout", "row"])
                keep("ragckpt_load_warm", max(r["seconds"] for r in rw))

            def big_load_round(i: int) -> None:
                drop_page_cache(str(src))
                bl = run_ranks("ragckpt-load", Q, [*common, "--path", str(src), "--to", str(args.to), "--layout",
                                                   "ragged"])
                keep("ragckpt_load_big", max(r["seconds"] for r in bl))

            def reshard_round(i: int) -> None:
                drop_page_cache(str(row_dir))
                p = subprocess.run([sys.executable, "-m", "cli.main", "reshard", str(row_dir), f"{row_out}{i}", "--to",
                                    str(Q), "--window", args.window, "--json"], cwd=ROOT, capture_output=True, text=True)
                trash.append(f"{row_out}{i}")
                if p.returncode:
                    raise SystemExit(f"reshard failed: {p.stderr.strip()}")
                keep("ragckpt_reshard_small", json.loads(p.stdout)["seconds"])

            def copy_round(i: int, direct_reads: bool = False) -> None:
                out = f"{row_out}copy{'d' if direct_reads else ''}{i}"
                drop_page_cache(str(row_dir))
                t = time.perf_counter()
                direct_copy_tree(str(row_dir), out, direct_reads=direct_reads)
                fsync_tree(out)
                keep("copy_floor_direct" if direct_reads else "copy_floor", time.perf_counter() - t)
                trash.append(out)

            def direct_copy_round(i: int) -> None:
                copy_round(i, direct_reads=True)

            def read_round(i: int) -> None:
                drop_page_cache(str(row_dir))
                t = time.perf_counter()
                read_tree(str(row_dir), threads=Q)
                keep("read_floor", time.perf_counter() - t)

            def direct_read_round(i: int) -> None:
                drop_page_cache(str(row_dir))
                t = time.perf_counter()
                read_tree(str(row_dir), threads=Q, direct=True)
                keep("read_floor_direct", time.perf_counter() - t)

            contenders = [dcp_round, load_round, reshard_round, copy_round, big_load_round, read_round,
                          direct_copy_round, direct_read_round]
            for i in range(args.repeat):  # contenders take turns, the first one moving each round
                for run in contenders[i % len(contenders):] + contenders[: i % len(contenders)]:
                    rest()
                    run(i)
                # outputs go at the end of the round: freeing 1 GiB on this VM's ext4 (mounted with
                # `discard`) slowed whatever read the disk next
                for path in trash:
                    shutil.rmtree(path, ignore_errors=True)
                trash.clear()
                phase(f"DCP comparison round {i + 1} of {args.repeat} done")
            for key, secs in best.items():
                report[key] = {"seconds": secs, "gb_per_s": _gbps(data_bytes, secs), "rounds": rounds[key]}
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    r, c, cs = report["reshard"], report["cp"], report["cp_sync"]
    W0, W1 = args.src_world, args.to

    def row(label: str, e: dict, note: str = "") -> None:
        if len(e.get("rounds", ())) > 1:
            note = " ".join([f"(rounds: {' '.join(f'{x:.2f}' for x in e['rounds'])})", note]).strip()
        print(f"{label:<58} {e['seconds']:8.2f} {e['gb_per_s']:7.3f}  {note}")

    print(f"\n{'contender':<58} {'seconds':>8} {'GB/s':>7}")
    print(f"[offline, {W0} -> {W1} ranks; GB/s over the {src_bytes / 2**30:.2f} GiB of source objects]")
    row("cp -r SRC (no fsync)", c)
    row("cp -r SRC + sync", cs)
    row(f"ragckpt reshard {W0} -> {W1} (synced before commit)", r,
        f"(wall incl. interpreter start {r['wall_seconds']:.2f}s; {r['processes']} process(es) x {r['threads']} "
        f"threads; peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB)")
    report["ratio_reshard_vs_cp"] = r["gb_per_s"] / c["gb_per_s"]
    report["ratio_reshard_vs_cp_sync"] = r["gb_per_s"] / cs["gb_per_s"]
    print(f"  reshard / cp -r = {report['ratio_reshard_vs_cp']:.2f}x, reshard / (cp -r + sync) = "
          f"{report['ratio_reshard_vs_cp_sync']:.2f}x   (target >= 0.6x)")
    if "dcp_load" in report:
        P, Q = args.dcp_from, args.dcp_to
        print(f"[against DCP, {P} -> {Q} ranks, Shard(0)/row -> Shard(0)/row; GB/s over {data_bytes / 2**30:.2f} "
              "GiB of tensor data]")
        row(f"DCP offline: dcp.load + dcp.save, {Q} gloo processes", report["dcp_load_save"])
        row(f"ragckpt reshard {P} -> {Q} (offline, 1 process)", report["ragckpt_reshard_small"])
        row("plain copy of the source files (4 threads, O_DIRECT writes)", report["copy_floor"])
        row("the same, O_DIRECT reads too", report["copy_floor_direct"])
        row(f"plain read of ragckpt's {P} source files ({Q} threads, no checksums)", report["read_floor"])
        row(f"the same, O_DIRECT ({Q} threads, no checksums)", report["read_floor_direct"])
        row(f"DCP load-time: dcp.load into {Q} processes", report["dcp_load"])
        row(f"ragckpt.load into {Q} processes", report["ragckpt_load"])
        row(f"DCP load-time, warm (page cache): dcp.load into {Q} processes", report["dcp_load_warm"])
        row(f"ragckpt.load, warm (page cache), into {Q} processes", report["ragckpt_load_warm"])
        row(f"ragckpt.load {W0} -> {W1} (ragged), {Q} processes", report["ragckpt_load_big"],
            f"(DCP cannot run {W0} real ranks here)")
        report["ratio_offline_vs_dcp"] = report["ragckpt_reshard_small"]["gb_per_s"] / report["dcp_load_save"]["gb_per_s"]
        report["ratio_load_vs_dcp"] = report["ragckpt_load"]["gb_per_s"] / report["dcp_load"]["gb_per_s"]
        print(f"  offline reshard / DCP load+save = {report['ratio_offline_vs_dcp']:.2f}x, ragckpt.load / dcp.load = "
              f"{report['ratio_load_vs_dcp']:.2f}x   (target >= 2x)")

        def ceiling(when: str, plain: str, noun: tuple[str, str], modes: tuple[str, str], theirs: str, vs: str, ours: str,
                    ours_label: str, key: str) -> None:
            """What the disk allows: the faster of a plain pass over the same files, buffered or
            O_DIRECT, against DCP's contender, and how close ragckpt's came to it."""
            rates = report[plain]["gb_per_s"], report[plain + "_direct"]["gb_per_s"]
            their = report[theirs]["gb_per_s"]
            report[key] = max(rates) / their
            print(f"  the disk, {when}: plain {noun[1]} got {rates[0]:.2f} GB/s {modes[0]}, {rates[1]:.2f} {modes[1]}; "
                  f"the faster is {report[key]:.2f}x {vs} (2x needs {2 * their:.2f}); {ours_label} / faster plain "
                  f"{noun[0]} = {report[ours]['gb_per_s'] / max(rates):.2f}x")

        # any load reads these files, so none gets far past the faster plain read
        ceiling("cold", "read_floor", ("read", "reads"), ("buffered", "direct"), "dcp_load", "dcp.load", "ragckpt_load",
                "ragckpt.load", "ratio_read_floor_vs_dcp")
        report["ratio_load_vs_dcp_warm"] = report["ragckpt_load_warm"]["gb_per_s"] / report["dcp_load_warm"]["gb_per_s"]
        print(f"  warm (page cache, the disk out of the way): ragckpt.load / dcp.load = "
              f"{report['ratio_load_vs_dcp_warm']:.2f}x")
        # offline, every contender reads the source and writes as much again
        ceiling("offline", "copy_floor", ("copy", "copies"), ("with buffered reads", "with direct"), "dcp_load_save",
                "DCP load+save", "ragckpt_reshard_small", "offline reshard", "ratio_copy_floor_vs_dcp")
    print(json.dumps({"bench_reshard": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
