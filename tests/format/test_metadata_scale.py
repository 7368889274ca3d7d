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
    t = time.process_time()  # CPU time: the target is the code's cost, not the share of a busy machine it got
    ck = ragckpt.open(url)
    metas = [ck.meta(n) for n in ck.names()]
    elapsed = time.process_time() - t
    assert elapsed < 1.0, f"opening took {elapsed:.2f}s"
    assert len(metas) == 1000 and ck.world_size == 8192
    # JSON metadata does not grow with tensors x ranks: per-(tensor, rank) tables are binary
    assert size < 400 * 1000, f"zarr.json is {size} bytes"
    for n in ("layers.0.w", "layers.999.w"):
        assert torch.equal(ck.read(n), state[n])


_ROW_TABLE_SCRIPT = r"""
import sys, torch, ragckpt
def hwm():
    return next(int(l.split()[1]) << 10 for l in open("/proc/self/status") if l.startswith("VmHWM"))
T, W, url, step = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
state = {f"t{i}": torch.arange(i % 5 + 1, dtype=torch.float32) + i for i in range(T)}
base = hwm()
if step == "write":
    lay = ragckpt.CheckpointLayout.build({k: (tuple(v.shape), v.dtype) for k, v in state.items()}, W, "row")
    lay.layout_of(0).segments()
    ragckpt.write_global(state, url, W, lay)
else:
    ck = ragckpt.open(url)
    assert torch.equal(ck.read("t17"), state["t17"]) and torch.equal(ck.read(f"t{T - 1}"), state[f"t{T - 1}"])
    ragckpt.load(ck, ck.layout, W - 1)  # a rank with no data
print(hwm() - base)
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc")
def test_a_row_layouts_units_table_is_the_one_large_array(tmp_path):
    """Rows fewer than ranks: 2,000 tiny tensors at 8,192 ranks hold a 125 MiB (tensors x ranks) units
    table. Writing grew the peak by 5.3 times that (an element table, dense running sums, copies of
    the table to hash, compress and decode it); now by 2.1 (the table and zstd's output buffer),
    and reading by 1.1."""
    import subprocess
    import sys

    T, W = 2000, 8192
    table = T * W * 8
    url = str(tmp_path / "ck")
    for step in ("write", "read"):
        p = subprocess.run([sys.executable, "-c", _ROW_TABLE_SCRIPT, str(T), str(W), url, step], capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        grew = int(p.stdout.strip().splitlines()[-1])
        assert grew < 2.6 * table, f"{step}: peak grew by {grew >> 20} MiB for a {table >> 20} MiB table"
