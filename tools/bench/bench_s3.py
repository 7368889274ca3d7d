"""Save/load throughput on S3 (a local moto server) against plain s3fs transfers of the same bytes.

    python -m tools.bench.bench_s3 --gib 0.25 [--repeat 3] [--world 4]

What is compared, side by side in one run (this VM's timings drift between runs):

* save: `ragckpt.write_global` of a state (chunk objects, per-block crc32c, metadata, rank
  manifests, conditional commit marker) vs `s3fs.pipe` of the same object sizes, all at once;
* load: `Checkpoint.read` of every tensor (ranged GETs, checksum verification, reassembly into
  tensors) vs `s3fs.cat` of the same objects, all at once.

* with S3's latency: the same loads again through the fault proxy of the tests holding every reply
  back `--latency-ms` plus 1 s per `--mbps` MB (a first byte after tens of ms, about 100 MB/s per
  connection, as S3 serves them; moto on this machine answers in a millisecond, so without it a
  reader that keeps one GET in flight at a time looks as fast as one that keeps many): an engine's
  restore (`read_rank(out=)` of every rank, one thread per rank as one process per rank would) and
  `ragckpt.load`, against `s3fs.cat` of the same objects, all at once.

The moto server runs in a child process (its own GIL, as a real server would be) and keeps every
byte in RAM, so the data size is capped (256 MiB by default); the size used is printed. Two layouts
run: `--world` ranks (objects of state/world bytes, single PUTs) and one rank (256 MiB chunk
objects, multipart uploads on both sides). After one warm-up round, saves alternate with plain puts
and loads with plain gets; the best time of each is kept. Target: ragckpt >= 0.8x plain s3fs.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import uuid

MiB = 1 << 20
GiB = 1 << 30
TARGET = 0.8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_moto() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto server did not start within 60 s")


def _shaped_loads(shaped: tuple, opts: dict, last: str, plain_paths: list[str], stored: int, total: int,
                  new_world: int, repeat: int, rate) -> bool:
    """The restore and load-time reshard of checkpoint `last` against plain s3fs `cat` of the same
    objects, all through the delaying proxy; False if data came back wrong."""
    from concurrent.futures import ThreadPoolExecutor

    import s3fs
    import torch

    import ragckpt
    from ragckpt.format.dtypes import torch_dtype
    from ragckpt.reshard.plan import target_layout

    proxy, sopts = shaped
    sfs = s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs=sopts["client_kwargs"])
    ck = ragckpt.open(last, storage_options=sopts)
    lay = ck.layout
    bufs = [[torch.empty(int(lay.rank_sizes(b)[r]), dtype=torch_dtype(spec.dtype)) for b, spec in enumerate(lay.buffers)]
            for r in range(ck.world_size)]
    target = target_layout(lay, new_world, "row")
    ok = [True]

    def restore() -> None:
        def rank(r: int) -> None:
            for b, out in enumerate(bufs[r]):
                ck.read_rank(b, r, out=out)
        with ThreadPoolExecutor(ck.world_size) as ex:
            list(ex.map(rank, range(ck.world_size)))

    loaded: list = []

    def load() -> None:
        with ThreadPoolExecutor(new_world) as ex:
            loaded[:] = ex.map(lambda r: ragckpt.load(ck, target, r), range(new_world))

    def plain() -> None:
        if sum(len(v) for v in sfs.cat(plain_paths).values()) != stored:
            ok[0] = False

    best = {"restore": float("inf"), "load": float("inf"), "plain": float("inf")}
    inflight = {}
    for _ in range(repeat):
        for name, fn in (("restore", restore), ("load", load), ("plain", plain)):
            proxy.stats.max_inflight = 0
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
            inflight[name] = proxy.stats.max_inflight
    # checked against the same reads straight from the server, outside the timings
    direct = ragckpt.open(last, storage_options=opts)
    for r in range(ck.world_size):
        for b, out in enumerate(bufs[r]):
            ok[0] = ok[0] and torch.equal(out.view(torch.uint8), direct.read_rank(b, r).view(torch.uint8))
    for r, got in enumerate(loaded):
        want = ragckpt.load(direct, target, r)
        ok[0] = ok[0] and all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
    lat, mbps = proxy.faults.latency_s, proxy.faults.bandwidth / 1e6
    print(f"with S3's latency ({lat * 1000:.0f} ms + 1 s per {mbps:.0f} MB per request; most GETs in flight):")
    print(f"      ragckpt restore, {ck.world_size} ranks   : {best['restore']:6.2f} s {rate(total, best['restore'])}  "
          f"({inflight['restore']} in flight; {best['plain'] / best['restore']:.2f}x of plain s3fs cat)")
    print(f"      ragckpt.load -> {new_world} ranks  : {best['load']:6.2f} s {rate(total, best['load'])}  "
          f"({inflight['load']} in flight; {best['plain'] / best['load']:.2f}x of plain s3fs cat)")
    print(f"      plain s3fs cat           : {best['plain']:6.2f} s {rate(stored, best['plain'])}  "
          f"({inflight['plain']} in flight)")
    return ok[0]


def _scenario(fs, bucket: str, opts: dict, state: dict, world: int, repeat: int,
              shaped: tuple | None = None) -> list[float] | None:
    """Save and load `state` laid out for `world` ranks, and the same objects with plain s3fs;
    prints timings and returns the [save, load] ratios (None if data came back wrong)."""
    import torch

    import ragckpt
    from ragckpt.storage.store import open_store

    total = sum(t.numel() * t.element_size() for t in state.values())
    flat = torch.cat([t.reshape(-1) for t in state.values()]).view(torch.uint8).numpy()

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    # Round 0 is a warm-up (the server process touches fresh memory); then saves alternate with
    # plain puts, each deleted before the next round so the server's memory stays level.
    t_rg_save, t_plain_put = float("inf"), float("inf")
    blobs: dict[str, bytes] = {}
    keys: list[str] = []
    sizes: dict[str, int] = {}
    for i in range(repeat + 1):
        ck = f"s3://{bucket}/w{world}/ck{i}"
        t = timed(lambda ck=ck: ragckpt.write_global(state, ck, world, storage_options=opts))
        t_rg_save = min(t_rg_save, t) if i else t_rg_save
        if not blobs:  # plain s3fs gets the same object sizes, filled with the same bytes
            store = open_store(ck, opts)
            keys = store.list()
            sizes = {k: store.size(k) for k in keys}
            pos = 0
            for k in keys:
                n = sizes[k]
                blobs[k] = flat[pos : pos + n].tobytes() if pos + n <= len(flat) else bytes(n)
                pos += n if pos + n <= len(flat) else 0
        plain = f"{bucket}/w{world}/plain{i}"
        t = timed(lambda plain=plain: fs.pipe({f"{plain}/{k}": v for k, v in blobs.items()}))
        t_plain_put = min(t_plain_put, t) if i else t_plain_put
        if i < repeat:
            open_store(ck, opts).delete_all()
            fs.rm(plain, recursive=True)
    last = f"s3://{bucket}/w{world}/ck{repeat}"
    plain_paths = [f"{bucket}/w{world}/plain{repeat}/{k}" for k in keys]
    stored = sum(sizes.values())

    ok = [True]

    def rg_load() -> None:
        ck = ragckpt.open(last, storage_options=opts)
        for name, t in state.items():
            if not torch.equal(ck.read(name), t):
                ok[0] = False

    new_world = world // 2 if world > 1 else 2
    target = None

    def rg_reshard_load() -> None:  # an elastic restart: every rank of the new world loads its share
        nonlocal target
        ck = ragckpt.open(last, storage_options=opts)
        if target is None:
            from ragckpt.reshard.plan import target_layout

            target = target_layout(ck.layout, new_world, "row")
        for r in range(new_world):
            ragckpt.load(ck, target, r)

    def plain_get() -> None:
        got = fs.cat(plain_paths)
        if sum(len(v) for v in got.values()) != stored:
            ok[0] = False

    t_rg_load, t_plain_get, t_rg_reshard = float("inf"), float("inf"), float("inf")
    for _ in range(repeat + 1):  # interleaved, so drift hits all alike
        t_rg_load = min(t_rg_load, timed(rg_load))
        t_plain_get = min(t_plain_get, timed(plain_get))
        t_rg_reshard = min(t_rg_reshard, timed(rg_reshard_load))
    if not ok[0]:
        print("ERROR: data read back differs from what was written")
        return None
    big = max(sizes.values())

    def rate(b: int, t: float) -> str:
        return f"{b / MiB / t:7.1f} MiB/s"

    print(f"\n-- world size {world}: {len(keys)} objects, largest {big / MiB:.1f} MiB "
          f"({stored / MiB:.1f} MiB stored for {total / MiB:.1f} MiB of tensors)")
    print(f"save  ragckpt write_global     : {t_rg_save:6.2f} s {rate(total, t_rg_save)}")
    print(f"      plain s3fs pipe          : {t_plain_put:6.2f} s {rate(stored, t_plain_put)}")
    print(f"load  ragckpt read (verified)  : {t_rg_load:6.2f} s {rate(total, t_rg_load)}")
    print(f"      plain s3fs cat           : {t_plain_get:6.2f} s {rate(stored, t_plain_get)}")
    print(f"      ragckpt.load -> {new_world} ranks  : {t_rg_reshard:6.2f} s {rate(total, t_rg_reshard)}  "
          f"(load-time reshard, {t_plain_get / t_rg_reshard:.2f}x of plain s3fs cat)")
    if shaped is not None and not _shaped_loads(shaped, opts, last, plain_paths, stored, total, new_world, repeat, rate):
        print("ERROR: data read back through the delaying proxy differs from what was written")
        return None
    r_save, r_load = t_plain_put / t_rg_save, t_plain_get / t_rg_load
    for what, r in (("save", r_save), ("load", r_load)):
        print(f"ratio {what}: {r:.2f}x of plain s3fs ({'meets' if r >= TARGET else 'BELOW'} the {TARGET}x target)")
    open_store(f"s3://{bucket}/w{world}", opts).delete_all()
    return [r_save, r_load]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=0.25, help="state size in GiB (capped by --max-mib)")
    ap.add_argument("--max-mib", type=int, default=256, help="cap: moto keeps everything in RAM")
    ap.add_argument("--world", type=int, default=4, help="ranks the checkpoint is laid out for")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (best kept)")
    ap.add_argument("--latency-ms", type=float, default=30.0, help="S3's first-byte latency, for the delayed loads")
    ap.add_argument("--mbps", type=float, default=100.0, help="MB/s one S3 request moves, for the delayed loads")
    args = ap.parse_args(argv)

    saved_env = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                                 "AWS_EC2_METADATA_DISABLED")}
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    proc = proxy = None
    try:
        import s3fs
        import torch

        nbytes = int(min(args.gib * GiB, args.max_mib * MiB))
        nbytes -= nbytes % (8 * 4096)
        capped = " (capped: the moto server holds everything in RAM)" if nbytes < args.gib * GiB - 4096 else ""
        print(f"data: {nbytes / MiB:.0f} MiB{capped}, world size {args.world}, best of {args.repeat}")

        proc, endpoint = _start_moto()
        opts = {"client_kwargs": {"endpoint_url": endpoint}}
        from tests.s3_fault_proxy import FaultProxy

        proxy = FaultProxy(int(endpoint.rsplit(":", 1)[1]))
        proxy.start()
        proxy.configure(latency_s=args.latency_ms / 1000, bandwidth=args.mbps * 1e6)
        shaped = (proxy, {"client_kwargs": {"endpoint_url": proxy.url}})
        fs = s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": endpoint})
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        fs.mkdir(bucket)

        g = torch.Generator().manual_seed(0)
        n_tensors = 8
        per = nbytes // n_tensors // 4
        state = {f"layers.{i}.weight": torch.randn(per // 1024, 1024, generator=g) for i in range(n_tensors)}
        worlds = [args.world] if args.world != 1 else [1]
        if 1 not in worlds:
            worlds.append(1)  # one rank: every chunk object is large enough for multipart uploads
        ratios = []
        for world in worlds:
            r = _scenario(fs, bucket, opts, state, world, args.repeat, shaped)
            if r is None:
                return 1
            ratios.extend(r)
        worst = min(ratios)
        print(f"worst ratio: {worst:.2f}x ({'meets' if worst >= TARGET else 'BELOW'} the {TARGET}x target)")
        fs.rm(bucket, recursive=True)
        return 0
    finally:
        if proxy is not None:
            proxy.stop()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


if __name__ == "__main__":
    sys.exit(main())
