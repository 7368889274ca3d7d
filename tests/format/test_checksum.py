"""The block checksums against an independent crc32c implementation (google-crc32c, which zarr uses)."""

from __future__ import annotations

import os

import google_crc32c
import numpy as np
import pytest
import torch

import ragckpt
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


def test_verify_counts_the_extras_it_checks(tmp_path):
    """The extras objects are checked (a flipped byte is reported), and their bytes now count in the
    report too: a 4 MiB extras object was verified but reported as 32 bytes checked."""
    url = str(tmp_path / "ck")
    lay = ragckpt.CheckpointLayout.build({"w": ((8,), "float32")}, 2)
    for r in range(2):
        extra = {"rng": torch.arange(1 << 20, dtype=torch.int32)} if r == 1 else None
        ragckpt.save_shard(url, r, {"float32": torch.arange(4.0) + 4 * r}, lay, extra=extra)
    ragckpt.commit(url)
    ck = ragckpt.open(url)
    rep = ck.verify()
    extras = os.path.getsize(os.path.join(url, "extra", "1.safetensors"))
    assert rep.ok and extras > 4 << 20 and rep.bytes == ck.verify_bytes() + extras
