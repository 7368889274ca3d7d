"""Direct I/O (O_DIRECT) writes of large local objects, and reads of cold ones.

A checkpoint is written once and read rarely, usually by another process after a restart. Buffered
writes copy every byte into the page cache first, which costs a fresh page allocation per 4 KiB,
evicts data the job still wants cached (its dataset), and makes throughput depend on how much free
memory the kernel has at that moment. O_DIRECT moves the bytes from an aligned buffer straight to
the device. Page-aligned source memory is written as is (`aligned_empty` allocates such buffers);
other memory (a plain torch tensor starts 64 bytes into a page) goes through one page-aligned bounce
buffer per thread. The last partial block is written padded to the alignment and the file is then
truncated to its real size.

A read that finds its object outside the page cache (a restarted job's restore, a load-time reshard)
reads it the same way, straight into page-aligned memory or through the bounce buffer: the page
cache would only cost a page allocation and a copy per 4 KiB of data that is read once.

File systems without O_DIRECT (tmpfs on older kernels, some FUSE and network mounts) refuse it with
EINVAL, at open, at the first write or read; the caller then falls back to buffered I/O.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
else:
    from ragckpt.lazy import torch

#: file offset, length and memory alignment for O_DIRECT: 4 KiB covers 512 B and 4 KiB sector devices
ALIGN = 4096
#: bounce buffer per writing thread (unaligned sources); requests of a few MiB keep the device busy
BOUNCE_BYTES = 8 << 20
#: largest single write request from aligned caller memory
REQUEST_BYTES = 16 << 20
#: objects smaller than this are written buffered: each direct write waits for the device, which
#: below about 128 KiB costs more than the page-cache copy it saves (one process writing 8192 rank
#: objects of 48-64 KiB: 2.9-3.4 s direct against 2.3-2.7 s buffered; a 8192 -> 4096 reshard writing
#: 135 KB objects: 5.4-5.75 s direct against 6.3 s buffered). Metadata stays buffered.
MIN_BYTES = 128 << 10
#: cold ranges smaller than this (one checksum block) are read buffered: a reshard of 8192 ranks
#: reads thousands of objects of about 128 KiB, and a direct read has nothing in flight before it
#: starts, where a buffered one often finds its bytes read ahead with the previous range of the file.
#: From here on direct reads won: a cold `ragckpt.load` 4 -> 2 of 1 GiB, reading ranges of 3.5-4 MiB
#: (into one view or scattered into several), took 0.445-0.48 s direct against 0.48-1.05 s buffered
#: in 4 sets of alternating runs on 2026-12-05 (the buffered times swinging with the disk's state),
#: though on an earlier day 3-4 MiB runs had read faster buffered (0.67-0.70 s against 0.82-0.85 s).
#: Whole rank buffers (an engine's restore) are far longer.
MIN_READ_BYTES = 1 << 20

O_DIRECT: int | None = getattr(os, "O_DIRECT", None)

_local = threading.local()


_zeros_lock = threading.Lock()
_zeros: memoryview = memoryview(b"")


def zeros(nbytes: int) -> memoryview:
    """`nbytes` zero bytes, read-only, shared by every caller: the padding of a chunk's tail. Its
    pages are never written, so they cost no memory (a read maps the kernel's zero page); a fresh
    `bytes(pad)` per chunk came from the writing thread's malloc arena, touched and kept."""
    global _zeros
    if nbytes > len(_zeros):
        with _zeros_lock:
            if nbytes > len(_zeros):
                _zeros = memoryview(mmap.mmap(-1, max(nbytes, 1 << 20), flags=mmap.MAP_PRIVATE)).toreadonly()
    return _zeros[:nbytes]


class DirectUnsupported(Exception):
    """The file system refused O_DIRECT for this file; write it buffered instead."""


def bounce() -> memoryview:
    mv = getattr(_local, "bounce", None)
    if mv is None:
        mv = memoryview(mmap.mmap(-1, BOUNCE_BYTES))  # anonymous mappings are page aligned
        _local.bounce = mv
    return mv


def _write_block(fd: int, data: memoryview, *, first: bool) -> None:
    try:
        n = os.write(fd, data)
    except OSError as e:
        # some file systems accept the O_DIRECT open and refuse the write itself
        if e.errno == errno.EINVAL and first:
            raise DirectUnsupported(str(e)) from None
        raise
    if n != len(data):  # a direct write cannot resume mid-block; a short one means the device is full
        raise OSError(errno.ENOSPC, f"short direct write ({n} of {len(data)} bytes)")


def address(mv: memoryview) -> int:
    """Memory address of a byte view's first byte."""
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if len(mv) else 0


def write_direct(path: str, parts: Sequence[memoryview]) -> None:
    """Write the concatenation of byte views `parts` to `path` (created or truncated) with O_DIRECT.
    Page-aligned memory (see `aligned_empty`) goes to the device as is; anything else, and the last
    partial block, through the bounce buffer. Raises DirectUnsupported, before any byte is on disk,
    where the file system refuses O_DIRECT."""
    if O_DIRECT is None:
        raise DirectUnsupported("this platform has no O_DIRECT")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise DirectUnsupported(str(e)) from None
        raise
    buf = bounce()
    fill = written = 0
    try:
        for mv in parts:
            pos = 0
            if fill == 0 and len(mv) >= ALIGN and address(mv) % ALIGN == 0:
                # zero copy: the aligned whole blocks of this part straight from caller memory
                whole = (len(mv) // ALIGN) * ALIGN
                while pos < whole:
                    n = min(whole - pos, REQUEST_BYTES)
                    _write_block(fd, mv[pos : pos + n], first=written == 0)
                    written += n
                    pos += n
            while pos < len(mv):
                n = min(len(mv) - pos, BOUNCE_BYTES - fill)
                buf[fill : fill + n] = mv[pos : pos + n]
                fill += n
                pos += n
                if fill == BOUNCE_BYTES:
                    _write_block(fd, buf, first=written == 0)
                    written += fill
                    fill = 0
        if fill:
            padded = -(-fill // ALIGN) * ALIGN
            buf[fill:padded] = zeros(padded - fill)
            _write_block(fd, buf[:padded], first=written == 0)
            written += fill
            os.ftruncate(fd, written)
    finally:
        os.close(fd)


def set_direct(fd: int, on: bool) -> None:
    """Turn O_DIRECT on or off for the open file `fd` (Linux allows both on an open file). Raises
    DirectUnsupported where the file system refuses it."""
    if O_DIRECT is None:
        raise DirectUnsupported("this platform has no O_DIRECT")
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT if on else flags & ~O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise DirectUnsupported(str(e)) from None
        raise


def read_direct(fd: int, pos: int, out: memoryview, *, first: bool) -> int:
    """One read of `out` (whole ALIGN-byte blocks, at most BOUNCE_BYTES) from `fd` at `pos` (aligned),
    `fd` in O_DIRECT mode: into `out` itself where it is page-aligned, else through this thread's
    bounce buffer. Returns the bytes landed; fewer than asked at the end of the file (the caller
    resumes or names the truncation). `first`: nothing was read yet, so an EINVAL means the file
    system refuses O_DIRECT (DirectUnsupported) rather than failing mid-way."""
    aligned = address(out) % ALIGN == 0
    target = out if aligned else bounce()[: len(out)]
    try:
        n = os.preadv(fd, (target,), pos)
    except OSError as e:
        if e.errno == errno.EINVAL and first:
            raise DirectUnsupported(str(e)) from None
        raise
    if not aligned:  # numpy copies with the GIL released: other threads read meanwhile
        np.copyto(np.frombuffer(out[:n], np.uint8), np.frombuffer(target[:n], np.uint8))
    return n


class ThreadBuffers:
    """One reusable, page-aligned scratch buffer per thread, grown on demand, released with this
    object (and its threads). For streaming code whose worker threads fill a chunk at a time: a
    fresh buffer per chunk is freed into that thread's glibc malloc arena, which keeps it, so peak
    RSS grew to several times the window (a diff with a 32 MiB window held 290 MiB). The memory is an
    anonymous mapping, so it goes back to the kernel when dropped, never into an arena."""

    def __init__(self, min_bytes: int = 0):
        self._local = threading.local()
        self._min = int(min_bytes)

    def take(self, nbytes: int) -> np.ndarray:
        """`nbytes` bytes of this thread's buffer (uint8, writable), valid until its next `take`."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            self._local.buf = None  # the old one goes before the new one is mapped
            # private: a shared anonymous mapping counts as shmem and stays alive in a forked child
            buf = np.frombuffer(mmap.mmap(-1, max(nbytes, self._min, 1), flags=mmap.MAP_PRIVATE), dtype=np.uint8)
            self._local.buf = buf
        return buf[:nbytes]

    def take_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of `numel` elements on this thread's buffer whose storage is exactly its
        bytes (`torch.save` writes a tensor's whole storage)."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(0, dtype=dtype, device="cpu")
        return torch.frombuffer(self.take(nbytes), dtype=torch.uint8).view(dtype)


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data starts on a page boundary. Flat buffers (or the CPU
    staging copies of GPU buffers) allocated this way are written to local disks with no copy at all;
    ordinary tensors start 64 bytes into a page and go through the bounce buffer."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"aligned_empty: numel must be a non-negative int, got {numel!r}")
    isz = torch.empty(0, dtype=dtype).element_size()
    raw = torch.empty(numel * isz + ALIGN, dtype=torch.uint8, device="cpu")
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + numel * isz].view(dtype)
