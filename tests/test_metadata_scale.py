"""Metadata stays O(tensors + ranks) and loads fast at 1,000 tensors x 8,192 ranks."""

from __future__ import annotations

import os
import time

import pytest
import torch

import ragckpt


@pytest.mark.parametrize("kind", ["ragged", "row"])
def test_open_1000_tensors_8192_ranks_under_a_second(tmp_path, kind):
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.w": torch.randn(3 + i % 5, 2, generator=g) for i in range(1000)}
    url = str(tmp_path / "ck")
    ragckpt.write_global(state, url, 8192, kind)
    size = os.path.getsize(tmp_path / "ck" / "zarr.json")
    t = time.perf_counter()
    ck = ragckpt.open(url)
    metas = [ck.meta(n) for n in ck.names()]
    elapsed = time.perf_counter() - t
    assert elapsed < 1.0, f"opening took {elapsed:.2f}s"
    assert len(metas) == 1000 and ck.world_size == 8192
    # JSON metadata does not grow with tensors x ranks: per-(tensor, rank) tables are binary
    assert size < 400 * 1000, f"zarr.json is {size} bytes"
    for n in ("layers.0.w", "layers.999.w"):
        assert torch.equal(ck.read(n), state[n])
