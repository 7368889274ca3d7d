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

