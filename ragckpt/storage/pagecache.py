"""Whether a page of an open file is in the page cache, asked without changing the cache.

A load reads a range with O_DIRECT when it is cold (a restarted job) and through the page cache when
it is warm, so it asks first. A one-page read with RWF_NOWAIT would answer (it fails rather than
wait for the disk), but it also starts reading the missing page in: every cold range probed that way
keeps a lone 4 KiB folio at its start. Readahead that later fills those files around the lone folios
builds the whole file out of 4 KiB folios instead of large ones (3-32% of its pages in large folios
against 97%), and every later buffered read of them, a warm reload or a reshard, copies 1.3-1.7x
slower (docs/STORAGE.md, 2026-12-05). mincore() on a fresh mapping of that one page only looks:
mapping a file costs no I/O and no page fault (4 us a question here, against 0.4 us for the read,
once per range of at least 256 KiB).
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

_PAGE = mmap.PAGESIZE


def _bind() -> tuple[ctypes.CDLL, Any] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # mmap64 where the C library has it: a 32-bit build's mmap takes a 32-bit file offset
        mmap_ = getattr(libc, "mmap64", None) or libc.mmap
        munmap, mincore = libc.munmap, libc.mincore
    except (OSError, AttributeError, TypeError):  # no C library with mincore (Windows)
        return None
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc, mmap_


_libc, _mmap = _bind() or (None, None)
_MAP_FAILED = ctypes.c_void_p(-1).value


def page_cached(fd: int, pos: int) -> bool | None:
    """Whether the page holding byte `pos` of the open file `fd` is in the page cache; None where this
    platform or file system cannot tell (no mincore, or the file cannot be mapped, as on some FUSE
    and network mounts). A page past the end of the file is not cached."""
    if _libc is None:
        return None
    base = pos - pos % _PAGE
    addr = _mmap(None, _PAGE, mmap.PROT_READ, mmap.MAP_SHARED, fd, base)
    if addr is None or addr == _MAP_FAILED:
        return None
    try:
        vec = ctypes.c_ubyte(0)
        if _libc.mincore(addr, _PAGE, ctypes.byref(vec)) != 0:
            return None
        return bool(vec.value & 1)
    finally:
        _libc.munmap(addr, _PAGE)
