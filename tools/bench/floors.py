"""Plain copies of the same bytes with no checksums, no metadata and no layout work. Benchmarks
print them beside ragckpt and its alternatives to show how close each comes to simply moving the
bytes (on a noisy VM a simple copy is not always faster than a tuned pipeline)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

ALIGN = 4096
PIECE = 4 << 20


def _pieces(path: str, direct: bool) -> Iterator[tuple[memoryview, int]]:
    """The file front to back in PIECE reads into one page-aligned buffer: (buffer, bytes landed) per
    read, the buffer valid until the next. With `direct`, O_DIRECT reads, buffered where the file
    system refuses them (at open or at the first read)."""
    buf = mmap.mmap(-1, PIECE)
    mv = memoryview(buf)
    o_direct = getattr(os, "O_DIRECT", 0) if direct else 0
    try:
        fd = os.open(path, os.O_RDONLY | o_direct)
    except OSError:  # no O_DIRECT on this file system
        fd, o_direct = os.open(path, os.O_RDONLY), 0
    try:
        size, off = os.fstat(fd).st_size, 0
        while True:
            try:
                n = os.preadv(fd, [mv], off)
            except OSError:
                if not o_direct or off % ALIGN:
                    raise
                os.close(fd)  # refused at the first read: the rest buffered
                fd, o_direct = os.open(path, os.O_RDONLY), 0
                continue
            if n:
                yield mv, n
            off += n
            if n == 0 or (n < PIECE and off >= size):  # the end (a direct read cannot go on mid-page)
                break
    finally:
        os.close(fd)
        mv.release()
        buf.close()


def _each_file(src: str, threads: int, one: Callable[[str], int]) -> int:
    """Sum of `one(path)` over every file under `src`, `threads` files at a time."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs]
    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(one, files))


def direct_copy_tree(src: str, dst: str, threads: int = 4, *, direct_reads: bool = False) -> int:
    """Copy every file under `src` to `dst` (same relative paths): buffered reads (O_DIRECT ones with
    `direct_reads`), O_DIRECT writes in 4 MiB requests from page-aligned memory, then fsync. Returns
    the bytes copied."""
    def one(path: str) -> int:
        out = os.path.join(dst, os.path.relpath(path, src))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        fo = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
        try:
            off = 0
            for mv, n in _pieces(path, direct_reads):
                os.write(fo, mv[: -(-n // ALIGN) * ALIGN])
                off += n
            os.ftruncate(fo, off)
            os.fsync(fo)
            return off
        finally:
            os.close(fo)

    return _each_file(src, threads, one)


def read_tree(src: str, threads: int = 2, *, direct: bool = False) -> int:
    """Read every file under `src` once, front to back in 4 MiB reads, `threads` files at a time,
    keeping nothing: what the disk gives a reader with no checksums, no layout and no copy into
    place, the ceiling for any load of these files. Buffered by default; with `direct`, O_DIRECT
    reads into page-aligned memory (buffered where the file system refuses them), which on this VM's
    disk got from as much as buffered reads of the same files to twice that. Returns the bytes read."""
    return _each_file(src, threads, lambda path: sum(n for _, n in _pieces(path, direct)))
