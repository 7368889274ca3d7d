"""Plain copies of the same bytes with no checksums, no metadata and no layout work. Benchmarks
print them beside ragckpt and its alternatives to show how close each comes to simply moving the
bytes (on a noisy VM a simple copy is not always faster than a tuned pipeline)."""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor

ALIGN = 4096
PIECE = 4 << 20


def direct_copy_tree(src: str, dst: str, threads: int = 4) -> int:
    """Copy every file under `src` to `dst` (same relative paths): buffered reads, O_DIRECT writes
    in 4 MiB requests from page-aligned memory, then fsync. Returns the bytes copied."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs]

    def one(path: str) -> int:
        out = os.path.join(dst, os.path.relpath(path, src))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        buf = mmap.mmap(-1, PIECE)
        mv = memoryview(buf)
        fi = os.open(path, os.O_RDONLY)
        fo = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
        try:
            off = 0
            while True:
                n = os.preadv(fi, [mv], off)
                if n <= 0:
                    break
                os.write(fo, mv[: -(-n // ALIGN) * ALIGN])
                off += n
            os.ftruncate(fo, off)
            os.fsync(fo)
            return off
        finally:
            os.close(fi)
            os.close(fo)
            mv.release()
            buf.close()

    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(one, files))


def read_tree(src: str, threads: int = 2) -> int:
    """Read every file under `src` once, front to back in 4 MiB buffered reads, `threads` files at a
    time, keeping nothing: what the disk gives a reader with no checksums, no layout and no copy
    into place, the ceiling for any load of these files. Returns the bytes read."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs]

    def one(path: str) -> int:
        buf = mmap.mmap(-1, PIECE)
        mv = memoryview(buf)
        fd = os.open(path, os.O_RDONLY)
        try:
            off = 0
            while (n := os.preadv(fd, [mv], off)) > 0:
                off += n
            return off
        finally:
            os.close(fd)
            mv.release()
            buf.close()

    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(one, files))

