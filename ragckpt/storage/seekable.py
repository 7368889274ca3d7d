"""The seekable, read-only file interface that libraries want (`zipfile`, botocore request bodies)
over bytes ragckpt already holds or can read in place: a window of an open file, a range of
tensor memory. Subclasses say where the bytes come from (`readinto`); position and seeking are here.
"""

from __future__ import annotations

import io


class SeekableReader(io.RawIOBase):
    """A read-only file of `size` bytes; seeks are clamped to [0, size]."""

    def __init__(self, size: int):
        super().__init__()
        self._size = size
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(0, base + offset), self._size)
        return self._pos
