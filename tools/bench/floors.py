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


def read_tree(src: str, threads: int = 2, *, direct: bool = False) -> int:
    """Read every file under `src` once, front to back in 4 MiB reads, `threads` files at a time,
    keeping nothing: what the disk gives a reader with no checksums, no layout and no copy into
    place, the ceiling for any load of these files. Buffered by default; with `direct`, O_DIRECT
    reads into page-aligned memory (buffered where the file system refuses them), which on this VM's
    disk got from as much as buffered reads of the same files to twice that. Returns the bytes read."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs]
    o_direct = getattr(os, "O_DIRECT", 0) if direct else 0

    def one(path: str) -> int:
        buf = mmap.mmap(-1, PIECE)
        mv = memoryview(buf)
        try:
            fd = os.open(path, os.O_RDONLY | o_direct)
        except OSError:  # no O_DIRECT on this file system
            fd = os.open(path, os.O_RDONLY)
        try:
            size, off = os.fstat(fd).st_size, 0
            while True:
                try:
                    n = os.preadv(fd, [mv], off)
                except OSError:
                    if not o_direct or off % ALIGN:
                        raise
                    os.close(fd)  # refused at the first read: the rest buffered
                    fd = os.open(path, os.O_RDONLY)
                    continue
                off += n
                if n == 0 or (n < PIECE and off >= size):  # the end (a direct read cannot go on mid-page)
                    break
            return off
        finally:
            os.close(fd)
            mv.release()
            buf.close()

    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(one, files))
