"""`ragckpt.format.runs.copy_runs`: many runs between flat tensors, bit-exact, in bounded memory."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from ragckpt.format.runs import copy_runs
from tests.helpers import ALL_DTYPES, assert_bit_equal, special_tensor


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("run", [1, 3, 5000])
def test_runs_land_exactly_where_a_python_loop_puts_them(dtype, run):
    rng = np.random.default_rng(run)
    n_runs = 300
    src = special_tensor((n_runs * run,), dtype, seed=run)
    order = rng.permutation(n_runs)
    dst_starts, src_starts = np.arange(n_runs) * run, order * run
    got = torch.zeros_like(src)
    copy_runs(got, dst_starts, src, src_starts, np.full(n_runs, run))
    want = torch.zeros_like(src)
    for d, s in zip(dst_starts.tolist(), src_starts.tolist(), strict=True):
        want[d : d + run] = src[s : s + run]
    assert_bit_equal(got, want)


def test_many_short_runs_expand_into_a_few_mib_of_indices():
    """An import-dcp of inner-dimension (TP Shard(1)) chunks copies rows of a few thousand elements:
    index arrays for 4M elements at a time (~160 MiB) put it 3x past its memory bound."""
    n_runs, run = 1 << 16, 256  # 64 MiB of float32
    src = torch.arange(n_runs * run, dtype=torch.float32)
    dst = torch.empty_like(src)
    starts = np.random.default_rng(0).permutation(n_runs) * run
    tracemalloc.start()
    try:
        copy_runs(dst, np.arange(n_runs) * run, src, starts, np.full(n_runs, run))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak >> 20} MiB of index arrays"
    assert torch.equal(dst.view(n_runs, run), src.view(n_runs, run)[torch.from_numpy(starts // run)])


@pytest.mark.parametrize("dst_n, src_n, d, s, n", [
    (5, 0, 0, 0, 2),   # an empty source once returned early and copied nothing
    (5, 3, 4, 0, 2),   # past the destination's end: a slice copied 1 element and stopped
    (5, 3, 0, 2, 2),   # past the source's end
    (5, 3, 0, 0, -1),
])
def test_runs_outside_their_tensors_are_refused(dst_n, src_n, d, s, n):
    dst, src = torch.zeros(dst_n), torch.arange(float(src_n))
    with pytest.raises(ValueError, match="a run lies outside its tensors"):
        copy_runs(dst, [d], src, [s], [n])
    assert torch.equal(dst, torch.zeros(dst_n))
    copy_runs(dst, [9], src, [9], [0])  # an empty run may start anywhere
