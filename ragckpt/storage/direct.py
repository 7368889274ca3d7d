"""Direct I/O (O_DIRECT) writes of large local objects.

A checkpoint is written once and read rarely, usually by another process after a restart. Buffered
writes copy every byte into the page cache first, which costs a fresh page allocation per 4 KiB,
evicts data the job still wants cached (its dataset), and makes throughput depend on how much free
memory the kernel has at that moment. O_DIRECT moves the bytes from an aligned buffer straight to
the device. The source memory (a torch tensor, a numpy chunk) has no particular alignment, so bytes
go through one small page-aligned bounce buffer per thread, which stays in the CPU cache. The last
partial block is written padded to the alignment and the file is then truncated to its real size.

File systems without O_DIRECT (tmpfs on older kernels, some FUSE and network mounts) refuse it with
EINVAL, at open or at the first write; the caller then falls back to buffered writes.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Sequence

#: file offset, length and memory alignment for O_DIRECT: 4 KiB covers 512 B and 4 KiB sector devices
ALIGN = 4096
#: bounce buffer per writing thread; each O_DIRECT write request moves this much
BOUNCE_BYTES = 4 << 20
#: objects smaller than this are written buffered: the saving is small and the page cache helps
#: readers of small objects (metadata, the tiny rank objects of very large worlds)
MIN_BYTES = 1 << 20

O_DIRECT: int | None = getattr(os, "O_DIRECT", None)

_local = threading.local()


class DirectUnsupported(Exception):
    """The file system refused O_DIRECT for this file; write it buffered instead."""


def _bounce() -> memoryview:
    mv = getattr(_local, "bounce", None)
    if mv is None:
        mv = memoryview(mmap.mmap(-1, BOUNCE_BYTES))  # anonymous mappings are page aligned
        _local.bounce = mv
    return mv


def _write_exact(fd: int, data: memoryview) -> None:
    n = os.write(fd, data)
    if n != len(data):  # a direct write cannot resume mid-block; a short one means the device is full
        raise OSError(errno.ENOSPC, f"short direct write ({n} of {len(data)} bytes)")


def write_direct(path: str, parts: Sequence[memoryview]) -> None:
    """Write the concatenation of byte views `parts` to `path` (created or truncated) with O_DIRECT.
    Raises DirectUnsupported, before any byte is on disk, where the file system refuses O_DIRECT."""
    if O_DIRECT is None:
        raise DirectUnsupported("this platform has no O_DIRECT")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise DirectUnsupported(str(e)) from None
        raise
    bounce = _bounce()
    fill = written = 0
    try:
        for mv in parts:
            pos = 0
            while pos < len(mv):
                n = min(len(mv) - pos, BOUNCE_BYTES - fill)
                bounce[fill : fill + n] = mv[pos : pos + n]
                fill += n
                pos += n
                if fill == BOUNCE_BYTES:
                    _write_block(fd, bounce, first=written == 0)
                    written += fill
                    fill = 0
        if fill:
            padded = -(-fill // ALIGN) * ALIGN
            bounce[fill:padded] = bytes(padded - fill)
            _write_block(fd, bounce[:padded], first=written == 0)
            written += fill
            os.ftruncate(fd, written)
    finally:
        os.close(fd)


def _write_block(fd: int, data: memoryview, *, first: bool) -> None:
    try:
        _write_exact(fd, data)
    except OSError as e:
        # some file systems accept the O_DIRECT open and refuse the write itself
        if e.errno == errno.EINVAL and first:
            raise DirectUnsupported(str(e)) from None
        raise
