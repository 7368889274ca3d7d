"""The block checksums against an independent crc32c implementation (google-crc32c, which zarr uses)."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest

from ragckpt.storage.checksum import block_crcs, crc32c


def test_crc32c_check_value():
    # the catalogued check value of CRC-32C (Castagnoli) for the ASCII digits 1-9
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


@pytest.mark.parametrize("n", [0, 1, 7, 4095, 4096, (1 << 20) - 1, 1 << 20, (3 << 20) + 5])
@pytest.mark.parametrize("block", [4096, 1 << 20])
def test_block_crcs_match_google_crc32c(n, block):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    want = [google_crc32c.value(data[i : i + block]) for i in range(0, n, block)]
    got = block_crcs(data, block)
    assert got.dtype == np.uint32 and got.tolist() == want
    assert crc32c(memoryview(data)) == google_crc32c.value(data)


def test_crc32c_reads_any_contiguous_buffer():
    # numpy-backed views of other element types are checksummed by their bytes
    a = np.arange(1000, dtype=np.float32)
    assert crc32c(memoryview(a)) == google_crc32c.value(a.tobytes())
    assert block_crcs(a, 1000).tolist() == [google_crc32c.value(a.tobytes()[i : i + 1000]) for i in range(0, 4000, 1000)]
