"""Save and load by real rank processes, the way a training job does it: 8 gloo processes each hold
their FSDP2 `Shard(0)` piece of every tensor of a ~1 GiB Llama-shaped state, then
  * ragckpt: every rank `save_shard`s its flat buffer (no collective planning), rank 0 commits;
    load: every rank reads its own buffer back into preallocated memory (`read_rank(out=)`);
  * DCP: `torch.distributed.checkpoint.save` of the DTensor state dict (collective planning
    included), then `dcp.load` into preallocated DTensors;
  * raw, for reference: every rank writes its flat buffer as one plain file (fsynced) and reads it
    back, what moving the bytes costs with no format, no checksums and no metadata.
Timed from a barrier to the slowest rank. Loads are timed cold (the saved files evicted from the page
cache first, as after a restart) and warm (read again after a plain read filled the page cache,
which a cold ragckpt restore with O_DIRECT does not; best of WARM_READS reads). Prints GB/s and
the ratios ragckpt/DCP (target >= 1.5x) and ragckpt/raw (target >= 0.8x). The ragckpt ranks also
time warm loads by turns with plain reads of the same bytes from one file each (`warm_pair`), the
steadier ratio on a VM whose separate process sets read at different speeds.

Usage: python -m tools.bench.bench_save_ranks [--gib 1.0] [--ranks 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import warnings

from tools.bench import procs
from tools.bench.cache import drop_page_cache
from tools.bench.floors import read_tree
from tools.bench.report import print_rates, print_ratios

MODULE = "tools.bench.bench_save_ranks"
WARM_READS = 5


def local_state(gib: float, rank: int, world: int):
    """This rank's torch.chunk row piece of every tensor (contents seeded per rank and tensor)."""
    import torch

    from tools.bench.bench_save import llama_shapes

    out = {}
    for i, (name, shape) in enumerate(llama_shapes(gib)):
        rows = torch.chunk(torch.empty(shape[0], 0), world)[rank].shape[0] if rank < min(world, shape[0]) else 0
        g = torch.Generator().manual_seed(1000 * i + rank)
        out[name] = (shape, torch.randn(rows, *shape[1:], generator=g))
    return out


def write_plain(path: str, buf) -> None:
    """`buf`'s bytes as one plain file, fsynced: the floor a checkpoint format is measured against."""
    from ragckpt.format.dtypes import as_bytes

    with open(path, "wb") as f:
        f.write(as_bytes(buf))
        os.fsync(f.fileno())


def read_plain(path: str, out) -> None:
    from ragckpt.format.dtypes import as_bytes

    with open(path, "rb") as f:
        f.readinto(as_bytes(out))


def warm_pair(load, buf, out, plain: str, timed) -> list[float]:
    """Best warm times of `load` and of a plain read of the same bytes from one file, taking turns in
    the same processes, each file's page cache filled by a read: plain reads from the pages a
    buffered write had left ran at 16 GB/s, against 12.6 from pages a read filled. Separate process
    sets also swung plain reads alone from 12 to 17 GB/s."""
    write_plain(plain, buf)
    drop_page_cache(plain)  # its page cache filled by a read, as the checkpoint's was by the cold load
    read_plain(plain, out)
    try:
        pairs = [(timed(load), timed(lambda: read_plain(plain, out))) for _ in range(WARM_READS)]
    finally:
        os.unlink(plain)
    return [min(p[0] for p in pairs), min(p[1] for p in pairs)]


