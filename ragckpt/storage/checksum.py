"""Per-block crc32c checksums.

Every stored object is checksummed in fixed blocks (default 1 MiB), so a partial range read can be
verified by reading whole blocks around it instead of the whole object. crc32c is hardware
accelerated (SSE4.2 / ARMv8 CRC) and runs at memory speed, unlike zlib.crc32 or SHA-256.
"""

from __future__ import annotations

import crc32c as _crc32c
import numpy as np

DEFAULT_BLOCK_BYTES = 1 << 20


def crc32c(data) -> int:
    return _crc32c.crc32c(data)


def block_crcs(data, block_bytes: int = DEFAULT_BLOCK_BYTES) -> np.ndarray:
    """crc32c of every `block_bytes` block of `data` (the last block may be short)."""
    mv = memoryview(data).cast("B")
    n = len(mv)
    count = -(-n // block_bytes)
    out = np.empty(count, dtype=np.uint32)
    for i in range(count):
        out[i] = _crc32c.crc32c(mv[i * block_bytes : (i + 1) * block_bytes])
    return out


def bad_blocks(data, expected: np.ndarray, first_block: int = 0, block_bytes: int = DEFAULT_BLOCK_BYTES) -> list[int]:
    """Indices (absolute) of blocks in `data` whose crc does not match `expected[first_block:]`."""
    got = block_crcs(data, block_bytes)
    want = expected[first_block : first_block + len(got)]
    if len(want) != len(got):
        return list(range(first_block + len(want), first_block + len(got))) or [first_block]
    return [first_block + int(i) for i in np.nonzero(got != want)[0]]