def _role(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ragckpt

    warnings.filterwarnings("ignore")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    state = local_state(args.gib, rank, world)
    result = {"rank": rank, "bytes": sum(t.numel() * 4 for _, t in state.values())}

    def timed(fn) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t

    def loads(fn) -> None:
        dist.barrier()
        if rank == 0:
            drop_page_cache(args.path)
        result["load"] = timed(fn)
        # a cold ragckpt restore reads with O_DIRECT and leaves nothing cached: a plain read fills the
        # page cache for every contender alike before the warm loads
        if rank == 0:
            read_tree(args.path, threads=min(world, 8))
        # a 1 GiB read from the page cache takes ~0.1 s, within the VM's jitter: best of several
        result["warm_load"] = min(timed(fn) for _ in range(WARM_READS))

    if args.role == "dcp":
        mesh = init_device_mesh("cpu", (world,))

        def as_dtensor(shape, local):
            return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                      stride=torch.empty(shape, device="meta").stride())
        sd = {n: as_dtensor(s, t) for n, (s, t) in state.items()}
        result["save"] = timed(lambda: dcp.save(sd, checkpoint_id=args.path))
        # a restarted engine's state exists (initialised) before it loads: zeros, not untouched memory,
        # whose first-touch page faults this VM charges at ~0.5 GB/s and would be timed as the load
        back = {n: as_dtensor(s, torch.zeros_like(t)) for n, (s, t) in state.items()}
        loads(lambda: dcp.load(back, checkpoint_id=args.path))
        ok = all(torch.equal(back[n].to_local(), t) for n, (_, t) in state.items())
    else:
        lay = ragckpt.CheckpointLayout.build({n: (s, "float32") for n, (s, _) in state.items()}, world, "row")
        # FSDP2-style rank buffer: this rank's pieces of every tensor, in order (built before timing)
        pieces = [t.reshape(-1) for _, t in state.values()]
        buf = ragckpt.aligned_empty(sum(p.numel() for p in pieces), torch.float32)  # as the engine allocates it
        torch.cat(pieces, out=buf)
        nbytes = result["bytes"]
        state.clear()  # hold the same memory as the DCP side: one copy of the shards
        assert buf.numel() * 4 == nbytes
        # the engine's buffer to restore into: page-aligned as it allocates it (a cold restore then
        # reads into it with O_DIRECT, no bounce copy), and existing before the load like DCP's targets
        out = ragckpt.aligned_empty(buf.numel(), buf.dtype).zero_()
        if args.role == "raw":  # the floor: the same buffer as one plain file per rank, fsynced
            own = os.path.join(args.path, f"rank{rank}.bin")

            def raw_save() -> None:
                os.makedirs(args.path, exist_ok=True)
                write_plain(own, buf)

            def raw_load() -> None:
                read_plain(own, out)

            result["save"] = timed(raw_save)
            loads(raw_load)
        else:
            def save() -> None:
                ragckpt.save_shard(args.path, rank, {"float32": buf}, lay)
                dist.barrier()
                if rank == 0:
                    ragckpt.commit(args.path)

            def load() -> None:
                ragckpt.open(args.path).read_rank(0, rank, out=out)

            result["save"] = timed(save)
            loads(load)
            result["warm_pair"] = warm_pair(load, buf, out, f"{args.path}-plain{rank}.bin", timed)
        ok = torch.equal(out, buf)
    if not ok:
        raise SystemExit(f"rank {rank}: data read back differs")
    dist.destroy_process_group()
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--role", choices=["ragckpt", "dcp", "raw"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        return _role(args)
    root = tempfile.mkdtemp(prefix="bench-save-ranks-")
    try:
        best: dict[str, list[float]] = {}
        pair: list[float] = []  # best warm (ragckpt, plain file), read alternately by the same ranks
        keys = ("save", "load", "warm_load")
        nbytes = 0
        for i in range(args.repeat):
            order = ("raw", "ragckpt", "dcp")
            for who in order[i % 3:] + order[: i % 3]:  # contenders take turns: order matters on a VM
                path = os.path.join(root, f"{who}{i}")
                res = procs.run_ranks(MODULE, who, args.ranks, ["--gib", str(args.gib), "--path", path])
                nbytes = sum(r["bytes"] for r in res)
                times = [max(r[k] for r in res) for k in keys]
                best[who] = [min(a, b) for a, b in zip(best.get(who, times), times, strict=True)]
                if who == "ragckpt":
                    both = [max(r["warm_pair"][k] for r in res) for k in (0, 1)]
                    pair = [min(a, b) for a, b in zip(pair or both, both, strict=True)]
                shutil.rmtree(path, ignore_errors=True)
        print(f"state: {nbytes / 2**30:.2f} GiB over {args.ranks} rank processes (FSDP2 Shard(0) pieces), "
              f"best of {args.repeat}")
        cols = ("save", "cold load", "warm load")
        rates = {who: [nbytes / t / 1e9 for t in times] for who, times in best.items()}
        print_rates(cols, rates)
        print_ratios(cols, rates["ragckpt"], rates["dcp"], "ragckpt / DCP ", 1.5)
        print_ratios(cols, rates["ragckpt"], rates["raw"], "ragckpt / raw ", 0.8)
        rag_warm, plain_warm = (nbytes / t / 1e9 for t in pair)
        print(f"warm load, ragckpt and a plain file read by turns in the same processes: {rag_warm:.2f} / "
              f"{plain_warm:.2f} GB/s = {rag_warm / plain_warm:.2f}x (target >= 0.8x)")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
